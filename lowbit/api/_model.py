"""Running models on quantized params: `run`, and `quantize_model` for Flax NNX and Linen.

NNX: `quantize_model(module, recipe)` splits the module into graph definition and state,
quantizes the state, merges them into a copy of the module whose `Variable`s hold `QArray`s, and
wraps that copy in a `QuantizedModel` — an `nnx.Module` you call exactly like the original. Each
call splits the copy and runs ``merge(graph, state)(*args)`` through `run` under `jax.jit`
(compiled once per input shape and layout; non-array arguments such as ``deterministic=True``
stay static), so the float weights never come back. State updates
made by the call (dropout RNG counters, batch statistics) are not written back: a quantized model
is for inference. Being an NNX module (and so a pytree), it also goes through `nnx.jit`,
`jax.jit`, `nnx.state` / `nnx.split` of your own.

Linen: `quantize_model(module, recipe, params=variables)` returns a `QuantizedLinen` with
`.params` (the quantized variables) and `.apply(params, *args, **kwargs)` (the module's `apply`
through `run`, jitted); it also unpacks as ``apply_fn, qparams = quantize_model(...)``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np
from flax import linen, nnx

from lowbit.algorithms import AlgorithmReport
from lowbit.api._algorithms import AlgorithmOptions
from lowbit.api._kernel_layout import prepare_module, prepare_traced
from lowbit.api._quantize import as_recipe, quantize_params
from lowbit.api._trace import layout_axes, ops_by_path, trace_params
from lowbit.engine import EngineReport, interpret
from lowbit.ops import is_prepared
from lowbit.qarray import QArray
from lowbit.recipes import Recipe


def run(
    fn: Callable[..., Any], *, strict: bool = False, report: EngineReport | None = None
) -> Callable[..., Any]:
    """`lowbit.run`: wraps `fn` so it accepts quantized params (`QArray` / `QatWeight` leaves).

    `lowbit.quantize` returns the weights the CPU kernels run already in the kernels' layout,
    so calls cost only the kernels. Weights it could not place by convention (not named
    ``kernel``) are laid out for their traced use by ``lowbit.prepare(params, fn,
    *example_args)``. A logical QArray that reaches a kernel still works, but is repacked on
    every call: the report counts it as a fallback and `strict` refuses it.

    Args:
      fn: any JAX function, e.g. ``model.apply`` or ``lambda params, x: ...``.
      strict: raise instead of dequantizing a quantized weight at an op without a quantized rule.
      report: an `EngineReport` filled at trace time (quantized ops per path, fallbacks).
    Returns:
      A jit-able, differentiable function with `fn`'s signature.
    """
    return interpret(fn, strict=strict, report=report)


class _ArraySlot:
    """Marks where a traced array goes back among a call's static leaves."""

    def __repr__(self) -> str:
        return "<array>"


_ARRAY = _ArraySlot()


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _jit_flat(fn, treedef, statics, arrays):
    arrays = iter(arrays)
    leaves = [next(arrays) if leaf is _ARRAY else leaf for leaf in statics]
    args, kwargs = jax.tree.unflatten(treedef, leaves)
    return fn(*args, **kwargs)


