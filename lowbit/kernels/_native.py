"""Loading the compiled module, registering its FFI targets, and reporting why not.

A module that does not load or whose targets do not register (built against another jaxlib)
leaves the kernels unavailable, with the reason in `status()`: every entry point then runs its
pure-JAX reference.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import types
from types import ModuleType

import jax

from lowbit.kernels._kinds import GGUF_KINDS

_log = logging.getLogger("lowbit.kernels")
_DISABLE_ENV = "LOWBIT_DISABLE_KERNELS"


@functools.cache
def _load() -> tuple[ModuleType | None, str]:
    """(module or None, reason it is unusable)."""
    if os.environ.get(_DISABLE_ENV, "") not in ("", "0"):
        return None, f"disabled by {_DISABLE_ENV}={os.environ[_DISABLE_ENV]}"
    try:
        mod = importlib.import_module("lowbit.kernels._cpu_kernels")
    except ImportError as e:
        return None, f"compiled module lowbit.kernels._cpu_kernels not importable ({e})"
    forced = os.environ.get(_ISA_ENV, "")
    if forced:
        _check_isa(mod, forced, f"{_ISA_ENV}={forced}")
    try:
        for name, capsule in mod.targets().items():
            jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    except Exception as e:  # noqa: BLE001 - e.g. built against another jaxlib's FFI version
        return None, (
            f"its FFI targets do not register with this jaxlib ({e}); rebuild lowbit against the "
            "installed jaxlib (pip install --no-build-isolation -e .)"
        )
    return mod, ""


_ISA_ENV = "LOWBIT_CPU_ISA"
ISAS = ("scalar", "avx2", "avx2vnni", "avx512bw", "avx512vnni", "amx")
"""Every instruction-set path the kernels are built with, slowest first."""


def _check_isa(mod: ModuleType, name: str, what: str) -> None:
    """Refuses a path that is unknown or that this CPU cannot run (never a silent cap)."""
    supported = list(mod.supported_isas())
    if name not in ISAS:
        raise ValueError(f"{what}: unknown instruction-set path; expected one of {ISAS}")
    if name not in supported:
        raise ValueError(
            f"{what}: this CPU cannot run the {name!r} kernels; it supports {supported} "
            f"(pick one of those, or unset {_ISA_ENV} for the best one)"
        )


_noticed = False


def module() -> ModuleType | None:
    """The compiled module with its targets registered, or None (logging why, once)."""
    global _noticed
    mod, reason = _load()
    if mod is None:
        if not _noticed:
            _noticed = True
            _log.warning("lowbit CPU kernels unavailable: %s; using the pure-JAX path", reason)
        return None
    return mod


def available() -> bool:
    """True when the compiled kernels can run (module built and not disabled)."""
    return _load()[0] is not None


def status() -> str:
    """One line: the active instruction-set path, or why the pure-JAX path is used."""
    mod, reason = _load()
    if mod is None:
        return f"lowbit CPU kernels: unavailable ({reason}); using the pure-JAX reference path"
    return (
        f"lowbit CPU kernels: active, isa={mod.isa()} "
        f"(this CPU supports: {', '.join(mod.supported_isas())})"
    )


def set_isa(name: str) -> str:
    """Selects an instruction-set path; returns the one now active.

    name: "scalar" | "avx2" | "avx2vnni" | "avx512bw" | "avx512vnni" | "amx", one this CPU runs
    (`supported_isas()`). The initial choice is the best supported path, or the one the
    LOWBIT_CPU_ISA environment variable names.

    Raises:
      ValueError: for an unknown path or one this CPU cannot run.
    """
    mod = module()
    if mod is None:
        raise RuntimeError(status())
    _check_isa(mod, name, f"set_isa({name!r})")
    return mod.set_isa(name)


def ffi_targets() -> list[str]:
    """The names of the compiled module's FFI targets (empty when the kernels are
    unavailable): the custom calls a program traced with them holds."""
    mod = module()
    return [] if mod is None else sorted(mod.targets())


def supported_isas() -> list[str]:
    """Paths this CPU can run, slowest first (empty when the kernels are unavailable)."""
    mod = _load()[0]
    return [] if mod is None else list(mod.supported_isas())


INT8_ACTIVATION_ISAS = types.MappingProxyType(
    {
        "avx2": ("int8", "int4", "uint4"),
        "avx2vnni": ("int8", "int4", "uint4"),
        "avx512bw": ("int4", "uint4"),
        "avx512vnni": ("int8", "int4", "uint4"),
        "amx": ("int8", "int4", "uint4"),
    }
)
"""Path -> weight-only kinds its kernel multiplies with int8 activations (int8 weights: VNNI's
dots on offset activations, or AVX2's on the codes' magnitudes and the activations' signs;
AVX-512 BW has neither)."""

INT8_ACTIVATION_KINDS = tuple(
    sorted({k for kinds in INT8_ACTIVATION_ISAS.values() for k in kinds} | set(GGUF_KINDS))
)
"""Weight-only kinds with an int8-activation path on some CPU (the GGUF block kinds on all)."""


def int8_activations_supported(kind: str) -> bool:
    """Whether `weight_only_linear(..., int8_activations=True)` takes integer dots for `kind`
    on the active path (elsewhere the float path runs)."""
    mod = module()
    if mod is not None and kind in GGUF_KINDS:
        return True  # the GGUF block kernels take int8 dots on every path (gguf.cc)
    return mod is not None and kind in INT8_ACTIVATION_ISAS.get(mod.isa(), ())
