"""`LoraWeight` and `lora_dot_general`: base product + low-rank term equals the merged weight."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from ops_helpers import jit_quantize, normal

from lowbit.ops import LoraLayoutError, LoraWeight, lora_dot_general, lora_init
from lowbit.qarray import PerGroup


def _bases():
    w = normal(0, (64, 48))
    return {
        "float": w,
        "int8": jit_quantize(w, "int8"),
        "nf4_g32": jit_quantize(w, "nf4", granularity=PerGroup(32, 0)),
    }


BASES = _bases()


def _weight(base, in_axes=(0,), out_axes=(1,), rank=4, scale=2.0, **kw):
    a, b = lora_init(jax.random.key(1), base, rank=rank, in_axes=in_axes, out_axes=out_axes)
    b = normal(2, b.shape) * 0.1  # non-zero, so the low-rank term shows
    return LoraWeight(base, a, b, in_axes=in_axes, out_axes=out_axes, scale=scale, **kw)


@pytest.mark.parametrize("kind", list(BASES))
@pytest.mark.parametrize("weight_side", ["rhs", "lhs"])
def test_matches_the_merged_weight(kind, weight_side):
    w = _weight(BASES[kind])
    merged = w.dequantize()
    if weight_side == "rhs":
        x = normal(3, (5, 64))
        dims = (((1,), (0,)), ((), ()))
        got, want = lora_dot_general(x, w, dims), lax.dot_general(x, merged, dims)
    else:
        x = normal(3, (64, 5))
        dims = (((0,), (0,)), ((), ()))
        got, want = lora_dot_general(w, x, dims), lax.dot_general(merged, x, dims)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_multi_axis_output_and_delta_layout():
    # A DenseGeneral-style kernel [in, heads, head_dim] with two output axes.
    base = normal(4, (32, 4, 8))
    w = _weight(base, in_axes=(0,), out_axes=(1, 2))
    assert w.a.shape == (32, 4) and w.b.shape == (4, 4, 8)
    delta = np.einsum("ir,rhd->ihd", w.a, w.b) * w.scale
    np.testing.assert_allclose(w.delta(), delta, rtol=1e-5, atol=1e-6)
    x = normal(5, (3, 32))
    dims = (((1,), (0,)), ((), ()))
    np.testing.assert_allclose(
        lora_dot_general(x, w, dims), lax.dot_general(x, w.dequantize(), dims), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("kind", ["float", "nf4_g32"])
def test_gradients_reach_only_the_adapters(kind):
    w = _weight(BASES[kind])
    x = normal(6, (5, 64))
    dims = (((1,), (0,)), ((), ()))

    def loss(a, b, x):
        return jnp.sum(jnp.sin(lora_dot_general(x, LoraWeight(w.base, a, b, scale=2.0), dims)))

    def reference(a, b, x):
        return jnp.sum(jnp.sin(x @ LoraWeight(w.base, a, b, scale=2.0).dequantize()))

    got = jax.grad(loss, argnums=(0, 1, 2))(w.a, w.b, x)
    want = jax.grad(reference, argnums=(0, 1, 2))(w.a, w.b, x)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-3, atol=1e-4)
    if kind == "float":
        frozen = lambda base: jnp.sum(lora_dot_general(x, LoraWeight(base, w.a, w.b), dims))
        assert not np.any(jax.grad(frozen)(w.base))


def test_dropout_masks_the_low_rank_path_only():
    base = BASES["float"]
    x = normal(7, (16, 64))
    dims = (((1,), (0,)), ((), ()))
    plain = _weight(base)
    dropped = _weight(base, key=jax.random.key(0), dropout=0.5)
    y_plain = lora_dot_general(x, plain, dims)
    y_drop = lora_dot_general(x, dropped, dims)
    assert not np.allclose(y_plain, y_drop)
    # Same key, same mask; zero adapters make dropout irrelevant.
    np.testing.assert_array_equal(y_drop, lora_dot_general(x, dropped, dims))
    zero = LoraWeight(base, plain.a, jnp.zeros_like(plain.b), key=jax.random.key(0), dropout=0.5)
    np.testing.assert_allclose(lora_dot_general(x, zero, dims), x @ base, rtol=1e-5, atol=1e-5)


def test_other_contractions_are_refused():
    w = _weight(BASES["float"])
    with pytest.raises(LoraLayoutError, match="input axes"):
        lora_dot_general(normal(8, (5, 48)), w, (((1,), (1,)), ((), ())))
