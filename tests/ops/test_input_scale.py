"""`QArray.input_scale`: a dot multiplies its float operand by the weight's input scale."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit
from lowbit.ops import dot_general
from lowbit.qarray import PerChannel, PerGroup, PerToken, QuantConfig, quantize

K, N = 64, 32
_X = jax.random.normal(jax.random.key(0), (8, K)) * jnp.linspace(0.1, 10.0, K)
_W = jax.random.normal(jax.random.key(1), (K, N))
_S = jnp.linspace(0.5, 2.0, K)

CONFIGS = {
    "int8 weight-only": (QuantConfig(format="int8", granularity=PerChannel((1,))), None),
    "int4 g32": (QuantConfig(format="int4", granularity=PerGroup(32, axis=0)), None),
    "w8a8": (
        QuantConfig(format="int8", granularity=PerChannel((1,))),
        QuantConfig(format="int8", granularity=PerToken()),
    ),
}


def _scaled(config, activation):
    """Codes of `W / s`, with the input scale `s` [K, 1]."""
    q = dataclasses.replace(quantize(_W / _S[:, None], config), activation=activation)
    return dataclasses.replace(q, input_scale=_S[:, None]).check()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_dot_scales_the_float_operand_before_the_product(name):
    q = _scaled(*CONFIGS[name])
    plain = dataclasses.replace(q, input_scale=None)
    dims = (((1,), (0,)), ((), ()))
    out = dot_general(_X, q, dims)
    # Exactly the product of the scaled input with the weight without its scale, on the
    # same path (activation quantization included).
    np.testing.assert_array_equal(out, dot_general(_X * _S, plain, dims))
    assert lowbit.ops.dot_general_path(_X, q, dims) == lowbit.ops.dot_general_path(_X, plain, dims)
    # Transposed weight, weight on the left: the same product.
    np.testing.assert_allclose(dot_general(_X, q.T, (((1,), (1,)), ((), ()))), out, rtol=1e-5)
    left = dot_general(q.T, _X, (((1,), (1,)), ((), ())))
    np.testing.assert_allclose(left.T, out, rtol=1e-5, atol=1e-4)


def test_dequantize_folds_the_input_scale_and_layout_ops_carry_it():
    q = _scaled(*CONFIGS["int4 g32"])
    np.testing.assert_allclose(
        q.dequantize(), dataclasses.replace(q, input_scale=None).dequantize() * _S[:, None]
    )
    assert q.T.input_scale.shape == (1, K)
    assert q.nbytes == dataclasses.replace(q, input_scale=None).nbytes + K * 4
    with pytest.raises(ValueError, match="input_scale shape"):
        dataclasses.replace(q, input_scale=jnp.ones((K, 2))).check()


def test_prepared_weight_keeps_the_input_scale():
    k = n = 256  # large enough for the CPU kernels
    w = jax.random.normal(jax.random.key(2), (k, n))
    s = jnp.linspace(0.5, 2.0, k)[:, None]
    config = QuantConfig(format="int4", granularity=PerGroup(32, axis=0))
    q = dataclasses.replace(quantize(w / s, config), input_scale=s)
    prepared = lowbit.ops.prepare_weight(q, 0)
    if not isinstance(prepared, lowbit.ops.PreparedQArray):
        pytest.skip("no CPU kernel for this layout here")
    x = jax.random.normal(jax.random.key(3), (4, k))
    dims = (((1,), (0,)), ((), ()))
    np.testing.assert_allclose(
        dot_general(x, prepared, dims), dot_general(x, q, dims), rtol=1e-4, atol=1e-3
    )
    np.testing.assert_array_equal(prepared.logical().input_scale, q.input_scale)
    np.testing.assert_array_equal(prepared.T.logical().input_scale, q.T.input_scale)


def test_ops_that_cannot_apply_an_input_scale_say_so():
    q = _scaled(*CONFIGS["int8 weight-only"])
    experts = jax.tree.map(lambda a: a[None], q)
    with pytest.raises(ValueError, match="ragged_dot_general: .*input_scale"):
        lowbit.ops.ragged_dot(_X, experts, jnp.array([8], jnp.int32))
    with pytest.raises(ValueError, match="two quantized operands"):
        dot_general(q.T, q, (((1,), (0,)), ((), ())))
