"""Giving freed host memory back to the operating system.

Laying a weight out for the kernels compiles and runs a small XLA program; the compiler's
scratch memory and the replaced codes are freed, but glibc keeps freed memory in its arenas,
where it still counts as resident. Over a model's weights that was ~50 MiB kept on top of the
weights (int4 SmolLM2: a 103 MiB checkpoint loaded at 146 MiB resident). `malloc_trim` hands
it back; elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def release_free_memory() -> None:
    """Returns the allocator's free memory to the system (glibc `malloc_trim(0)`), if it can."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
