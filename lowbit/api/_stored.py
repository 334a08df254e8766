"""Compiled programs whose traced form is kept on disk, so that a second start skips tracing.

A server, a generation loop or a user's own ``jax.jit(lowbit.run(fn))`` compiles a handful of
programs (a decode step, prefill widths) over a quantized model. JAX's persistent compilation
cache already skips XLA's compile on a second start, but not the Python trace in front of it:
tracing lowbit's engine through every layer of a 1.5B model takes seconds per program, and
that trace is what a warm start is made of. `compile_stored` keeps each program's lowered form
(``jax.export``, StableHLO, no Python objects) in a directory, keyed by everything the trace
depends on except the arrays' values:

  * the program's name and its static description (the model's graph definition and config,
    with process-specific addresses removed);
  * the argument pytree's structure (which holds every quantized weight's format, layout and
    kernel route) and every leaf's shape and dtype;
  * JAX's version, the platform, the tracing options that change a program, and lowbit's own
    code (a digest of its source files and compiled kernels), so an upgrade never reuses a
    stale program.

A program found there is deserialized and compiled (the compile itself comes from JAX's
cache); one not found is traced, exported, written atomically and compiled. Export refuses
some programs (effects it cannot serialize, say): those are traced and compiled as usual,
with the reason logged once. Weights' values are never written: only the program.

Loading never executes Python: the file is a flatbuffer of StableHLO bytecode, read by JAX's
own deserializer. The folder deserves the trust JAX's compilation cache beside it does (that
one holds machine code).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import logging
import os
import pathlib
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jaxlib
from jax import export

from lowbit import kernels
from lowbit._atomic import atomic_write
from lowbit._host_memory import release_free_memory

_log = logging.getLogger("lowbit.api")

PROGRAMS_FOLDER = "lowbit-programs"
_SUFFIX = ".jaxexport"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
# Programs compiled in this process, by key: a second request for one is free (as jax.jit's
# own cache makes a second call of a jitted function).
_COMPILED: dict[tuple, StoredProgram] = {}


def program_directory() -> str | None:
    """Where programs are kept: a ``lowbit-programs`` folder in JAX's persistent compilation
    cache directory (the lowbit CLI turns that cache on), or None when it is off."""
    cache = jax.config.jax_compilation_cache_dir
    return os.path.join(cache, PROGRAMS_FOLDER) if cache else None


def describe(value: Any) -> str:
    """A stable text of a static value (a graph definition, a config): its repr without the
    memory addresses that differ between processes."""
    return _ADDRESS.sub("", repr(value))


@functools.cache
def code_digest() -> str:
    """A digest of lowbit's Python sources and compiled kernels: a program traced by other
    code is another program."""
    root = pathlib.Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".so", ".pyd", ".cc", ".h") and path.is_file():
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _custom_calls() -> list[export.DisabledSafetyCheck]:
    """lowbit's own FFI targets: the export is read back only by this same code (the key
    holds its digest), so their lack of a cross-version guarantee does not matter here."""
    return [export.DisabledSafetyCheck.custom_call(name) for name in kernels.ffi_targets()]


def _avals(leaves: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
    return [
        jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=getattr(x, "weak_type", False))
        for x in leaves
    ]


def program_key(name: str, static: str, args: tuple) -> str:
    """The file name of a program: a digest of everything its trace depends on."""
    leaves, tree = jax.tree.flatten(args)
    digest = hashlib.sha256()
    parts = (
        name,
        static,
        str(tree),
        repr([(a.shape, str(a.dtype), a.weak_type) for a in _avals(leaves)]),
        jax.__version__,
        jaxlib.__version__,
        jax.default_backend(),
        str(jax.config.jax_enable_x64),
        str(jax.config.jax_default_matmul_precision),
        kernels.status(),
        code_digest(),
    )
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return f"{name}-{digest.hexdigest()[:32]}"


@dataclasses.dataclass(frozen=True, eq=False)
class StoredProgram:
    """A compiled program: call it with arguments shaped like the example ones.

    Attributes:
      out_shapes: its output pytree, as ``jax.ShapeDtypeStruct`` leaves.
      stored: whether its traced form came from (or went to) the program directory.
    """

    compiled: Callable[..., Any]
    in_count: int
    out_tree: Any
    out_shapes: Any
    stored: bool

    def __call__(self, *args: Any) -> Any:
        leaves = jax.tree.leaves(args)
        if len(leaves) != self.in_count:
            raise ValueError(f"expected {self.in_count} arrays, got {len(leaves)}")
        return jax.tree.unflatten(self.out_tree, self.compiled(*leaves))


def compile_stored(name: str, fn: Callable[..., Any], args: tuple, **options: Any) -> StoredProgram:
    """``fn`` compiled for arguments shaped like `args`, its traced form read from (or written
    to) `directory`: `lower_stored`, then XLA's compile (or JAX's persistent cache).

    Args:
      name, fn, args: as `lower_stored`.
      **options: `lower_stored`'s keyword arguments: `static`, `out_like`, `donate_argnums`,
        `directory`.
    Returns:
      A `StoredProgram`: a function of arguments shaped like `args`, returning what `fn`
      returns. It never traces or compiles again; the same request later in the process
      returns the same program.
    """
    return lower_stored(name, fn, args, **options).compile()


@dataclasses.dataclass(frozen=True, eq=False)
class LoweredProgram:
    """A program of `lower_stored`, traced (or read back) and lowered but not yet compiled.

    Attributes:
      out_shapes: its output pytree, as ``jax.ShapeDtypeStruct`` leaves (known before XLA's
        compile: a program whose arguments are another's outputs is lowered meanwhile).
      read_back: whether its traced form was read from the directory (or it was compiled
        already): a later start, whose compile JAX's persistent cache most likely holds too.
    """

    out_shapes: Any
    read_back: bool
    _memo: tuple
    _build: Callable[[], StoredProgram]

    def compile(self) -> StoredProgram:
        """The compiled program (XLA's compile, or JAX's persistent cache; once a process)."""
        program = _COMPILED.get(self._memo)
        if program is None:
            program = _COMPILED.setdefault(self._memo, self._build())
        return program


def lower_stored(
    name: str,
    fn: Callable[..., Any],
    args: tuple,
    *,
    static: str,
    out_like: Callable[[tuple], Any],
    donate_argnums: tuple[int, ...] = (),
    directory: str | os.PathLike[str] | None,
) -> LoweredProgram:
    """``fn`` traced for arguments shaped like `args` (or its traced form read back from
    `directory`) and lowered, ready for XLA's compile: `LoweredProgram.compile`, or
    `compile_together` for several at once.

    Args:
      name: the program's name (the file name's prefix), e.g. ``"prefill-64"``.
      fn: a traceable function of ``*args`` (pytrees of arrays).
      args: example arguments; only their structure, shapes and dtypes are used.
      static: a stable description of what `fn` closes over (see `describe`).
      out_like: ``args -> a pytree shaped like fn's output`` (any leaves): the output's
        structure without tracing `fn`. It is checked against the trace when one is made.
      donate_argnums: positions in `args` whose buffers the program may reuse.
      directory: where programs are kept; None compiles without keeping anything.
    """
    leaves, in_tree = jax.tree.flatten(args)
    avals = _avals(leaves)
    out_tree = jax.tree.structure(out_like(args))
    key = program_key(name, static, args)
    memo = (key, donate_argnums, str(directory))
    if memo in _COMPILED:
        done = _COMPILED[memo]
        return LoweredProgram(done.out_shapes, True, memo, lambda: done)
    donated = tuple(i for i, position in enumerate(_positions(args)) if position in donate_argnums)

    def flat(*flat_args: Any) -> list[Any]:
        out = fn(*jax.tree.unflatten(in_tree, flat_args))
        if jax.tree.structure(out) != out_tree:
            raise ValueError(
                f"program {name!r} returns {jax.tree.structure(out)}; out_like gave {out_tree}"
            )
        return jax.tree.leaves(out)

    exported, read_back = None, False
    if directory is not None:
        exported, read_back = _exported(name, key, flat, avals, directory)
    if exported is not None:
        runner = jax.jit(exported.call, donate_argnums=donated)
    else:
        runner = jax.jit(flat, donate_argnums=donated)
    lowered = runner.lower(*avals)
    shapes = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in jax.tree.leaves(lowered.out_info)]
    out_shapes = jax.tree.unflatten(out_tree, shapes)

    def build() -> StoredProgram:
        compiled = lowered.compile()
        # XLA's compile, or its load from JAX's cache, leaves freed memory in glibc's arenas,
        # where it counts as resident until the process ends: 56 MB of the 85 MB that loading
        # a 1.5B model's prefill program added.
        release_free_memory()
        return StoredProgram(
            compiled=compiled,
            in_count=len(leaves),
            out_tree=out_tree,
            out_shapes=out_shapes,
            stored=exported is not None,
        )

    return LoweredProgram(out_shapes, read_back, memo, build)


def compile_together(programs: Sequence[LoweredProgram]) -> list[StoredProgram]:
    """Each of `programs` compiled, up to one per core at a time: XLA compiles a program on
    one core, and releases Python's lock meanwhile (a generation's prefill and decode
    programs, 4.5 s and 3.1 s on a 1.5B model, then take 4.7 s together).

    Programs all read back (a later start) are loaded one after the other: JAX's cache gives
    each in a fraction of a second, and threads would only hold more memory at once (40 MB
    more at the peak of a second `lowbit generate`)."""
    if len(programs) < 2 or all(p.read_back for p in programs):
        return [p.compile() for p in programs]
    workers = min(len(programs), os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(
        workers, thread_name_prefix="lowbit-compile"
    ) as pool:
        return list(pool.map(LoweredProgram.compile, programs))


def _positions(args: tuple) -> list[int]:
    """For each leaf of `args`, the position of the argument it belongs to."""
    return [i for i, arg in enumerate(args) for _ in jax.tree.leaves(arg)]


def _exported(name, key, flat, avals, directory) -> tuple[export.Exported | None, bool]:
    """The program `key` (its `program_key`) from `directory`, else traced, exported and
    written there (None where export refuses it); and whether it was read back."""
    path = pathlib.Path(directory) / (key + _SUFFIX)
    if path.is_file():
        try:
            return export.deserialize(bytearray(path.read_bytes())), True
        except Exception as err:  # noqa: BLE001 - a damaged file is traced again
            _log.warning("stored program %s unreadable (%s); tracing it again", path, err)
    try:
        exported = export.export(
            jax.jit(flat), platforms=[jax.default_backend()], disabled_checks=_custom_calls()
        )(*avals)
        blob = exported.serialize()
    except Exception as err:  # noqa: BLE001 - e.g. an effect export cannot serialize
        _log.warning("program %s is not kept for the next start: %s", name, err)
        return None, False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, bytes(blob))
    except OSError as err:
        _log.warning("could not keep program %s in %s: %s", name, path.parent, err)
    return exported, False
