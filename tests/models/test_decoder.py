"""The one decoder: every architecture's variation is consistent between prefill and cached
decode, sliding windows hide exactly the positions they should, experts match a per-token
reference, and quantized experts run through the engine's ragged_dot."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import compiled
from flax import nnx

import lowbit
from lowbit.models import Decoder, DecoderConfig
from lowbit.models._attention import softcap
from lowbit.qarray import is_qarray

BASE = dict(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48)
VARIANTS = {
    "qwen2": dict(qkv_bias=True),
    "qwen3": dict(qk_norm=True),
    "gemma2": dict(
        activation="gelu_tanh",
        embed_scale=True,
        post_norms=True,
        attn_softcap=5.0,
        final_softcap=3.0,
        sliding_window=4,
        global_every=2,
        query_scale=0.2,
    ),
    "gemma3": dict(
        activation="gelu_tanh",
        embed_scale=True,
        post_norms=True,
        qk_norm=True,
        sliding_window=4,
        global_every=3,
        rope_base_local=100.0,
        rope_scale=2.0,
    ),
    "mistral": dict(sliding_window=5),
    "phi3": dict(fused_qkv=True, fused_gate_up=True),
    "llama3": dict(rope_freq_factors=(1.0, 2.0, 4.0, 8.0)),
    "qwen2moe": dict(
        n_experts=4,
        n_experts_used=2,
        expert_ffn_dim=16,
        shared_ffn_dim=24,
        norm_topk=False,
    ),
}
RNG = np.random.default_rng(0)
TOKENS = jnp.asarray(RNG.integers(0, 64, (2, 12)), jnp.int32)


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("kv_cache", [None, "int8"])
def test_cached_decode_matches_one_prefill(name, kv_cache):
    # Prefill 8 tokens, then decode 4 one at a time through the block-wise decode attention
    # (a 64-slot cache): the logits of every position are those of one uncached pass.
    model = Decoder(DecoderConfig(**BASE, **VARIANTS[name]), rngs=nnx.Rngs(0))
    forward = compiled(model)
    full = forward(TOKENS)
    cache = model.init_cache(2, 64, kv_cache)
    logits, cache = forward(TOKENS[:, :8], cache=cache)
    outs = [logits]
    for t in range(8, 12):
        logits, cache = forward(TOKENS[:, t : t + 1], cache=cache)
        outs.append(logits)
    tol = 1e-4 if kv_cache is None else 0.15
    err = jnp.max(jnp.abs(jnp.concatenate(outs, 1) - full))
    assert err < tol, err
    if kv_cache is None:
        assert jnp.argmax(jnp.concatenate(outs, 1), -1).tolist() == jnp.argmax(full, -1).tolist()


@pytest.mark.parametrize(
    ("name", "kv_cache", "seq"),
    [
        ("qwen2", None, 12),
        ("gemma2", "int8", 12),  # sliding-window layers; a quantized cache's rounding
        ("gemma3", None, 1),  # a one-token prompt takes the decode-attention path
        ("mistral", "int8+qk", 12),  # integer scores
        ("llama3", "int4", 130),  # queries in blocks (`PREFILL_QUERY_BLOCK`)
    ],
)
def test_a_fresh_prefill_is_a_prefill_at_slot_0_reading_only_its_own_slots(name, kv_cache, seq):
    # `fresh=True` (what generation's and the server's prefill pass) attends to the prompt's
    # own `seq` slots of a 192-slot cache; its logits and cache are those of a prefill at
    # length 0 attending to every slot, and decoding on from either gives the same logits.
    model = Decoder(DecoderConfig(**BASE, **VARIANTS[name]), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jnp.asarray(np.random.default_rng(seq).integers(0, 64, (2, seq + 1)), jnp.int32)
    cache = dataclasses.replace(model.init_cache(2, 192, kv_cache), start=jnp.array([0, 3]))

    @functools.partial(jax.jit, static_argnums=0)
    def prefill_then_decode(fresh, state, cache):
        m = nnx.merge(graphdef, state)
        logits, cache = m(tokens[:, :seq], cache=cache, fresh=fresh)
        last, cache = m(tokens[:, seq:], cache=cache)
        return logits, last, cache

    # Decided while tracing: the prompt's mask (and so its attention) is `seq` slots wide.
    assert model.layer_inputs((2, seq), cache=cache, fresh=True).full.mask.shape == (2, seq, seq)
    got, want = prefill_then_decode(True, state, cache), prefill_then_decode(False, state, cache)
    # (A quantized cache: a float's last bit may move a code of the next layer's keys.)
    tol = 2e-5 if kv_cache is None else 5e-3
    close = functools.partial(np.testing.assert_allclose, rtol=tol, atol=tol)
    # Row 1's 3 padding tokens see no key (their softmax is uniform over whichever slots are
    # read): they differ, and are never read. Everything else is the same.
    close(np.asarray(got[0])[0], np.asarray(want[0])[0])
    close(np.asarray(got[0])[1, 3:], np.asarray(want[0])[1, 3:])
    close(np.asarray(got[1]), np.asarray(want[1]))
    for a, b in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2]), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.ndim >= 3:  # [rows, heads, slots, ...]: row 0, and row 1 from its start
            a, b = (
                np.concatenate([a[0, :, :], a[1, :, 3:]], 1),
                np.concatenate([b[0, :, :], b[1, :, 3:]], 1),
            )
        close(a.astype(np.float32), b.astype(np.float32))
    assert int(got[2].length) == seq + 1


@pytest.mark.parametrize("name", ["gemma2", "mistral"])
def test_hidden_states_are_what_the_head_reads_and_ignore_right_padding(name):
    # The LM head of the hidden states gives the logits; tokens appended on the right (a
    # padded batch's) leave the positions before them as they were (causal attention).
    model = Decoder(DecoderConfig(**BASE, **VARIANTS[name]), rngs=nnx.Rngs(0))
    hidden_states = compiled(model, "hidden_states")
    hidden = hidden_states(TOKENS)
    assert hidden.shape == (2, 12, BASE["dim"])
    logits = softcap(model.embed.attend(hidden), model.config.final_softcap)
    np.testing.assert_allclose(logits, compiled(model)(TOKENS), atol=1e-5)
    np.testing.assert_allclose(hidden_states(TOKENS[:, :7]), hidden[:, :7], atol=1e-5)


@pytest.mark.parametrize("global_every, local", [(0, True), (2, True), (2, False)])
def test_sliding_window_hides_exactly_the_positions_behind_it(global_every, local):
    # One layer (layer 0): local unless every layer is global. A query at position p sees
    # positions p - window + 1 .. p: changing the token at p - window leaves its output as it
    # was; changing the token at p - window + 1 does not.
    window, p = 4, 9
    n_layers = 1 if local else 2
    config = DecoderConfig(
        **{**BASE, "n_layers": n_layers}, sliding_window=window, global_every=global_every
    )
    model = Decoder(config, rngs=nnx.Rngs(1))
    if not local:
        model.layers = nnx.List([model.layers[1]])  # layer index 0 -> 1: keep one global layer
        model.config = DecoderConfig(**{**BASE, "n_layers": 1})
    base = TOKENS[:1, :10]
    at = lambda i: base.at[0, i].set((base[0, i] + 1) % 64)
    forward = compiled(model)
    out = forward(base)[0, p]
    outside, inside = forward(at(p - window))[0, p], forward(at(p - window + 1))[0, p]
    assert jnp.max(jnp.abs(inside - out)) > 1e-4
    if local:
        np.testing.assert_allclose(outside, out, atol=1e-6)
    else:
        assert jnp.max(jnp.abs(outside - out)) > 1e-4


def _dense_moe_reference(moe, x: np.ndarray) -> np.ndarray:
    """Per token: softmax router, top-k, each chosen expert's gated MLP, weighted sum."""
    c = moe.config
    router = np.asarray(moe.router[...])
    out = np.zeros_like(x)
    silu = lambda v: v / (1 + np.exp(-v))
    for t, row in enumerate(x):
        logits = row @ router
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        chosen = np.argsort(-probs, kind="stable")[: c.n_experts_used]
        weights = probs[chosen] / (probs[chosen].sum() if c.norm_topk else 1.0)
        for e, w in zip(chosen, weights, strict=True):
            g = row @ np.asarray(moe.gate_proj.kernel[...])[e]
            u = row @ np.asarray(moe.up_proj.kernel[...])[e]
            out[t] += w * (silu(g) * u) @ np.asarray(moe.down_proj.kernel[...])[e]
        if c.shared_ffn_dim:
            s = moe.shared
            h = silu(row @ np.asarray(s.gate_proj.kernel[...])) * (
                row @ np.asarray(s.up_proj.kernel[...])
            )
            gate = 1 / (1 + np.exp(-(row @ np.asarray(moe.shared_gate[...]))))
            out[t] += gate[0] * (h @ np.asarray(s.down_proj.kernel[...]))
    return out


