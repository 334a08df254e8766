"""One float decoder-only language model for every common architecture, in Flax NNX.

Llama 1/2/3, Mistral, Qwen2/2.5/3, Gemma 1/2/3, Phi-3 and the mixture-of-experts decoders
(Mixtral, Qwen2-MoE, Qwen3-MoE) differ in a handful of choices, each a field of
`DecoderConfig`: biases on q/k/v, RMSNorm on q and k, norms after each sub-block, the MLP's
activation, a scaled embedding, sliding-window layers with their own RoPE base, RoPE scaling,
soft-capped attention and logits, and experts in place of the MLP. The loaders
(`_decoder_gguf`, `_decoder_hf`) map each file's layout onto this one module; fused
projections (Phi-3's qkv and gate_up) are split there, and norm weights are stored as the
factor they multiply by (Gemma's ``1 + w`` is added on load).

Written so that a quantization engine that swaps weight arrays for quantized values can run it
unchanged: every weight is read through a standard `flax.nnx` layer (`Embed`, `Linear`,
`RMSNorm`) or, for experts, one `jax.lax.ragged_dot` per projection, the forward pass is plain
`jnp` code with no Python-side look at weight values and no mutation, and the KV cache is an
explicit pytree passed in and returned.

Projection weights are in the Hugging Face layout: the rotary embedding is the "rotate half"
form, pairing feature `i` of each head with feature `i + head_dim / 2`. (llama.cpp stores the
query/key rows of its ``llama`` architecture interleaved instead; the GGUF loader undoes that.)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from lowbit.models._abstract import LayerStack
from lowbit.models._attention import (
    causal_attention,
    decode_attention,
    decode_block,
    softcap,
    softmax_values,
)
from lowbit.models._batch_invariant import RMSNorm, separately
from lowbit.models._decoder_config import DecoderConfig
from lowbit.models._kv_cache import KVCache, LayerKV, int8_scores
from lowbit.models._kv_cache import init_kv_cache as _init_cache
from lowbit.recipes import KVCacheConfig


def init_kv_cache(
    config: DecoderConfig,
    batch: int,
    max_len: int,
    dtype: Any,
    kv_cache: KVCacheConfig | str | None = None,
) -> KVCache:
    """An empty cache for `batch` sequences of up to `max_len` tokens.

    `kv_cache`: a `KVCacheConfig` (or ``"int8"``, ``"int4"``, ``"fp8"``) for a quantized cache;
    None for a float one in `dtype`.
    """
    return _init_cache(
        config.n_layers, config.n_kv_heads, config.head_dim, batch, max_len, dtype, kv_cache
    )


def rope_tables(
    positions: jax.Array,
    head_dim: int,
    base: float,
    *,
    scale: float = 1.0,
    freq_factors: tuple[float, ...] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the rotary angles: each ``[batch, seq, head_dim]`` float32.

    positions: ``[batch, seq]`` int. `scale` divides the positions (linear scaling);
    `freq_factors` (``head_dim / 2``) divide the frequencies (Llama 3's scaling).
    """
    inv_freq = 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if freq_factors is not None:
        inv_freq = inv_freq / jnp.asarray(freq_factors, jnp.float32)
    angles = (positions.astype(jnp.float32) / scale)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    # Computed once: fused into each layer's rotation instead, XLA recomputed every sine and
    # cosine per layer and head (4% of a prefill of SmolLM2 on 2 AVX-512 cores).
    return jax.lax.optimization_barrier((jnp.cos(angles), jnp.sin(angles)))


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half rotary embedding. x: ``[batch, seq, heads, head_dim]``; cos/sin as above."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    # Both products rounded before the add: FMA-contracting one of them into it would depend on
    # XLA's fusions, and so on the batch size (`_batch_invariant`).
    straight, turned = separately(x.astype(jnp.float32) * cos, rotated.astype(jnp.float32) * sin)
    return (straight + turned).astype(x.dtype)


class LayerView(NamedTuple):
    """Where one layer's tokens sit: what it reads besides the hidden states and its cache.

    Attributes:
      cos, sin: rotary tables ``[batch, seq, head_dim // 2]``.
      mask: ``[batch, seq, keys]`` bool, True where a query attends: ``keys`` is the cache's
        slots, or `seq` for tokens that start a new cache (`Decoder.__call__`'s ``fresh``),
        or without a cache.
      first: ``int32 [batch]``, the first slot a decoded token may see (its row's start, or
        later under a sliding window).
      slot: int32 [] cache slot the tokens are written at, or None without a cache.
    """

    cos: jax.Array
    sin: jax.Array
    mask: jax.Array
    first: jax.Array
    slot: jax.Array | None


