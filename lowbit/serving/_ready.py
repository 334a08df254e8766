"""Quantized parameters of a loaded model made ready to run: laid out for the CPU kernels.

Every path that serves a model (a recipe applied in memory, a checkpoint read back, a GGUF
file's own blocks) ends here, so the weights are prepared once (`lowbit.ops.prepare_weights`,
as `lowbit.prepare` lays them out), by the contraction axes of the model's own forward traced
abstractly on a ``[1, 8]`` token batch. Those axes, and the fallback report, are kept beside
the compiled programs when a program directory is given, so a second start does not trace.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from lowbit._atomic import atomic_write
from lowbit.api import describe, kernel_axes_of, program_key
from lowbit.engine import is_quantized, trace_report
from lowbit.ops import prepare_weights
from lowbit.serving._load import LoadedModel, model_fn

# The example batch the forward is traced on (abstractly: nothing runs). The contraction
# axes do not depend on its size.
_EXAMPLE_TOKENS = jax.ShapeDtypeStruct((1, 8), jnp.int32)


def _example_batch(loaded: LoadedModel) -> tuple[Any, ...]:
    return (_EXAMPLE_TOKENS,) if loaded.kind == "lm" else (_EXAMPLE_TOKENS, _EXAMPLE_TOKENS)


def ready(loaded: LoadedModel, params: Any, program_dir: str | None = None) -> Any:
    """`params` of `loaded` with the weights the CPU kernels run laid out for them.

    Args:
      loaded: the float model whose forward the params serve.
      params: its parameters (a pure dict or `nnx.State`) with `QArray` leaves.
      program_dir: where traced programs are kept (`lowbit.api.program_directory()`); the
        contraction axes found by tracing the forward are kept there too (`kernel_axes`).
    Returns:
      The params with `PreparedQArray`s in place of the weights a kernel runs.
    """
    return prepare_weights(params, kernel_axes(loaded, params, program_dir))


def kernel_axes_fn(
    loaded: LoadedModel, program_dir: str | None = None
) -> Callable[[Any], dict[tuple, int]]:
    """`kernel_axes` of `loaded` as a function of the params, for the loaders that lay each
    weight out as it is read (`lowbit.io.import_gguf`'s ``kernel_axes``), so the tree is
    resident once: the same axes `ready` finds."""
    return lambda params: kernel_axes(loaded, params, program_dir)


def kernel_axes(loaded: LoadedModel, params: Any, program_dir: str | None = None) -> dict:
    """``{key path: contraction axis}`` of the 2-D weights in `params` that the model's
    forward contracts over one axis (`lowbit.api.kernel_axes_of`, traced abstractly).

    With a `program_dir`, the axes are kept there under the key a compiled program of this
    model and these parameters' layouts would have (`_kept`), so a second start does not
    trace the model for them (1-2 s of a start whose programs are kept, at 135M-1.5B).
    """
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_quantized)[0]

    def traced() -> list[list[int]]:
        index = {tuple(keys): i for i, (keys, _) in enumerate(flat)}
        fn = model_fn(loaded.model, loaded.kind)
        found = kernel_axes_of(fn, params, *_example_batch(loaded))
        return sorted([index[keys], axis] for keys, axis in found.items())

    def valid(pairs: Any) -> bool:
        return isinstance(pairs, list) and all(
            isinstance(p, list)
            and len(p) == 2
            and all(type(v) is int for v in p)
            and 0 <= p[0] < len(flat)
            and p[1] in (0, 1)
            for p in pairs
        )

    pairs = _kept("kernel-axes", loaded, params, program_dir, traced, valid)
    return {tuple(flat[i][0]): axis for i, axis in pairs}


def fallback_report(
    loaded: LoadedModel, params: Any, directory: str | os.PathLike[str] | None = None
) -> list[str]:
    """One line per weight the model's forward would dequantize or lay out on every call
    (the engine's fallbacks, traced abstractly on the example batch): empty when every
    quantized weight runs on a kernel in its prepared layout.

    With a `directory` (`program_directory()`), the lines are kept there (`_kept`), so a
    second start does not trace the model again for them."""

    def traced() -> list[str]:
        report = trace_report(model_fn(loaded.model, loaded.kind), params, *_example_batch(loaded))
        return list(report.fallback_details)

    def valid(lines: Any) -> bool:
        return isinstance(lines, list) and all(isinstance(x, str) for x in lines)

    return _kept("fallbacks", loaded, params, directory, traced, valid)


def _kept(
    name: str,
    loaded: LoadedModel,
    params: Any,
    directory: str | os.PathLike[str] | None,
    traced: Callable[[], Any],
    valid: Callable[[Any], bool],
) -> Any:
    """``traced()`` (a JSON value found by tracing `loaded`'s forward on `params`), read from
    `directory` when an earlier process kept it there, else computed and kept.

    The file is named as a compiled program of this model, these parameters' layouts and the
    example batch would be (`program_key`: the graph, config, every leaf's format, shape and
    dtype, JAX's version, lowbit's code digest), so any change that could change the trace
    makes another file. A file that does not read back as `valid` is traced again."""
    if directory is None:
        return traced()
    static = describe((nnx.graphdef(loaded.model), loaded.model.config, loaded.kind))
    key = program_key(name, static, (params, _example_batch(loaded)))
    path = pathlib.Path(directory) / f"{key}.json"
    try:
        value = json.loads(path.read_text())
        if valid(value):
            return value
    except (OSError, ValueError):
        pass  # not kept yet, or damaged: traced again below
    value = traced()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(value).encode())
    except OSError:
        pass  # kept next time, or never: only a slower start
    return value
