"""Quantized parameters of a loaded model made ready to run: laid out for the CPU kernels.

Every path that serves a model (a recipe applied in memory, a checkpoint read back, a GGUF
file's own blocks) ends here, so the weights are prepared once, by `lowbit.prepare`, from the
model's own forward traced abstractly on a ``[1, 8]`` token batch.
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
from lowbit.api import describe, kernel_axes_of, prepare, program_key
from lowbit.engine import trace_report
from lowbit.serving._load import LoadedModel, model_fn

# The example batch the forward is traced on (abstractly: nothing runs). The contraction
# axes do not depend on its size.
_EXAMPLE_TOKENS = jax.ShapeDtypeStruct((1, 8), jnp.int32)


def _example_batch(loaded: LoadedModel) -> tuple[Any, ...]:
    return (_EXAMPLE_TOKENS,) if loaded.kind == "lm" else (_EXAMPLE_TOKENS, _EXAMPLE_TOKENS)


def ready(loaded: LoadedModel, params: Any) -> Any:
    """`params` of `loaded` with the weights the CPU kernels run laid out for them.

    Args:
      loaded: the float model whose forward the params serve.
      params: its parameters (a pure dict or `nnx.State`) with `QArray` leaves.
    Returns:
      The params with `PreparedQArray`s in place of the weights a kernel runs.
    """
    return prepare(params, model_fn(loaded.model, loaded.kind), *_example_batch(loaded))


def kernel_axes_fn(loaded: LoadedModel) -> Callable[[Any], dict[tuple, int]]:
    """``params -> {key path: contraction axis}`` of the model's forward, traced abstractly.

    For the loaders that lay each weight out as it is read (`lowbit.io.import_gguf`'s
    ``kernel_axes``), so the tree is resident once: the same axes `ready` finds.
    """
    fn = model_fn(loaded.model, loaded.kind)
    batch = _example_batch(loaded)
    return lambda params: kernel_axes_of(fn, params, *batch)


def fallback_report(
    loaded: LoadedModel, params: Any, directory: str | os.PathLike[str] | None = None
) -> list[str]:
    """One line per weight the model's forward would dequantize or lay out on every call
    (the engine's fallbacks, traced abstractly on the example batch): empty when every
    quantized weight runs on a kernel in its prepared layout.

    With a `directory` (`program_directory()`), the lines are kept there under the same key
    as a compiled program of this model and these parameters' layouts (`program_key`), so a
    second start does not trace the model again for them."""
    batch = _example_batch(loaded)
    path = None
    if directory is not None:
        static = describe((nnx.graphdef(loaded.model), loaded.model.config, loaded.kind))
        key = program_key("fallbacks", static, (params, batch))
        path = pathlib.Path(directory) / f"{key}.json"
        try:
            lines = json.loads(path.read_text())
            if isinstance(lines, list) and all(isinstance(x, str) for x in lines):
                return lines
        except (OSError, ValueError):
            pass  # not kept yet, or damaged: traced again below
    report = trace_report(model_fn(loaded.model, loaded.kind), params, *batch)
    lines = list(report.fallback_details)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, json.dumps(lines).encode())
        except OSError:
            pass  # kept next time, or never: only a slower start
    return lines
