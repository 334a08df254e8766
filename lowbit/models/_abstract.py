"""A model whose body is a stack of identical layers, and its shape-only instances."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp
from flax import nnx


class LayerStack(nnx.Module, abc.ABC):
    """``config.n_layers`` copies of one layer class between the ends a subclass builds.

    A subclass (`Decoder`, `Bert`) names its layer class (`Layer`) and builds its ends:
    embeddings in `build_input`, a final norm and output head in `build_output`. The layers
    are ``self.layers``, an `nnx.List`, so parameter paths read ``layers/<i>/...``.

    Args (of the constructor):
      config: a frozen dataclass with an ``n_layers`` field.
      dtype, param_dtype: compute and parameter dtypes of every submodule.
      rngs: initialisation randomness.
    """

    Layer: ClassVar[type[nnx.Module]]

    def __init__(
        self,
        config: Any,
        *,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.config = config
        self.dtype = dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        # Built in the order the data flows, which is the order `rngs` initialises them in.
        self.build_input(config, **kw)
        self.layers = nnx.List([self.Layer(config, **kw) for _ in range(config.n_layers)])
        self.build_output(config, **kw)

    @abc.abstractmethod
    def build_input(self, config: Any, **kw: Any) -> None:
        """Builds the submodules before the layers; `kw` is what every submodule takes."""

    def build_output(self, config: Any, **kw: Any) -> None:
        """Builds the submodules after the layers (none by default)."""

    @classmethod
    def abstract(cls, config: Any, *, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32):
        """``cls(config)`` with `jax.ShapeDtypeStruct` placeholders for its parameters.

        The same module `nnx.eval_shape(lambda: cls(config, ...))` gives, for loaders to fill
        in, but built by tracing the model without layers and one layer, then cloning that
        layer ``config.n_layers`` times: NNX's tracing cost grows with the length of the trace,
        which makes tracing all layers at once take seconds.
        """
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        empty = dataclasses.replace(config, n_layers=0)
        model = nnx.eval_shape(lambda: cls(empty, **kw, rngs=nnx.Rngs(0)))
        one = nnx.eval_shape(lambda: cls.Layer(config, **kw, rngs=nnx.Rngs(0)))
        model.config = config
        model.layers = nnx.List([nnx.clone(one) for _ in range(config.n_layers)])
        return model
