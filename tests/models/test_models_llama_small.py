"""`Decoder` mechanics on a tiny random model (fast to compile): cache chunks, positions, dtype.

Every forward runs under `jax.jit`, and parameters are drawn with NumPy into an abstract
model: op-by-op JAX execution compiles each primitive on its own, which costs more here than
compiling the whole tiny model.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowbit import models

CONFIG = models.DecoderConfig(
    vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48
)


@functools.partial(jax.jit, static_argnums=0)
def _run(graphdef, state, tokens, positions=None, cache=None):
    return nnx.merge(graphdef, state)(tokens, positions=positions, cache=cache)


def run(model, tokens, **kw):
    return _run(*nnx.split(model), tokens, **kw)


def random_model(config, dtype=jnp.float32, seed=0):
    graphdef, state = nnx.split(models.Decoder.abstract(config, dtype=dtype, param_dtype=dtype))
    rng = np.random.default_rng(seed)
    state = jax.tree.map(lambda s: (0.3 * rng.standard_normal(s.shape)).astype(s.dtype), state)
    return nnx.merge(graphdef, state)


@pytest.fixture(scope="module")
def tiny():
    return random_model(CONFIG)


@pytest.fixture(scope="module")
def tokens():
    return jnp.asarray(np.random.default_rng(1).integers(0, CONFIG.vocab_size, (2, 9)), jnp.int32)


@pytest.fixture(scope="module")
def full(tiny, tokens):
    return run(tiny, tokens)


def test_cache_in_uneven_chunks_matches_full_forward(tiny, tokens, full):
    assert full.shape == (2, 9, CONFIG.vocab_size)
    cache = tiny.init_cache(2, 16)
    pieces = []
    for lo, hi in [(0, 4), (4, 8), (8, 9)]:
        logits, cache = run(tiny, tokens[:, lo:hi], cache=cache)
        pieces.append(logits)
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, atol=1e-5, rtol=1e-5)
    assert int(cache.length) == 9


def test_positions_are_relative(tiny, tokens, full):
    # Rotary attention depends only on position differences, so shifting positions (per row
    # or for all rows) leaves the logits unchanged up to rounding of the larger angles.
    shifted = jnp.stack([jnp.arange(9) + 100, jnp.arange(9) + 5])
    np.testing.assert_allclose(run(tiny, tokens, positions=shifted), full, atol=2e-4, rtol=2e-4)


def test_causal(tiny, tokens, full):
    changed = tokens.at[:, 5].set((tokens[:, 5] + 1) % CONFIG.vocab_size)
    np.testing.assert_array_equal(run(tiny, changed)[:, :5], full[:, :5])


def test_bfloat16_and_untied_head(tokens):
    config = models.DecoderConfig(**{**CONFIG.__dict__, "tie_embeddings": False})
    model = random_model(config, dtype=jnp.bfloat16)
    assert model.lm_head.kernel.shape == (32, 97)
    logits, cache = run(model, tokens, cache=model.init_cache(2, 16))
    assert logits.dtype == jnp.bfloat16 and cache.keys[0].dtype == jnp.bfloat16
    assert bool(jnp.all(jnp.isfinite(logits.astype(jnp.float32))))
