"""Quantized checkpoints: a directory with ``model.safetensors`` and ``manifest.json``.

Every array leaf is a tensor in the safetensors file: a QArray's codes (packed ``uint8``,
``int8``, float8), scales (float, ``uint8`` E8M0, float8 e4m3), zero points, tensor scales and
activation bounds, and plain float leaves. The manifest (see `lowbit.io._manifest`) holds the
tree's structure, each QArray's static metadata, each tensor's dtype, shape and sha256, the
recipe's JSON and user metadata. The tensor file's header holds the sha256 of the manifest's
bytes, so neither file can be edited or swapped without the other. Nothing is pickled; loading
reads JSON and raw bytes only.

Writes are atomic: the new checkpoint is written completely into a temporary directory beside
the target and then swapped in with one rename (on Linux an atomic exchange of the two
directories when the target exists), so a crash at any point leaves the old checkpoint whole,
and a reader (which opens both files from one directory, `lowbit.io._checkpoint_dir`) sees the
old checkpoint or the new one, never a mix. A save replaces only a directory that is empty or
provably a lowbit checkpoint, follows symlinks to the directory they name, and removes the
temporaries of saves that were killed. Loads check everything before building anything and
return QArrays straight from the stored codes: nothing is dequantized.

Saved by several JAX processes, a checkpoint holds one ``process-NNNNN.safetensors`` per
process instead of ``model.safetensors`` (format version 3): each process writes the pieces it
owns (`lowbit.io._checkpoint_parts`), the manifest lists every piece's file, box and sha256,
and every file's header is sealed with the manifest's sha256. Loads onto a sharding that spans
processes read only the pieces each process needs (`lowbit.io._checkpoint_pieces`).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from lowbit._host_memory import release_free_memory
from lowbit._version import __version__
from lowbit.io._checkpoint_dir import (
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    TENSORS_FILE,
    Snapshot,
    open_checkpoint,
    resolve_save_path,
)
from lowbit.io._checkpoint_pieces import (
    PieceReader,
    check_groups,
    resolve_targets,
    shard_headers,
    sharded_files,
    spans_processes,
    whole_shards,
)
from lowbit.io._checkpoint_writer import MANIFEST_DIGEST_KEY, CheckpointWriter, recipe_json
from lowbit.io._manifest import (
    FORMAT_NAME,
    READABLE_VERSIONS,
    SHARDED_FORMAT_VERSION,
    CheckpointError,
    build_tree,
    decode_tree,
)
from lowbit.io._safetensors_file import (
    is_native,
    read_file_header,
    read_tensor,
)
from lowbit.io._tree import leaf_shapes, path_name
from lowbit.io._untrusted_json import load_json
from lowbit.ops import prepare_weight


def _sha256(array: np.ndarray) -> str:
    data = np.require(array, requirements="C").reshape(-1).view(np.uint8)
    return hashlib.sha256(data).hexdigest()


def save_checkpoint(
    path: str | os.PathLike[str],
    params: Any,
    *,
    recipe: Any = None,
    metadata: Mapping[str, Any] | None = None,
    timeout: float = 600.0,
) -> None:
    """Writes `params` (QArrays, arrays, containers) as a checkpoint directory, atomically.

    The whole tree at once; `CheckpointWriter` writes the same checkpoint leaf by leaf.

    With several JAX processes, every process calls it with the same `path` and tree: each
    writes only the pieces it owns of arrays split over processes, into its own shard file
    (``process-NNNNN.safetensors``), and process 0 publishes the checkpoint once every process
    has written its part (docs/sharding.md).

    Args:
      path: the checkpoint directory. If it exists it must be empty or a lowbit checkpoint
        (nothing in it but this format's ``manifest.json`` and ``model.safetensors``); it is
        replaced as a whole, in one atomic step. A symlink is followed: the directory it
        points to is replaced and the link kept.
      params: a params tree: nested dicts (e.g. ``nnx.State`` or a pure dict), lists, tuples,
        None, `QArray`s, arrays and Python scalars.
      recipe: the `Recipe` the params were quantized with (anything with ``to_json()``), or its
        JSON text; stored so that loading can check it.
      metadata: JSON-serialisable user metadata, stored as is.
      timeout: several processes only: seconds to wait for each other process at each step.
    Raises:
      TypeError: naming the path of a leaf that cannot be stored, or a bad `recipe`.
      ValueError: naming the path, if it exists and is neither empty nor a lowbit checkpoint;
        or if `metadata` is not JSON.
      ProcessError: several processes only: naming the process that failed, died or did not
        answer within `timeout` (the checkpoint at `path` is left as it was).

    Example:
      >>> import tempfile
      >>> import jax.numpy as jnp
      >>> tmp = tempfile.TemporaryDirectory()
      >>> path = tmp.name + "/ckpt"
      >>> save_checkpoint(path, {"norm": {"scale": jnp.ones(4)}}, metadata={"step": 10})
      >>> load_checkpoint(path)["norm"]["scale"].shape
      (4,)
      >>> read_manifest(path)["metadata"]
      {'step': 10}
      >>> tmp.cleanup()
    """
    with CheckpointWriter(path, recipe=recipe, metadata=metadata, timeout=timeout) as writer:
        writer.add((), params)


def check_save_path(path: str | os.PathLike[str]) -> None:
    """Checks that `save_checkpoint` may write to `path`, before any work is done for it.

    Raises:
      ValueError: naming the path, if it exists and is neither empty nor a lowbit checkpoint.
    """
    resolve_save_path(path)


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the checkpoint at `path` (recipe JSON, metadata, tree, tensors).

    Raises:
      CheckpointError: if the manifest is missing, not JSON, of another format or version, or
        not the one the tensor file was written with (edited or swapped after saving).
    """
    path = os.fspath(path)
    with open_checkpoint(path) as snapshot:
        return _verified_manifest(snapshot, path)[0]


def _verified_manifest(snapshot: Snapshot, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The parsed manifest, checked against the digest in the tensor file's header.

    Returns:
      ``(manifest, entries)``: the manifest and the tensor file's header entries (for a
      checkpoint written by several processes: shard file name -> its header entries).
    """
    file = os.path.join(path, MANIFEST_FILE)
    manifest = _parse_manifest(snapshot.manifest, file)
    if is_sharded(manifest):
        seal = (MANIFEST_DIGEST_KEY, hashlib.sha256(snapshot.manifest).hexdigest())
        return manifest, shard_headers(snapshot, manifest, path, seal)
    data_file = os.path.join(path, TENSORS_FILE)
    if snapshot.tensors is None:
        raise CheckpointError(f"{data_file}: missing")
    try:
        entries, header = read_file_header(snapshot.tensors)
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    digest = header.get(MANIFEST_DIGEST_KEY)
    if digest is None and manifest["format_version"] == 1:
        # Written before manifests were sealed: still readable (refusing would strand users'
        # checkpoints), with the per-tensor digests as the only integrity check.
        warnings.warn(
            f"{file}: format version 1 (written by an older lowbit) has no manifest digest, so "
            "edits to it cannot be detected; save the checkpoint again to seal it",
            stacklevel=4,
        )
        return manifest, entries
    if digest is None:
        raise CheckpointError(f"{data_file}: its header has no manifest digest")
    if hashlib.sha256(snapshot.manifest).hexdigest() != digest:
        raise CheckpointError(
            f"{file}: not the manifest {TENSORS_FILE} was written with (its sha256 differs "
            "from the digest in the tensor file's header): edited or replaced after saving"
        )
    return manifest, entries


def is_sharded(manifest: dict[str, Any]) -> bool:
    """Whether the checkpoint was written by several processes (one shard file each)."""
    return manifest["format_version"] == SHARDED_FORMAT_VERSION


def _parse_manifest(raw: bytes, file: str) -> dict[str, Any]:
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{file}: larger than {MAX_MANIFEST_BYTES >> 20} MiB")
    manifest = load_json(raw, file, CheckpointError)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        got = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise CheckpointError(f"{file}: format {got!r} is not {FORMAT_NAME!r}")
    if manifest.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{file}: format version {manifest.get('format_version')!r}; this lowbit "
            f"({__version__}) reads versions {', '.join(map(str, READABLE_VERSIONS))}"
        )
    required = {"recipe", "metadata", "tree", "tensors"}
    if manifest["format_version"] == SHARDED_FORMAT_VERSION:
        required.add("files")
    missing = required - set(manifest)
    if missing:
        raise CheckpointError(f"{file}: missing keys {sorted(missing)}")
    return manifest


def _check_recipe(stored: Any, recipe: Any, file: str) -> None:
    try:
        expected = recipe_json(recipe)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"recipe= cannot be compared: {err}") from None
    if stored is not None and not isinstance(stored, str):
        raise CheckpointError(f"{file}: 'recipe' is {type(stored).__name__}, not recipe JSON text")
    stored_value = None if stored is None else load_json(stored, f"{file}: recipe", CheckpointError)
    if stored_value != json.loads(expected):
        shown = "none" if stored is None else stored[:300]
        raise CheckpointError(
            f"{file}: recipe mismatch: the checkpoint was written with recipe {shown}, but "
            f"recipe= is {expected[:300]}"
        )


def _check_like(shapes: dict, like: Any, file: str) -> None:
    expected = leaf_shapes(like)
    for leaf_path, shape in shapes.items():
        if leaf_path not in expected:
            raise CheckpointError(f"{file}: leaf {path_name(leaf_path)!r} is not in like=")
        if tuple(expected[leaf_path]) != tuple(shape):
            raise CheckpointError(
                f"{file}: leaf {path_name(leaf_path)!r} has shape {tuple(shape)}, but like= "
                f"expects {tuple(expected[leaf_path])}"
            )
    missing = [p for p in expected if p not in shapes]
    if missing:
        raise CheckpointError(f"{file}: like= has leaf {path_name(missing[0])!r}, not stored")


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    like: Any = None,
    recipe: Any = None,
    sharding: Any = None,
    kernel_axes: Any = None,
) -> Any:
    """Loads a checkpoint written by `save_checkpoint`, straight into QArrays.

    Args:
      path: the checkpoint directory.
      like: optional params tree or abstract tree (e.g. ``jax.eval_shape`` output, ``nnx.State``)
        the checkpoint must match: same leaf paths, and each stored leaf's logical shape equal
        to the leaf's shape there (a QArray may stand where `like` has a float array).
      recipe: optional `Recipe` (or its JSON); refuse the checkpoint unless it was written with
        an equal recipe.
      sharding: where to put the arrays: None (the default device), one
        `jax.sharding.Sharding` or device for every array, or a function
        ``(path, role, shape) -> Sharding | None`` called per stored tensor (``path`` the leaf's
        key tuple, ``role`` ``"value"`` for plain arrays or a QArray field such as ``"codes"``,
        ``shape`` the stored shape), e.g. to shard codes and scales alike along one axis.
        A sharding may span processes, of any count or mesh shape, whichever wrote the
        checkpoint: each process then reads only the stored pieces its devices need.
      kernel_axes: how the weights are laid out for the CPU kernels as they load
        (`lowbit.ops.prepare_weights`). None (default): as they were saved: a weight saved
        prepared (from `lowbit.quantize` or `lowbit.prepare`) is prepared again for the same
        contraction axis, when `sharding` is None; the rest stay logical. False: every weight
        logical. Or a mapping {key path: contraction axis}, or a function called with the
        checkpoint's abstract tree (QArrays of shape structs, before any data is read) that
        returns one, e.g. ``lambda p: lowbit.api.kernel_axes_of(fn, p, x)``. Each prepared
        weight replaces its codes as soon as it is read, so the tree is resident once.
    Returns:
      The params tree, with dicts, lists and tuples as saved (``nnx.State`` comes back as a
      dict) and `QArray`s holding the stored codes.
    Raises:
      CheckpointError: naming the file, tensor and problem, before anything is built, for a
        missing or malformed manifest, another format version, a recipe mismatch, an unknown
        format name, a truncated or malformed tensor file, a missing or extra tensor, a tensor
        whose dtype, shape or sha256 differs from the manifest, a QArray whose parts do not
        fit together, a leaf that does not match `like`, a sharding that would split a
        quantization group, or (written by several processes) a shard file missing, extra,
        not sealed with the manifest, or pieces that do not tile their tensor.
    """
    path = os.fspath(path)
    file = os.path.join(path, MANIFEST_FILE)
    data_file = os.path.join(path, TENSORS_FILE)
    # Both files come from one directory, opened once: a concurrent save replaces the
    # directory, never the files in it, so this reads one checkpoint, old or new.
    with open_checkpoint(path) as snapshot:
        manifest, header = _verified_manifest(snapshot, path)
        if recipe is not None:
            _check_recipe(manifest["recipe"], recipe, file)
        sharded = is_sharded(manifest)
        plan = decode_tree(manifest["tree"], manifest["tensors"], file, sharded=sharded)
        if like is not None:
            _check_like(plan.shapes, like, file)
        targets = resolve_targets(sharding, plan)
        check_groups(plan, targets, file)
        if sharded or spans_processes(targets):
            reader = piece_reader(snapshot, manifest, plan, header, targets, path)
        else:
            entries = _check_tensor_file(plan, header, data_file)
            digests = {name: info["sha256"] for name, info in manifest["tensors"].items()}
            f = snapshot.tensors
            # Pass 1 checks every byte against the manifest, streaming: nothing is kept.
            for name, entry in entries.items():
                _verify(f, entry, digests[name], data_file)
            reader = _TensorReader(f, plan, entries, digests, targets, data_file)
        # Every QArray's invariants, on shapes alone.
        abstract = build_tree(
            plan, {n: jax.ShapeDtypeStruct(s, d) for n, (d, s) in plan.tensors.items()}
        )
        if callable(kernel_axes):
            kernel_axes = kernel_axes(abstract)
        del abstract
        if kernel_axes is False or (kernel_axes is None and sharding is not None):
            return build_tree(plan, reader)
        # Each weight is laid out as soon as its tensors are read, and its codes dropped: the
        # tree is never resident in both forms.
        if kernel_axes is None:
            return build_tree(plan, reader, on_qarray=lambda keys, q, saved: _prepared(q, saved))
        lookup = kernel_axes.get if isinstance(kernel_axes, Mapping) else kernel_axes
        return build_tree(plan, reader, on_qarray=lambda keys, q, saved: _prepared(q, lookup(keys)))


def piece_reader(snapshot, manifest, plan, header, targets, path) -> PieceReader:
    """The reader of a checkpoint written by several processes or of a load onto a sharding
    that spans processes; checks the shards this process reads (pass 1).

    Args:
      header: from `_verified_manifest`.
      targets: tensor name -> where it goes (`resolve_targets`).
    """
    if is_sharded(manifest):
        stored = sharded_files(snapshot, manifest, plan, path, header)
    else:
        data_file = os.path.join(path, TENSORS_FILE)
        entries = _check_tensor_file(plan, header, data_file)
        digests = {name: info["sha256"] for name, info in manifest["tensors"].items()}
        stored = whole_shards(snapshot.tensors, entries, digests, plan)
    reader = PieceReader(stored, plan, targets, path)
    for name in stored:
        for piece in reader.needed(name):
            _verify(piece.f, piece.entry, piece.shard.sha256, os.path.join(path, piece.shard.file))
    return reader


def _prepared(q: Any, axis: int | None) -> Any:
    if axis is None:
        return q
    prepared = prepare_weight(q, axis)
    del q  # the caller's reference goes when this returns; the next read trims
    return prepared


def _check_tensor_file(plan: Any, entries: dict[str, Any], data_file: str) -> dict[str, Any]:
    """The tensor file's header `entries`, checked against the manifest's tensor table."""
    extra = sorted(set(entries) - set(plan.tensors))
    if extra:
        raise CheckpointError(f"{data_file}: extra tensor {extra[0]!r} the manifest lacks")
    missing = sorted(set(plan.tensors) - set(entries))
    if missing:
        raise CheckpointError(f"{data_file}: missing tensor {missing[0]!r}")
    for name, entry in entries.items():
        dtype, shape = plan.tensors[name]
        stored = (dtype, shape) if is_native(dtype) else (np.dtype(np.uint8), (entry.nbytes,))
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if (entry.dtype, entry.shape) != stored or entry.nbytes != nbytes:
            raise CheckpointError(
                f"{data_file}: tensor {name!r} is stored as {entry.dtype.name} {entry.shape}, "
                f"the manifest says {dtype.name} {shape}"
            )
    return entries


class _TensorReader(Mapping):
    """Pass 2: tensor name -> device array, read when first asked for, so the host holds one
    tensor at a time, not the whole tree. Digests are checked again in case the file changed
    since pass 1; a failure here still returns nothing to the caller."""

    def __init__(self, f, plan, entries, digests, targets, data_file):
        self._f, self._plan, self._entries = f, plan, entries
        self._digests, self._targets, self._data_file = digests, targets, data_file

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        return iter(self._entries)

    def __getitem__(self, name: str) -> jax.Array:
        entry, plan = self._entries[name], self._plan
        # What the last weight's layout freed (its codes, the compiler's scratch) goes back to
        # the system before the next tensor is read.
        release_free_memory()
        try:
            host = read_tensor(self._f, entry)
        except ValueError as err:
            raise CheckpointError(str(err)) from None
        if _sha256(host) != self._digests[name]:
            raise CheckpointError(f"{self._data_file}: tensor {name!r} changed while loading")
        dtype, shape = plan.tensors[name]
        host = host.reshape(-1).view(dtype).reshape(shape)
        target = None if self._targets is None else self._targets[name]
        # device_put, not jnp.asarray: the latter compiles a copy program per tensor shape,
        # whose ~1 MiB executables stayed cached (30 MiB for SmolLM2).
        array = jax.device_put(host, target)
        # Transfers are asynchronous: wait, so that this host buffer is released before the
        # next one is read (else a slow host could hold the whole file twice).
        return array.block_until_ready()


_CHUNK = 4 * 2**20


def _verify(f: Any, entry: Any, sha256: str, data_file: str) -> None:
    """Hashes one tensor's bytes in fixed-size chunks and compares with the manifest."""
    digest = hashlib.sha256()
    buffer = memoryview(bytearray(min(_CHUNK, max(entry.nbytes, 1))))
    f.seek(entry.begin)
    remaining = entry.nbytes
    while remaining:
        got = f.readinto(buffer[: min(remaining, len(buffer))])
        if not got:
            raise CheckpointError(f"{data_file}: truncated inside tensor {entry.name!r}")
        digest.update(buffer[:got])
        remaining -= got
    if digest.hexdigest() != sha256:
        raise CheckpointError(
            f"{data_file}: tensor {entry.name!r} is corrupt (sha256 differs from the manifest)"
        )
