"""`EngineValue`: the one protocol of the values the engine carries."""

import inspect

import jax
import jax.numpy as jnp
import pytest

from lowbit import ops
from lowbit.qarray import (
    ArrayBacked,
    EngineValue,
    NMSparse,
    NoRule,
    PerChannel,
    QArray,
    nm_sparsify,
    quantize,
)

_W = jax.random.normal(jax.random.key(0), (8, 4))
_Q = quantize(_W, "int8", granularity=PerChannel((1,)))
VALUES = {
    "QArray": _Q,
    "NMSparse": nm_sparsify(_W, 2, 4, 0),
    "QatWeight": ops.qat_weight(_W, "int8"),
    "LoraWeight": ops.LoraWeight(base=_Q, a=jnp.zeros((8, 2)), b=jnp.zeros((2, 4))),
    "Fp8Weight": ops.Fp8Weight(
        value=_W, state={k: jnp.zeros((16,)) for k in ("weight", "activation", "gradient")}
    ),
}
CLASSES = (QArray, NMSparse, ops.PreparedQArray, ops.QatWeight, ops.LoraWeight, ops.Fp8Weight)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_engine_value_is_a_concrete_protocol_class(cls):
    assert issubclass(cls, EngineValue)
    assert not inspect.isabstract(cls)
    # The array surface is the base's: ndim follows from shape, once.
    assert "ndim" not in vars(cls)


@pytest.mark.parametrize(
    "cls",
    (ops.PreparedQArray, ops.QatWeight, ops.LoraWeight, ops.Fp8Weight),
    ids=lambda c: c.__name__,
)
def test_wrapping_values_take_shape_and_dtype_from_their_backing_field(cls):
    assert issubclass(cls, ArrayBacked)
    assert "shape" not in vars(cls) and "dtype" not in vars(cls)


@pytest.mark.parametrize("name", ["QatWeight", "LoraWeight", "Fp8Weight"])
def test_array_backed_shape_and_dtype_are_the_backing_arrays(name):
    value = VALUES[name]
    backing = getattr(value, value.backing)
    assert value.shape == tuple(backing.shape) and value.dtype == backing.dtype


@pytest.mark.parametrize("name", sorted(VALUES))
def test_protocol_surface(name):
    value = VALUES[name]
    assert value.shape == (8, 4) and value.ndim == 2
    assert value.dequantize().shape == (8, 4)
    assert value.describe().startswith(name + "(")
    assert value.logical() is value


def test_report_descriptions():
    assert VALUES["QArray"].describe() == "QArray(int8, shape=(8, 4))"
    assert VALUES["NMSparse"].describe() == "NMSparse(2:4, shape=(8, 4))"
    assert VALUES["QatWeight"].describe() == "QatWeight(QArray(int8, shape=(8, 4)))"
    assert VALUES["LoraWeight"].describe() == "LoraWeight(QArray(int8, shape=(8, 4)), rank=2)"
    assert VALUES["Fp8Weight"].describe() == "Fp8Weight(shape=(8, 4), delayed)"


def test_abstract_base_needs_the_protocol_methods():
    class Partial(EngineValue):
        shape = (1,)
        dtype = jnp.float32

    with pytest.raises(TypeError, match="abstract"):
        Partial()


def test_values_take_part_in_no_op_unless_they_say_so():
    sparse = VALUES["NMSparse"]
    with pytest.raises(NoRule, match="N:M sparse"):
        sparse.map_layout(lambda q: q, lambda x: x)
    with pytest.raises(NoRule, match="no conv rule for NMSparse"):
        sparse.conv_general_dilated(None, sparse)
    assert _Q.dot_general(None, _Q, None) is NotImplemented  # lowbit.ops' own operand


@pytest.mark.parametrize("name", ["LoraWeight", "Fp8Weight"])
def test_map_backing_keeps_a_wrapper_only_through_shape_preserving_ops(name):
    value = VALUES[name]
    kept = value.map_backing(lambda q: q, lambda x: x.astype(jnp.bfloat16), "this weight")
    assert type(kept) is type(value) and kept.shape == value.shape
    transpose = lambda x: x.T
    with pytest.raises(NoRule, match="changes the shape of this weight"):
        value.map_backing(lambda q: q.map_layout(transpose, transpose), transpose, "this weight")


def test_describe_backing_names_a_float_backing_by_its_shape():
    lora = ops.LoraWeight(base=_W, a=jnp.zeros((8, 2)), b=jnp.zeros((2, 4)))
    assert lora.describe_backing() == "float(8, 4)"
    assert VALUES["LoraWeight"].describe_backing() == "QArray(int8, shape=(8, 4))"
