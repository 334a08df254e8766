"""The engine asks its values, never their kind: a new kind of weight is one class."""

import dataclasses
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.engine import EngineFallbackError, EngineReport, interpret
from lowbit.qarray import EngineValue, NoRule


@typing.final
@dataclasses.dataclass(frozen=True, eq=False)
class Negated(EngineValue):
    """A toy weight kind: stands for `-x`, computes its products without forming it."""

    x: jax.Array

    @property
    def shape(self):
        return tuple(self.x.shape)

    @property
    def dtype(self):
        return self.x.dtype

    def dequantize(self):
        return -self.x

    def map_layout(self, qarray_fn, float_fn):
        return Negated(float_fn(self.x))

    def describe(self):
        return f"Negated(shape={self.shape})"

    def dot_general(self, lhs, rhs, dimension_numbers, **kwargs):
        if rhs is not self:
            raise NoRule("is a Negated weight on the left")
        return -jax.lax.dot_general(lhs, self.x, dimension_numbers), "negated"


jax.tree_util.register_dataclass(Negated, data_fields=["x"], meta_fields=[])

_W = jax.random.normal(jax.random.key(0), (4, 3))
_X = jax.random.normal(jax.random.key(1), (2, 3))


def test_a_new_value_kind_runs_through_its_own_rules():
    report = EngineReport()
    out = jax.jit(interpret(lambda w, x: x @ w.T, strict=True, report=report))(Negated(_W), _X)
    np.testing.assert_allclose(out, _X @ (-_W).T, rtol=1e-6)
    assert report.quantized_ops == {"dot_general:negated": 1}
    assert report.layout_ops == {"transpose": 1}


def test_a_new_value_kind_falls_back_by_its_description():
    report = EngineReport()
    out = interpret(lambda w: jnp.cumsum(w, axis=0), report=report)(Negated(_W))
    np.testing.assert_allclose(out, jnp.cumsum(-_W, axis=0), rtol=1e-6)
    assert report.fallbacks == {"cumsum": 1}
    assert "Negated(shape=(4, 3))" in report.fallback_details[0]
    with pytest.raises(EngineFallbackError, match="Negated weight on the left"):
        interpret(lambda w, x: w @ x.T, strict=True)(Negated(_W), _X)
