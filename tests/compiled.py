"""Compiled programs in tests: a module's forward pass as one program (`compiled`), for tests
that call a decoder several times, and the programs a block of code lowers (`lowerings`), for
tests that an eager call is one program. Called eagerly, each JAX operation is compiled as a
program of its own, once a shape, and the suite is bound by compile time: a tiny decoder's
prefill and four decode steps compiled 360 programs (12 s on a 2-core machine)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import jax
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


@contextlib.contextmanager
def lowerings() -> Iterator[list[float]]:
    """Records one entry per program JAX lowers inside the block. Lowering, not compiling: the
    suite's persistent compilation cache would hide a compile."""
    lowered: list[float] = []

    def listen(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield lowered
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
