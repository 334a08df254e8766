"""A module's forward pass as one compiled program, for tests that call a decoder several
times. Called eagerly, each of its operations is compiled as a program of its own: a test of
prefill and four decode steps compiled 360 of them (12 s of a 2-core machine's suite)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from flax import nnx


def compiled(model: nnx.Module, method: str = "__call__") -> Callable:
    """``model.<method>(*args, **kwargs)`` under `nnx.jit`, `fresh` and `last_only` static.

    A new function each call, so a module attribute a test patches before calling it is
    traced (a program compiled before the patch is never reused after it).
    """

    @functools.partial(nnx.jit, static_argnames=("fresh", "last_only"))
    def run(model, *args, **kwargs):
        return getattr(model, method)(*args, **kwargs)

    return functools.partial(run, model)