# Up to this many tokens on some rows run their decode-attention calls unrolled (a speculative
# check's K + 1); more (a draft model's window of 16 to 64 prompt tokens) run them as a loop.
# Unrolled, a program grows with the tokens: SmolLM2's 64-token draft window compiled in 60 s
# (about 5 s as a loop). As a loop a SmolLM2 check of 5 tokens ran 10-20% slower (118-123 ms
# against 101-110 unrolled): a window fed once per prompt can afford that, a check run every
# step cannot.
UNROLLED_TOKENS = 8


def _tokens_on_rows(
    q: jax.Array, kv: LayerKV, at: LayerView, block: int, cap: float | None
) -> tuple[jax.Array, LayerKV]:
    """`decode_attention` for each of ``q [b, s, H, group, D]``'s tokens, token ``j`` at
    slot ``at.slot + j``; the output ``[b, s, H, group, D]`` float32 and the cache."""
    s = q.shape[1]
    if s == 1:
        return decode_attention(q, kv, at.slot, block, at.first, cap), kv

    def first(seen: jax.Array) -> jax.Array:  # [b, slots] -> [b]
        return jnp.argmax(seen, axis=-1).astype(jnp.int32)

    if s <= UNROLLED_TOKENS:
        outs = [
            decode_attention(q[:, j : j + 1], kv, at.slot + j, block, first(at.mask[:, j]), cap)
            for j in range(s)
        ]
        return jnp.concatenate(outs, axis=1), kv
    # The cache rides in the loop's carry, unchanged, and the loop's copy is the one used
    # after it (read from outside the loop instead, one SmolLM2 check ran 179 ms against 128).
    buffers = ("keys", "values", "key_scales", "value_scales", "key_offsets")

    def one(j: jax.Array, carry: tuple) -> tuple:
        out, arrays = carry
        seen = jax.lax.dynamic_index_in_dim(at.mask, j, 1, keepdims=False)
        q_j = jax.lax.dynamic_slice_in_dim(q, j, 1, axis=1)
        at_j = dataclasses.replace(kv, **dict(zip(buffers, arrays, strict=True)))
        o = decode_attention(q_j, at_j, at.slot + j, block, first(seen), cap)
        return jax.lax.dynamic_update_slice_in_dim(out, o, j, axis=1), arrays

    arrays = tuple(getattr(kv, name) for name in buffers)
    out, arrays = jax.lax.fori_loop(0, s, one, (jnp.zeros(q.shape, jnp.float32), arrays))
    return out, dataclasses.replace(kv, **dict(zip(buffers, arrays, strict=True)))


