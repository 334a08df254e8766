"""Quantized weights laid out for the CPU kernels by one abstract walk of the function they
serve: the transform behind `lowbit.prepare` (see `_prepare`), for a params tree, a walk
already made, or an NNX module's state. `QuantizedModel` prepares through these too."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx

from lowbit.api._trace import Traced, layout_axes, trace_params
from lowbit.ops import prepare_weights


def prepare_params(fn: Callable[..., Any], params: Any, *args: Any, **kwargs: Any) -> Any:
    """`params` (with `QArray` leaves) laid out for ``fn(params, *args, **kwargs)``.

    Args:
      fn: the function served, e.g. ``model.apply`` or ``lambda params, x: ...``.
      params: its first argument.
      *args, **kwargs: example inputs (arrays or `jax.ShapeDtypeStruct`s).
    Returns:
      `params` with `PreparedQArray`s in place of the weights a CPU kernel runs.
    """
    return prepare_traced(params, trace_params(fn, params, *args, **kwargs))


def prepare_traced(params: Any, traced: Traced) -> Any:
    """`params` laid out by a walk already made (`trace_params` of the function they serve,
    possibly on their float form): `quantize_model` traces once for the uses, the layouts
    before quantizing and this."""
    return prepare_weights(params, layout_axes(traced, params))


def prepare_module(module: nnx.Module, method: str, *args: Any, **kwargs: Any) -> nnx.Module:
    """Lays out `module`'s quantized weights for ``module.method(*args, **kwargs)``, in place.

    Returns:
      `module` itself (its state updated).
    """
    graphdef, state = nnx.split(module)
    call = lambda s, *a, **k: getattr(nnx.merge(graphdef, s), method)(*a, **k)
    nnx.update(module, prepare_params(call, state, *args, **kwargs))
    return module