@pytest.mark.parametrize("norm_topk, shared", [(True, 0), (False, 24)])
def test_experts_match_a_per_token_reference(norm_topk, shared):
    config = DecoderConfig(
        **BASE,
        n_experts=4,
        n_experts_used=2,
        expert_ffn_dim=16,
        norm_topk=norm_topk,
        shared_ffn_dim=shared,
    )
    moe = Decoder(config, rngs=nnx.Rngs(2)).layers[0].moe
    x = RNG.standard_normal((2, 5, 32)).astype(np.float32)
    got = np.asarray(compiled(moe)(jnp.asarray(x))).reshape(10, 32)
    np.testing.assert_allclose(got, _dense_moe_reference(moe, x.reshape(10, 32)), atol=2e-5)


@pytest.mark.parametrize("recipe", ["int8w", "int4w_g32_asym", "int8"])
def test_quantized_experts_run_through_the_engines_ragged_dot(recipe):
    # Every expert kernel [E, in, out] is quantized and runs as a quantized ragged_dot (no
    # fallback); weight-only, the result is the float model's with the dequantized weights
    # (w8a8 also rounds activations). Routers stay float under the presets.
    config = DecoderConfig(
        **{**BASE, "dim": 64, "head_dim": 16},
        n_experts=4,
        n_experts_used=2,
        expert_ffn_dim=32,
        shared_ffn_dim=32,
        norm_topk=False,
    )
    graphdef, state = nnx.split(Decoder(config, rngs=nnx.Rngs(3)))
    params = nnx.to_pure_dict(state)
    fn = lambda p, t: nnx.merge(graphdef, p)(t)
    q = lowbit.quantize_params(params, recipe)
    assert is_qarray(q["layers"][0]["moe"]["gate_proj"]["kernel"])
    assert not is_qarray(q["layers"][0]["moe"]["router"])
    report = lowbit.EngineReport()
    out = jax.jit(lowbit.run(fn, report=report, strict=True))(q, TOKENS)
    ragged = sum(n for k, n in report.quantized_ops.items() if k.startswith("ragged_dot"))
    assert ragged == 3 * config.n_layers
    dequantized = jax.tree.map(
        lambda v: v.dequantize(jnp.float32) if is_qarray(v) else v, q, is_leaf=is_qarray
    )
    reference = jax.jit(fn)(dequantized, TOKENS)
    if recipe == "int8":
        assert jnp.linalg.norm(out - reference) < 0.05 * jnp.linalg.norm(reference)
    else:
        np.testing.assert_allclose(out, reference, atol=5e-4)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(activation="relu"), "DecoderConfig.activation"),
        (dict(sliding_window=0), "DecoderConfig.sliding_window"),
        (dict(rope_freq_factors=(1.0,)), "DecoderConfig.rope_freq_factors"),
        (dict(n_experts=4, n_experts_used=5, expert_ffn_dim=8), "n_experts_used"),
        (dict(n_heads=3), "DecoderConfig.n_heads"),
        (dict(rope_base=float("nan")), "DecoderConfig.rope_base"),
        (dict(attn_softcap=-1.0), "DecoderConfig.attn_softcap"),
    ],
)
def test_config_refuses_out_of_range_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        DecoderConfig(**{**BASE, **fields})


