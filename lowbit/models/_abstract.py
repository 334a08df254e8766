"""Shape-only model instances for loaders to fill in, built by tracing one layer."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from flax import nnx

M = TypeVar("M", bound=nnx.Module)


def abstract_stack(
    cls: type[M], config: Any, layer: type[nnx.Module], *, dtype: Any, param_dtype: Any
) -> M:
    """``cls(config)`` with `jax.ShapeDtypeStruct` placeholders for its parameters.

    The same module `nnx.eval_shape(lambda: cls(config, ...))` gives, but built by tracing the
    model without layers and one `layer` (``layer(config, ...)``), then cloning that layer
    ``config.n_layers`` times into ``model.layers``: NNX's tracing cost grows with the length
    of the trace, which makes tracing all layers at once take seconds.

    Args:
      cls: the model class; its constructor takes ``(config, *, dtype, param_dtype, rngs)`` and
        builds ``config.n_layers`` layers into an `nnx.List` called ``layers``.
      config: a frozen dataclass with an ``n_layers`` field.
      layer: the class of one of those layers, constructed the same way.
    """
    kw = dict(dtype=dtype, param_dtype=param_dtype)
    empty = dataclasses.replace(config, n_layers=0)
    model = nnx.eval_shape(lambda: cls(empty, **kw, rngs=nnx.Rngs(0)))
    one = nnx.eval_shape(lambda: layer(config, **kw, rngs=nnx.Rngs(0)))
    model.config = config
    model.layers = nnx.List([nnx.clone(one) for _ in range(config.n_layers)])
    return model
