"""`Llama` mechanics on a tiny random model (fast to compile): cache chunks, positions, dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowbit import models

CONFIG = models.LlamaConfig(
    vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48
)


@pytest.fixture(scope="module")
def tiny():
    return models.Llama(CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(1), (2, 9), 0, CONFIG.vocab_size, jnp.int32)


def test_cache_in_uneven_chunks_matches_full_forward(tiny, tokens):
    full = tiny(tokens)
    assert full.shape == (2, 9, CONFIG.vocab_size)
    step = nnx.jit(lambda m, t, c: m(t, cache=c))
    cache = tiny.init_cache(2, 16)
    pieces = []
    for lo, hi in [(0, 4), (4, 6), (6, 7), (7, 9)]:
        logits, cache = step(tiny, tokens[:, lo:hi], cache)
        pieces.append(logits)
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), full, atol=1e-5, rtol=1e-5)
    assert int(cache.length) == 9
    logits, _ = tiny.decode_step(tokens[:, :1], tiny.init_cache(2, 4))
    np.testing.assert_allclose(logits, full[:, :1], atol=1e-5, rtol=1e-5)


def test_positions_are_relative(tiny, tokens):
    # Rotary attention depends only on position differences, so shifting every position
    # leaves the logits unchanged (up to float rounding of the larger angles).
    shifted = tiny(tokens, positions=jnp.arange(9) + 100)
    np.testing.assert_allclose(shifted, tiny(tokens), atol=2e-4, rtol=2e-4)
    per_row = tiny(tokens, positions=jnp.stack([jnp.arange(9), jnp.arange(9) + 5]))
    np.testing.assert_allclose(per_row, tiny(tokens), atol=2e-4, rtol=2e-4)


def test_causal(tiny, tokens):
    changed = tokens.at[:, 5].set((tokens[:, 5] + 1) % CONFIG.vocab_size)
    np.testing.assert_array_equal(tiny(changed)[:, :5], tiny(tokens)[:, :5])


def test_bfloat16(tokens):
    model = models.Llama(CONFIG, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    logits, cache = model(tokens, cache=model.init_cache(2, 16))
    assert logits.dtype == jnp.bfloat16 and cache.keys[0].dtype == jnp.bfloat16
    assert bool(jnp.all(jnp.isfinite(logits.astype(jnp.float32))))


def test_untied_head_and_jit_over_split_state(tokens):
    config = models.LlamaConfig(**{**CONFIG.__dict__, "tie_embeddings": False})
    model = models.Llama(config, rngs=nnx.Rngs(3))
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    np.testing.assert_allclose(fwd(state, tokens), model(tokens), atol=1e-5, rtol=1e-5)
    assert model.lm_head.kernel.shape == (32, 97)