@pytest.mark.parametrize(
    ("seq", "slots", "window", "cap", "first_slot"),
    [
        (256, 256, None, None, 0),  # no cache: keys are the queries' own tokens
        (200, 272, None, 50.0, 69),  # a cache with room after the prompt; Gemma 2's soft cap
        (130, 300, 48, None, 167),  # a sliding window; a last block of 2 queries
        (200, 272, None, None, 0),  # a prompt at slot 0 with room after it
        (100, 192, 48, None, 0),  # ... one block of queries, a sliding window
    ],
)
def test_blocked_prefill_attention_equals_attending_every_slot(seq, slots, window, cap, first_slot):
    from lowbit.models import _attention

    rng = np.random.default_rng(seq)
    b, h, g, d = 2, 2, 3, 16
    q = jnp.asarray(rng.standard_normal((b, seq, h, g, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, h, slots, d)), jnp.float32) for _ in range(2))
    # The prompt at the cache's slots first_slot .. first_slot + seq - 1, or at 0 .. seq - 1
    # without a cache; row 1 left-padded by 5.
    offsets = first_slot + np.arange(seq)
    key_slots = np.arange(slots)
    mask = key_slots[None, :] <= offsets[:, None]
    if window is not None:
        mask &= key_slots[None, :] > offsets[:, None] - window
    start = np.array([first_slot, first_slot + 5])
    mask = jnp.asarray(mask[None] & (key_slots[None, None, :] >= start[:, None, None]))
    scale = jnp.float32(d**-0.5)
    attend = functools.partial(_attention.causal_attention, scale=scale, cap=cap)
    blocked = jax.jit(attend)(q, k, v, mask)
    every = _attention.softmax_values(_attention.attention_scores(q, k), v, mask, scale, cap)
    # Padding queries see no key (a uniform softmax over whichever keys are read): their
    # outputs are never read, so only queries with a visible key are compared.
    seen = np.asarray(mask.any(-1))  # [b, seq]
    assert not seen.all()
    np.testing.assert_allclose(
        np.asarray(blocked)[seen], np.asarray(every)[seen], rtol=1e-5, atol=1e-6
    )