class Attention(nnx.Module):
    """Grouped-query self-attention with rotary positions (optionally q/k biases and norms)."""

    def __init__(self, config: DecoderConfig, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
        self.config = config
        c = config
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        if c.fused_qkv:
            self.qkv_proj = nnx.Linear(c.dim, q_dim + 2 * kv_dim, use_bias=c.qkv_bias, **kw)
        else:
            self.q_proj = nnx.Linear(c.dim, q_dim, use_bias=c.qkv_bias, **kw)
            self.k_proj = nnx.Linear(c.dim, kv_dim, use_bias=c.qkv_bias, **kw)
            self.v_proj = nnx.Linear(c.dim, kv_dim, use_bias=c.qkv_bias, **kw)
        self.o_proj = nnx.Linear(c.n_heads * c.head_dim, c.dim, use_bias=False, **kw)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, epsilon=c.norm_eps, **kw)
            self.k_norm = RMSNorm(c.head_dim, epsilon=c.norm_eps, **kw)

    def __call__(
        self, x: jax.Array, at: LayerView, kv: LayerKV | None
    ) -> tuple[jax.Array, LayerKV | None]:
        """x: ``[batch, seq, dim]``; `at` says where the tokens sit (`LayerView`).

        With a cache (`kv`, and `at.slot`), the new keys/values are written at that slot and
        attention reads them back from the cache (so a quantized cache's rounding is what
        attention sees); one decoded token per row reads only the blocks from `at.first` up to
        its slot (`decode_attention`), longer inputs the first ``at.mask.shape[-1]`` slots
        under `at.mask` (every slot, or a new cache's first `seq`). The updated layer cache is
        returned.
        """
        c = self.config
        b, s, _ = x.shape
        slot, mask = at.slot, at.mask
        if c.fused_qkv:
            q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
            q, k, v = jnp.split(self.qkv_proj(x), (q_dim, q_dim + kv_dim), axis=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(b, s, c.n_heads, c.head_dim)
        k = k.reshape(b, s, c.n_kv_heads, c.head_dim)
        v = v.reshape(b, s, c.n_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, at.cos, at.sin)
        k = apply_rope(k, at.cos, at.sin)
        group = c.n_heads // c.n_kv_heads
        scale = jnp.float32(c.attn_scale)
        # Query head h uses key/value head h // group, as in Hugging Face's repeat_kv.
        q = q.reshape(b, s, c.n_kv_heads, group, c.head_dim)
        block = None if kv is None else decode_block(kv.keys.shape[2])
        if block is not None and (s == 1 or kv.rows is not None):
            kv = kv.write(k, v, slot)
            q = kv.rotate(q) * scale.astype(q.dtype)
            # Several tokens on some rows in place (a speculative check, or a draft model fed
            # a window): one decode-attention call per token, each up to its own slot, from
            # the first slot its mask shows (the row's start, or later on a sliding-window
            # layer).
            out, kv = _tokens_on_rows(q, kv, at, block, c.attn_softcap)
            out = kv.unrotate(out.astype(x.dtype))
            out = out.reshape(b, s, c.n_heads * c.head_dim)
            return self.o_proj(out), kv
        if kv is not None and kv.rows is not None:
            raise ValueError(
                f"a KV cache with rows (decoding some of its {kv.keys.shape[0]} rows in place) "
                "needs a cache of a multiple of 32 slots, at least 64; got "
                f"{kv.keys.shape[2]} slots. Run the whole cache (rows=None) instead"
            )
        if kv is not None:
            kv = kv.write(k, v, slot)
            q = kv.rotate(q)  # a rotated cache: scores are the same with rotated queries
            # The slots these queries may see: every one, or a new cache's own (`fresh`).
            width = mask.shape[-1]
            seen = kv if width == kv.keys.shape[2] else kv.slots(jnp.int32(0), width)
            v = seen.read_values(x.dtype)
            if kv.config is not None and kv.config.integer_qk:
                scores = int8_scores(q, seen)
                out = softmax_values(scores, v, mask, scale, c.attn_softcap)
            else:
                keys = seen.read_keys(q.dtype)
                out = causal_attention(q, keys, v, mask, scale, c.attn_softcap)
        else:
            k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
            out = causal_attention(q, k.astype(q.dtype), v, mask, scale, c.attn_softcap)
        if kv is not None:
            out = kv.unrotate(out)  # back from rotated values
        out = out.reshape(b, s, c.n_heads * c.head_dim)
        return self.o_proj(out), kv


def _activation(name: str, x: jax.Array) -> jax.Array:
    return jax.nn.silu(x) if name == "silu" else jax.nn.gelu(x, approximate=True)


class MLP(nnx.Module):
    """Gated feed-forward: ``down(act(gate(x)) * up(x))`` (SwiGLU or GeGLU)."""

    def __init__(
        self,
        config: DecoderConfig,
        *,
        dtype: Any,
        param_dtype: Any,
        rngs: nnx.Rngs,
        ffn_dim: int | None = None,
    ):
        self.activation = config.activation
        ffn = config.ffn_dim if ffn_dim is None else ffn_dim
        kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if config.fused_gate_up:
            self.gate_up_proj = nnx.Linear(config.dim, 2 * ffn, **kw)
        else:
            self.gate_proj = nnx.Linear(config.dim, ffn, **kw)
            self.up_proj = nnx.Linear(config.dim, ffn, **kw)
        self.down_proj = nnx.Linear(ffn, config.dim, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: ``[batch, seq, dim]`` -> ``[batch, seq, dim]``."""
        if hasattr(self, "gate_up_proj"):
            gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(_activation(self.activation, gate) * up)


class ExpertLinear(nnx.Module):
    """One projection of every expert: ``kernel [n_experts, in, out]``, applied to rows grouped
    by expert with `jax.lax.ragged_dot` (so a quantized kernel takes the engine's quantized
    ``ragged_dot``)."""

    def __init__(
        self, n: int, d_in: int, d_out: int, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs
    ):
        init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))
        self.kernel = nnx.Param(init(rngs.params(), (n, d_in, d_out), param_dtype))
        self.dtype = dtype

    def __call__(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """x: ``[rows, in]`` sorted by expert, `group_sizes` ``[n_experts]`` -> ``[rows, out]``."""
        kernel = self.kernel[...]
        return jax.lax.ragged_dot(x.astype(self.dtype), kernel, group_sizes).astype(self.dtype)


class MoE(nnx.Module):
    """Top-k routed experts (gated MLPs), plus an optional shared expert with a sigmoid gate.

    The router's softmax runs over all experts in float32; the `n_experts_used` best are
    kept (renormalized when `norm_topk`). Each (token, expert) pair becomes one row; rows are
    sorted by expert so that each projection is one `ragged_dot` over all experts.

    The router (``router`` ``[dim, n_experts]``) and the shared expert's gate (``shared_gate``
    ``[dim, 1]``) are plain params, not ``kernel``s: the presets, which quantize every
    ``kernel``, leave them in float, as llama.cpp's mixes do. A flipped choice of expert costs
    more than the few bytes they take. Select them by path to quantize them anyway.
    """

    def __init__(self, config: DecoderConfig, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
        c = config
        self.config = config
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.dtype = dtype
        init = nnx.initializers.lecun_normal()
        self.router = nnx.Param(init(rngs.params(), (c.dim, c.n_experts), param_dtype))
        self.gate_proj = ExpertLinear(c.n_experts, c.dim, c.expert_ffn_dim, **kw)
        self.up_proj = ExpertLinear(c.n_experts, c.dim, c.expert_ffn_dim, **kw)
        self.down_proj = ExpertLinear(c.n_experts, c.expert_ffn_dim, c.dim, **kw)
        if c.shared_ffn_dim:
            self.shared = MLP(c, **kw, ffn_dim=c.shared_ffn_dim)
            self.shared_gate = nnx.Param(init(rngs.params(), (c.dim, 1), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: ``[batch, seq, dim]`` -> ``[batch, seq, dim]``."""
        c = self.config
        b, s, d = x.shape
        flat = x.reshape(b * s, d)
        flat = flat.astype(self.dtype)
        probs = jax.nn.softmax((flat @ self.router[...]).astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, c.n_experts_used)  # [T, k]
        if c.norm_topk:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        order = jnp.argsort(experts.reshape(-1), stable=True)  # [T * k]
        token = order // c.n_experts_used
        sizes = jnp.bincount(experts.reshape(-1), length=c.n_experts).astype(jnp.int32)
        rows = flat[token]
        h = _activation(c.activation, self.gate_proj(rows, sizes)) * self.up_proj(rows, sizes)
        out = self.down_proj(h, sizes).astype(jnp.float32)
        out = out * weights.reshape(-1)[order][:, None]
        y = jnp.zeros((b * s, d), jnp.float32).at[token].add(out)
        if c.shared_ffn_dim:
            gate = jax.nn.sigmoid((flat @ self.shared_gate[...]).astype(jnp.float32))
            y = y + gate * self.shared(flat[None])[0].astype(jnp.float32)
        return y.reshape(b, s, d).astype(x.dtype)


class Block(nnx.Module):
    """Pre-norm decoder layer: attention then MLP (or experts), each with a residual
    connection; with `post_norms` each sub-block's output is normalized before the add."""

    def __init__(self, config: DecoderConfig, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = lambda: RMSNorm(config.dim, epsilon=config.norm_eps, **kw)
        self.attn_norm = norm()
        self.attn = Attention(config, **kw)
        self.mlp_norm = norm()
        if config.n_experts:
            self.moe = MoE(config, **kw)
        else:
            self.mlp = MLP(config, **kw)
        if config.post_norms:
            self.post_attn_norm = norm()
            self.post_mlp_norm = norm()

    def __call__(
        self, x: jax.Array, at: LayerView, kv: LayerKV | None
    ) -> tuple[jax.Array, LayerKV | None]:
        """x: ``[batch, seq, dim]``; the other arguments and the result as in `Attention`."""
        h, new_kv = self.attn(self.attn_norm(x), at, kv)
        if hasattr(self, "post_attn_norm"):
            # The norm ends in a product: rounded before the residual add, at any batch.
            (h,) = separately(self.post_attn_norm(h))
        x = x + h
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        h = ffn(self.mlp_norm(x))
        if hasattr(self, "post_mlp_norm"):
            (h,) = separately(self.post_mlp_norm(h))
        return x + h, new_kv


class LayerInputs(NamedTuple):
    """What the layers read besides the hidden states (`Decoder.layer_inputs`).

    Attributes:
      full: the `LayerView` of global layers.
      local: the `LayerView` of sliding-window layers (their own rotary base, window mask and
        first visible slot), or None without a sliding window.
    """

    full: LayerView
    local: LayerView | None = None

    def of(self, config: DecoderConfig, i: int) -> LayerView:
        """What layer `i` reads."""
        return self.local if config.is_local(i) else self.full


class Decoder(LayerStack):
    """A decoder-only language model (`DecoderConfig` says which architecture).

    Parameter paths read like ``layers/3/attn/q_proj/kernel``; kernels are
    ``[in_features, out_features]`` (experts ``layers/i/moe/gate_proj/kernel``
    ``[n_experts, in, out]``); the token embedding ``embed/embedding`` is ``[vocab, dim]`` and,
    with tied embeddings, also produces the logits (`Embed.attend`).
    """

    Layer = Block

    def build_input(self, config: DecoderConfig, **kw: Any) -> None:
        self.embed = nnx.Embed(config.vocab_size, config.dim, **kw)

    def build_output(self, config: DecoderConfig, **kw: Any) -> None:
        self.norm = RMSNorm(config.dim, epsilon=config.norm_eps, **kw)
        if not config.tie_embeddings:
            self.lm_head = nnx.Linear(config.dim, config.vocab_size, use_bias=False, **kw)

    def init_cache(
        self, batch: int, max_len: int, kv_cache: KVCacheConfig | str | None = None
    ) -> KVCache:
        """An empty KV cache for `batch` sequences of up to `max_len` tokens (see
        `init_kv_cache`; `kv_cache` picks a quantized cache)."""
        return init_kv_cache(self.config, batch, max_len, self.dtype, kv_cache)

    def _rope(self, positions: jax.Array, local: bool) -> tuple[jax.Array, jax.Array]:
        c = self.config
        if local and c.rope_base_local is not None:
            return rope_tables(positions, c.head_dim, c.rope_base_local)
        return rope_tables(
            positions,
            c.head_dim,
            c.rope_base,
            scale=c.rope_scale,
            freq_factors=c.rope_freq_factors,
        )

    def layer_inputs(
        self,
        shape: tuple[int, int],
        *,
        positions: jax.Array | None = None,
        cache: KVCache | None = None,
        fresh: bool = False,
    ) -> LayerInputs:
        """What every layer reads besides the hidden states, for tokens of ``shape``
        ``(batch, seq)``: rotary tables and masks (arguments as in `__call__`)."""
        c = self.config
        b, s = shape
        if cache is None:
            slot = None
            offsets = jnp.arange(s, dtype=jnp.int32)
            key_slots = offsets
            first = jnp.zeros((b,), jnp.int32)
        else:
            slot = jnp.zeros((), jnp.int32) if fresh else cache.length
            offsets = slot + jnp.arange(s, dtype=jnp.int32)
            # A new cache's tokens see only each other: the mask (and attention) is `s` wide.
            key_slots = offsets if fresh else jnp.arange(cache.max_len, dtype=jnp.int32)
            first = cache.start if cache.rows is None else cache.start[cache.rows]
        if positions is None:
            positions = jnp.maximum(offsets[None, :] - first[:, None], 0)
        positions = jnp.broadcast_to(positions, (b, s))
        # Causal in slot order: a query sees keys in slots up to its own, none before its row's
        # first real slot; a local layer's query also none `sliding_window` or more behind it.
        causal = key_slots[None, :] <= offsets[:, None]
        mask = causal[None] & (key_slots[None, None, :] >= first[:, None, None])
        full = LayerView(*self._rope(positions, False), mask, first, slot)
        if c.sliding_window is None:
            return LayerInputs(full)
        near = key_slots[None, :] > offsets[:, None] - c.sliding_window
        local_first = first if slot is None else jnp.maximum(first, slot - c.sliding_window + 1)
        local = LayerView(*self._rope(positions, True), mask & near[None], local_first, slot)
        return LayerInputs(full, local)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """``tokens [batch, seq]`` -> the first layer's input ``[batch, seq, dim]``."""
        x = self.embed(tokens)
        if self.config.embed_scale:
            # Gemma multiplies by sqrt(dim) rounded to the activation dtype; the product is
            # rounded before the first residual add, at any batch (no FMA across it).
            (x,) = separately(x * jnp.asarray(math.sqrt(self.config.dim), x.dtype))
        return x

    def head(self, x: jax.Array) -> jax.Array:
        """The last layer's output ``[batch, seq, dim]`` -> logits ``[batch, seq, vocab]``."""
        c = self.config
        x = self.norm(x)
        logits = self.embed.attend(x) if c.tie_embeddings else self.lm_head(x)
        return softcap(logits, c.final_softcap)

    def __call__(
        self,
        tokens: jax.Array,
        *,
        positions: jax.Array | None = None,
        cache: KVCache | None = None,
        last_only: bool = False,
        fresh: bool = False,
    ) -> jax.Array | tuple[jax.Array, KVCache]:
        """Next-token logits.

        Args:
          tokens: ``[batch, seq]`` int32.
          positions: ``[batch, seq]`` or ``[seq]`` int rotary positions; by default
            ``0..seq-1``, or, with a cache, each token's slot minus its row's ``cache.start``.
          cache: a `KVCache`; the tokens are written at slot ``cache.length`` and may attend
            to every slot from their row's ``cache.start`` up to their own (within the
            sliding window on local layers). It must have room for them: writes past
            ``max_len`` are clipped by XLA and silently wrong.
          last_only: logits of the last position only, ``[batch, 1, vocab]`` (what generation
            samples from): the output projection then runs on one row per sequence instead
            of `seq` (a kernel call cannot be sliced after the fact).
          fresh: the tokens start `cache` (a prefill into a new cache): they are written at
            slot 0, whatever ``cache.length`` says, and attend to each other only, so
            attention reads `seq` key slots instead of ``cache.max_len``. The result is that
            of ``fresh=False`` on a cache of length 0; a static argument, so that a prefill
            program knows it at trace time.

        Returns:
          ``logits [batch, seq, vocab]`` without a cache; ``(logits, new_cache)`` with one.
        """
        inputs = self.layer_inputs(tokens.shape, positions=positions, cache=cache, fresh=fresh)
        x, layers_out = self._layers(self.embed_tokens(tokens), inputs, cache)
        logits = self.head(x[:, -1:] if last_only else x)
        if cache is None:
            return logits
        quantized = cache.quantized
        new_cache = dataclasses.replace(
            cache,
            keys=tuple(kv.keys for kv in layers_out),
            values=tuple(kv.values for kv in layers_out),
            key_scales=tuple(kv.key_scales for kv in layers_out) if quantized else (),
            value_scales=tuple(kv.value_scales for kv in layers_out) if quantized else (),
            key_offsets=tuple(kv.key_offsets for kv in layers_out) if quantized else (),
            length=inputs.full.slot + tokens.shape[1],
        )
        return logits, new_cache

    def _layers(
        self, x: jax.Array, inputs: LayerInputs, cache: KVCache | None
    ) -> tuple[jax.Array, list[LayerKV | None]]:
        """Every layer over ``x [batch, seq, dim]``; returns the last one's output and each
        layer's new cache (None entries without a cache)."""
        layers_out = []
        for i, layer in enumerate(self.layers):
            kv = None if cache is None else cache.layer(i)
            x, new_kv = layer(x, inputs.of(self.config, i), kv)
            layers_out.append(new_kv)
        return x, layers_out

    def hidden_states(self, tokens: jax.Array) -> jax.Array:
        """The final norm's output ``[batch, seq, dim]`` for ``tokens [batch, seq]`` int32:
        what the LM head reads (no cache; positions ``0..seq-1``).

        Attention is causal, so tokens appended on the right (padding) change nothing at the
        positions before them: a right-padded batch gives each row its own hidden states
        (up to float rounding), which is how sentence embeddings of a batch are taken."""
        inputs = self.layer_inputs(tokens.shape)
        x, _ = self._layers(self.embed_tokens(tokens), inputs, None)
        return self.norm(x)

    def decode_step(self, tokens: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Append `tokens` (``[batch, seq]``, usually seq 1) to `cache`.

        Returns ``(logits [batch, seq, vocab], new_cache)``; the input cache is not modified.
        """
        return self(tokens, cache=cache)
