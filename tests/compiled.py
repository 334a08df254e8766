"""A module's forward pass as one compiled program, for tests that call a decoder several
times. Called eagerly, each JAX operation is compiled as a program of its own, once a shape,
and the suite is bound by compile time: a tiny decoder's prefill and four decode steps
compiled 360 programs (12 s on a 2-core machine)."""

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
