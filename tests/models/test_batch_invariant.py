"""A row's logits are the same bits at every batch size (`lowbit.models._batch_invariant`):
the RMSNorm built on the fixed-order row sum (`tests/kernels/test_kernels_row_sum.py`), and a
decode step of a SmolLM2-wide decoder on the CPU kernels with int8 activations, as the server
runs whichever rows are busy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowbit import serving
from lowbit.engine import interpret
from lowbit.models import Decoder, DecoderConfig
from lowbit.models._batch_invariant import RMSNorm


def test_rms_norm_matches_flax_and_refuses_what_it_does_not_do():
    x = jax.random.normal(jax.random.key(0), (2, 3, 576)) * 3.0
    ours = RMSNorm(576, epsilon=1e-5, rngs=nnx.Rngs(0))
    theirs = nnx.RMSNorm(576, epsilon=1e-5, rngs=nnx.Rngs(0))
    ours.scale[...] = theirs.scale[...] = jax.random.uniform(jax.random.key(1), (576,))
    np.testing.assert_allclose(ours(x), theirs(x), rtol=2e-6, atol=1e-6)
    assert ours(x.astype(jnp.bfloat16)).dtype == theirs(x.astype(jnp.bfloat16)).dtype
    with pytest.raises(ValueError, match="without a mask"):
        ours(x, mask=x > 0)


# Features whose XLA code sits between the kernels: q/k/v biases; Gemma 3's norms on q and k
# and after each sub-block, tanh GELU, scaled embeddings, soft caps and sliding windows.
FAMILIES = {
    "llama": {},
    "qwen2": {"qkv_bias": True},
    "gemma3": {
        "qk_norm": True,
        "post_norms": True,
        "activation": "gelu_tanh",
        "embed_scale": True,
        "attn_softcap": 50.0,
        "final_softcap": 30.0,
        "sliding_window": 8,
        "global_every": 2,
        "rope_base_local": 10000.0,
    },
}


@functools.cache
def _smollm2_wide(family: str):
    """Two layers of SmolLM2-135M's shapes (where XLA's fusions are those of the real model)
    with `family`'s features, random weights, w4a8 on the CPU kernels."""
    config = DecoderConfig(
        vocab_size=512,
        dim=576,
        n_layers=2,
        n_heads=9,
        n_kv_heads=3,
        head_dim=64,
        ffn_dim=1536,
        **FAMILIES[family],
    )
    model = Decoder(config, rngs=nnx.Rngs(0))
    loaded = serving.LoadedModel(name="wide", spec="wide", kind="lm", model=model, tokenizer=None)
    graphdef, state = nnx.split(model)
    params, _ = serving.apply_recipe(loaded, state, "w4a8_g32")
    return model, graphdef, params


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_give_a_row_the_same_bits_at_every_batch_size(family):
    model, graphdef, params = _smollm2_wide(family)

    def forward(params, tokens, cache, fresh):
        run = lambda p, t, c: nnx.merge(graphdef, p)(t, cache=c, fresh=fresh)  # noqa: E731
        return interpret(run)(params, tokens, cache)

    # Compiled as users' programs are, with LLVM's full pipeline: the suite's cheap one
    # (tests/conftest.py) gave rows at batch 3 other bits in the last place in decode.
    full = {"xla_backend_optimization_level": 2, "xla_llvm_disable_expensive_passes": False}
    prefill = jax.jit(functools.partial(forward, fresh=True), compiler_options=full)
    decode = jax.jit(functools.partial(forward, fresh=False), compiler_options=full)
    prompt = np.random.default_rng(0).integers(1, 512, (1, 12)).astype(np.int32)
    rows = {}
    # XLA's fusions of a SmolLM2 decode step fell in three classes over batch sizes 1-16 on
    # AVX-512, {1, 2}, {3, 4} and {8, 16}, each rounding otherwise before `_batch_invariant`.
    for b in (1, 3, 8):
        cache = model.init_cache(b, 64)
        logits, cache = prefill(params, jnp.asarray(np.repeat(prompt, b, 0)), cache)
        steps = [logits[:, -1]]
        for _ in range(2):
            token = jnp.argmax(steps[-1], -1).astype(jnp.int32)[:, None]
            logits, cache = decode(params, token, cache)
            steps.append(logits[:, -1])
        rows[b] = np.stack([np.asarray(s) for s in steps], 1)  # [b, 3, vocab]
    for b, got in rows.items():
        for r in range(b):
            np.testing.assert_array_equal(got[r], rows[1][0], err_msg=f"batch {b}, row {r}")
