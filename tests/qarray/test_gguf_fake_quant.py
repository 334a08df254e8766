"""Fake quantization on GGUF grids: exact values, llama.cpp's parameters at initialisation,
blocks that decode to the trained values, and LSQ / straight-through gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit import gguf
from lowbit.gguf import GRIDS
from lowbit.qarray import gguf_fake_quant, gguf_grid_init, gguf_pack

TYPES = tuple(GRIDS)


def _weights(seed: int = 0) -> np.ndarray:
    """[40, 512] weights: random rows, then adversarial ones: one outlier per block, constant
    blocks, rows of zeros / a constant / huge / tiny values / half zeros / +-1, huge values."""
    rng = np.random.default_rng(seed)
    normal = rng.standard_normal((8, 512)).astype(np.float32)
    outlier = 0.01 * normal.copy()
    outlier[:, ::32] = 10.0 * np.sign(normal[:, ::32] + 0.5)
    constant = np.repeat(rng.standard_normal((8, 16)), 32, axis=1).astype(np.float32)
    mixed = np.stack(
        [
            np.zeros(512),
            np.full(512, 0.75),
            np.clip(2e4 * normal[2], -65504, 65504),
            1e-6 * normal[3],
            1e-3 * normal[4],
            np.where(np.arange(512) < 256, 0.0, normal[5]),
            np.where(np.arange(512) % 2, 1.0, -1.0),
            outlier[7],
        ]
    ).astype(np.float32)
    huge = np.clip(3e4 * normal, -65504, 65504)
    return np.concatenate([normal, outlier, constant, mixed, huge]).astype(np.float32)


WEIGHTS = _weights()
RANDOM = slice(0, 8)
_fake_quant = jax.jit(gguf_fake_quant, static_argnums=2)
_pack = jax.jit(gguf_pack, static_argnums=2)


def _trained(params: dict, seed: int) -> dict:
    """Parameters moved as training might move them (scales, minimums and levels)."""
    rng = np.random.default_rng(seed)
    moved = {}
    for name, value in params.items():
        noise = rng.standard_normal(value.shape).astype(np.float32)
        if name in ("scale", "min"):
            moved[name] = value + 1.5 * noise
        else:
            moved[name] = value * (1 + 0.05 * noise)
    return {k: jnp.asarray(v) for k, v in moved.items()}


@pytest.mark.parametrize("ggml_type", TYPES)
def test_init_is_llama_cpp_ptq(ggml_type):
    w = WEIGHTS
    params = gguf_grid_init(w, ggml_type)
    fake = _fake_quant(w, params, ggml_type)
    ptq = gguf.decode(ggml_type, gguf.encode(ggml_type, w))
    np.testing.assert_array_equal(np.asarray(fake), ptq)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_trained_grid_packs_exactly(ggml_type):
    w = WEIGHTS
    params = _trained(gguf_grid_init(w, ggml_type), seed=1)
    w_moved = w * (1 + 0.1 * np.random.default_rng(2).standard_normal(w.shape)).astype(np.float32)
    fake = _fake_quant(w_moved, params, ggml_type)
    blocks = _pack(w_moved, params, ggml_type)
    np.testing.assert_array_equal(gguf.decode(ggml_type, np.asarray(blocks)), np.asarray(fake))
    # The trained grid is not llama.cpp's any more (the parameters moved).
    ptq = gguf.decode(ggml_type, gguf.encode(ggml_type, w_moved[RANDOM]))
    assert not np.array_equal(np.asarray(fake)[RANDOM], ptq)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_gradients(ggml_type):
    w = jnp.asarray(WEIGHTS[RANDOM])
    params = gguf_grid_init(w, ggml_type)
    # A smaller step puts the largest weights of each block outside the grid.
    params = dict(params, d=params["d"] * 0.6)
    target = jnp.asarray(np.random.default_rng(3).standard_normal(w.shape), jnp.float32)

    def loss(w, params):
        return jnp.sum(gguf_fake_quant(w, params, ggml_type) * target)

    gw, gp = jax.jit(jax.grad(loss, argnums=(0, 1)))(w, params)
    for leaf in (gw, *gp.values()):
        assert np.isfinite(np.asarray(leaf)).all()
    gw = np.asarray(gw)
    # Straight-through inside the range: the gradient is the target's; zero for clipped ones.
    passed = gw != 0
    np.testing.assert_array_equal(gw[passed], np.asarray(target)[passed])
    assert 0.5 < passed.mean() < 1.0
    for name, g in gp.items():
        assert np.abs(np.asarray(g)).max() > 0, name


def test_lsq_gradient_of_the_scale():
    """Q8_0 on one block: d x_hat / d d = q - w / d inside the range (LSQ)."""
    w = jnp.linspace(-1.0, 0.9, 32, dtype=jnp.float32)
    params = {"d": jnp.asarray([1.0 / 127], jnp.float32)}
    grads = jax.grad(lambda d: gguf_fake_quant(w, {"d": d}, "Q8_0").sum())(params["d"])
    d16 = float(np.float16(1.0 / 127))
    q = np.clip(np.round(np.asarray(w) * 127), -128, 127)
    expected = np.sum(q - np.asarray(w) / d16)
    np.testing.assert_allclose(float(grads[0]), expected, rtol=1e-3, atol=1e-3)


def test_bad_shapes_raise():
    w = jnp.zeros((4, 100))
    with pytest.raises(ValueError, match="blocks of 32"):
        gguf_grid_init(w, "Q4_0")
    w = jnp.zeros((4, 256))
    params = gguf_grid_init(w, "Q4_K")
    with pytest.raises(ValueError, match="gguf_grid_init"):
        gguf_fake_quant(w, dict(params, d=params["d"][:2]), "Q4_K")
    with pytest.raises(ValueError, match="no trainable grid"):
        gguf_grid_init(w, "TQ1_0")