def jit_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``jax.jit(fn)(*args, **kwargs)`` tracing only the array leaves of the arguments.

    Other leaves (``deterministic=True``, ``method="attend"``, Python numbers) stay static, as in
    an un-jitted call, so model flags keep working; each new value compiles once. `fn` must be
    hashable and equal across calls for the compiled function to be reused.
    """
    leaves, treedef = jax.tree.flatten((args, kwargs))
    is_array = [isinstance(leaf, jax.Array | np.ndarray | np.generic) for leaf in leaves]
    statics = tuple(_ARRAY if array else leaf for leaf, array in zip(leaves, is_array, strict=True))
    arrays = [leaf for leaf, array in zip(leaves, is_array, strict=True) if array]
    return _jit_flat(fn, treedef, statics, arrays)


@dataclasses.dataclass(frozen=True)
class _NnxMethod:
    """``merge(graphdef, state).method(*args, **kwargs)`` through the engine; hashable."""

    graphdef: Any
    method: str
    strict: bool

    def __call__(self, state: Any, *args: Any, **kwargs: Any) -> Any:
        def call(state, args, kwargs):
            return getattr(nnx.merge(self.graphdef, state), self.method)(*args, **kwargs)

        return interpret(call, strict=self.strict)(state, args, kwargs)


def _traced(tree: Any) -> bool:
    """Whether a tree holds tracers (a call inside someone's `jax.jit`: prepare nothing there,
    the layout would be rebuilt on every trace)."""
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree))


class QuantizedModel(nnx.Module):
    """An NNX module with quantized weights, called like the original (see module docstring).

    Attributes:
      module: a copy of the original module whose `Variable`s hold `QArray`s where the recipe
        quantized them (the original module is left untouched).
      strict: raise on engine fallbacks instead of dequantizing.
    """

    def __init__(self, module: nnx.Module, *, strict: bool = False):
        self.module = module
        self.strict = strict
        # Weights are laid out for the CPU kernels once, from the first call's traced uses
        # (or at `quantize_model` when given example inputs): see `prepare`.
        self.prepared = False

    def prepare(self, method: str = "__call__", *args: Any, **kwargs: Any) -> None:
        """Replaces the weights the CPU kernels run by their kernel layout (once).

        The contraction axis of each weight comes from tracing ``method(*args, **kwargs)``
        (abstractly; nothing runs): `lowbit.prepare`. The first call does this by itself,
        unless it runs inside your own `jax.jit` (then prepare first, or every call repacks).
        """
        prepare_module(self.module, method, *args, **kwargs)
        self.prepared = True

    @property
    def graphdef(self) -> Any:
        """The wrapped module's graph definition."""
        return nnx.split(self.module)[0]

    @property
    def state(self) -> nnx.State:
        """The wrapped module's state, with `QArray` values."""
        return nnx.split(self.module)[1]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call("__call__", *args, **kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Calls another method of the module, e.g. ``qmodel.call("attend", x)``."""
        graphdef, state = nnx.split(self.module)
        if not self.prepared and not _traced(state):
            del state
            self.prepare(method, *args, **kwargs)
            graphdef, state = nnx.split(self.module)
        return jit_call(_NnxMethod(graphdef, method, self.strict), state, *args, **kwargs)

    def dequantized(self) -> nnx.Module:
        """A float copy of the module with every quantized weight dequantized (for comparisons)."""
        graphdef, state = nnx.split(self.module)
        state = jax.tree_util.tree_map(
            lambda x: x.dequantize() if isinstance(x, QArray) or is_prepared(x) else x,
            state,
            is_leaf=lambda x: isinstance(x, QArray) or is_prepared(x),
        )
        return nnx.merge(graphdef, state)


@dataclasses.dataclass(frozen=True)
class QuantizedLinen:
    """A Linen module with quantized variables.

    Attributes:
      module: the Linen module.
      params: the quantized variables (``{"params": ...}`` with `QArray` leaves).
      strict: raise on engine fallbacks instead of dequantizing.
    """

    module: linen.Module
    params: Any
    strict: bool = False

    @functools.cached_property
    def _apply(self) -> Callable[..., Any]:
        # One interpreted function per object, so `jit_call` reuses its compilations.
        return interpret(self.module.apply, strict=self.strict)

    def apply(self, params: Any, *args: Any, **kwargs: Any) -> Any:
        """`module.apply(params, *args, **kwargs)` on quantized params (jitted; non-array
        arguments such as ``train=False`` or ``method=`` stay static)."""
        return jit_call(self._apply, params, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """`apply` with the stored params."""
        return self.apply(self.params, *args, **kwargs)

    def __iter__(self):
        return iter((self.apply, self.params))


def quantize_model(
    model: nnx.Module | linen.Module,
    recipe: Recipe | str,
    *,
    params: Any = None,
    strict: bool = False,
    uses: Mapping[str, frozenset[str]] | None = None,
    example_args: tuple[Any, ...] | None = None,
    calibration: Iterable[Any] | None = None,
    algorithm_options: AlgorithmOptions | None = None,
    report: AlgorithmReport | None = None,
) -> QuantizedModel | QuantizedLinen:
    """`lowbit.quantize_model`: quantizes a Flax model's weights by a recipe.

    Args:
      model: an `nnx.Module`, or a `linen.Module` (then `params` is required).
      recipe: a `Recipe` or preset name.
      params: Linen variables (``{"params": ...}``); must be None for NNX.
      strict: raise on engine fallbacks (a quantized weight meeting an op with no quantized rule).
      uses: ops each parameter feeds, for rules with an `ops` filter (`param_uses`); traced
        from `example_args` when those are given.
      example_args: example inputs of a call (arrays or `jax.ShapeDtypeStruct`s). With them
        the model is traced once (abstractly) before quantizing, so presets also find weights
        by use: a 2-D parameter the recipe names by no rule (``w``, ``qkv``) is quantized as the
        layout its matmul shows. The weights are also laid out for the CPU kernels at once,
        from the same trace (without them, at the first call).
      calibration: batches of the model's inputs (``model(*batch)``, Linen:
        ``model.apply(params, *batch)``; a batch that is not a tuple is one argument), for
        rules whose algorithm needs data (GPTQ, AWQ, SmoothQuant).
      algorithm_options: `lowbit.api.AlgorithmOptions` for rules with an algorithm (padding
        mask, precomputed statistics, sequential GPTQ passes, progress).
      report: an `lowbit.algorithms.AlgorithmReport` to fill with what each algorithm's
        weight got.
    Returns:
      NNX: a `QuantizedModel` called like `model`. Linen: a `QuantizedLinen`
      (``apply_fn, qparams = quantize_model(...)`` also works).
    Raises:
      TypeError: for another model type, or `params` given for NNX / missing for Linen.
      ValueError: from `quantize_params` (e.g. a rule whose algorithm needs data, without
        `calibration`).

    Example:
      >>> model = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
      >>> qmodel = quantize_model(model, "int8")
      >>> qmodel(jnp.ones((2, 64))).shape
      (2, 32)
    """
    recipe = as_recipe(recipe)
    # `strict` here refuses engine fallbacks, and with algorithms their fallbacks to
    # round-to-nearest; a recipe matching no parameter stays a warning, as it always was.
    with_algorithms = any(r.algorithm is not None for r in recipe.rules)
    algorithms = dict(
        calibration=calibration,
        algorithm_options=algorithm_options,
        report=report,
        strict=strict and with_algorithms,
    )
    if isinstance(model, nnx.Module):
        if params is not None:
            raise TypeError(
                "quantize_model: params= is for Linen modules; an NNX module holds its own state"
            )
        graphdef, state = nnx.split(model)
        call = lambda s, *a: nnx.merge(graphdef, s)(*a)
        traced = None
        if example_args is not None:
            # One trace serves the uses, the layouts before quantizing and the kernel axes after.
            traced = trace_params(call, state, *example_args)
            if uses is None:
                uses = ops_by_path(traced)
        qstate = quantize_params(
            state,
            recipe,
            fn=call,
            uses=uses,
            layout_axes=None if traced is None else layout_axes(traced),
            kernel_layouts=True,
            **algorithms,
        )
        if traced is not None:
            qstate = prepare_traced(qstate, traced)
        qmodel = QuantizedModel(nnx.merge(graphdef, qstate), strict=strict)
        if traced is not None:
            qmodel.prepared = True
        return qmodel
    if isinstance(model, linen.Module):
        if params is None:
            raise TypeError(
                "quantize_model: a Linen module needs its variables: "
                "quantize_model(module, recipe, params=variables)"
            )
        traced = None
        if example_args is not None:
            traced = trace_params(model.apply, params, *example_args)
            if uses is None:
                uses = ops_by_path(traced)
        qparams = quantize_params(
            params,
            recipe,
            fn=model.apply,
            uses=uses,
            layout_axes=None if traced is None else layout_axes(traced),
            kernel_layouts=True,
            **algorithms,
        )
        if traced is not None:
            qparams = prepare_traced(qparams, traced)
        return QuantizedLinen(model, qparams, strict)
    raise TypeError(
        f"quantize_model expects a flax nnx.Module or linen.Module, got {type(model).__name__}; "
        "for a plain function use quantize_params(params, recipe) and run(fn)"
    )
