"""A plain float Llama decoder (SmolLM2 family) in Flax NNX.

Written so that a quantization engine that swaps weight arrays for quantized values can run it
unchanged: every weight is read through a standard `flax.nnx` layer (`Embed`, `Linear`,
`RMSNorm`), the forward pass is plain `jnp` code with no Python-side look at weight values and
no mutation, and the KV cache is an explicit pytree passed in and returned.

Projection weights are in the Hugging Face layout: the rotary embedding is the "rotate half"
form, pairing feature `i` of each head with feature `i + head_dim / 2`. (GGUF files store the
query/key rows interleaved instead; the GGUF loader undoes that permutation.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from lowbit import kernels
from lowbit.models._abstract import abstract_stack
from lowbit.models._kv_cache import KVCache, LayerKV, fp8_codes, int8_scores
from lowbit.models._kv_cache import init_kv_cache as _init_cache
from lowbit.recipes import KVCacheConfig


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape hyper-parameters of a Llama decoder; defaults are SmolLM2-135M's."""

    vocab_size: int = 49152
    dim: int = 576
    n_layers: int = 30
    n_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    ffn_dim: int = 1536
    rope_base: float = 100000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    context_length: int = 8192

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")


def init_kv_cache(
    config: LlamaConfig,
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


def rope_tables(positions: jax.Array, head_dim: int, base: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the rotary angles: each ``[batch, seq, head_dim]`` float32.

    positions: ``[batch, seq]`` int.
    """
    inv_freq = 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half rotary embedding. x: ``[batch, seq, heads, head_dim]``; cos/sin as above."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    out = x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
    return out.astype(x.dtype)


def _scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """q ``[b, s, H, g, D]``, k ``[b, H, T, D]`` -> ``[b, H, g, s, T]``.

    One query per row (decode) multiplies and sums in one fused loop that reads the cache in
    its stored layout: as a dot, XLA's CPU backend copies every layer's keys to another layout
    on every step, which at long contexts costs more than the weights.
    """
    if q.shape[1] == 1:
        return jnp.sum(q[:, 0, :, :, None, :] * k[:, :, None], axis=-1)[:, :, :, None]
    return jnp.einsum("bskgd,bktd->bkgst", q, k)


def _weighted_values(probs: jax.Array, v: jax.Array) -> jax.Array:
    """probs ``[b, H, g, s, T]``, v ``[b, H, T, D]`` -> ``[b, s, H, g, D]`` (as `_scores`)."""
    if probs.shape[3] == 1:
        return jnp.sum(probs[:, :, :, 0, :, None] * v[:, :, None], axis=3)[:, None]
    return jnp.einsum("bkgst,bktd->bskgd", probs, v)


# Decode attention reads the cache in blocks of this many slots (or the largest power of two
# below it that divides the cache length), and only the blocks up to the current token.
DECODE_BLOCK = 128


def decode_block(max_len: int) -> int | None:
    """Slots per block for `_decode_attention` on a cache of `max_len` slots, or None when no
    power of two from 32 to `DECODE_BLOCK` divides it (attention then reads every slot)."""
    block = DECODE_BLOCK
    while block >= 32:
        if max_len % block == 0 and max_len > block:
            return block
        block //= 2
    return None


def _fused_decode(q: jax.Array, kv: LayerKV) -> bool:
    """Whether a decode step runs as one CPU kernel call (`lowbit.kernels.decode_attention`):
    float32 queries and a float32 cache, or an int8 / int4 / fp8 one (read by dequantizing,
    or for `integer_qk` by int8 products), with the kernels built, where the step is
    lowered for CPU. On XLA:CPU the block loop below costs mostly per-op dispatch (about
    150 us a layer for SmolLM2 at 576 filled slots, against 30 us for the kernel)."""
    f32 = jnp.dtype(jnp.float32)
    cache_ok = kv.config is not None or (
        jnp.dtype(kv.keys.dtype) == f32 and jnp.dtype(kv.values.dtype) == f32
    )
    return cache_ok and jnp.dtype(q.dtype) == f32 and kernels.available()


def _decode_attention(q: jax.Array, kv: LayerKV, slot: jax.Array, block: int) -> jax.Array:
    """One query per row attending to cache slots ``start .. slot`` only.

    The cost follows the filled length, not the cache's size: a loop over blocks of `block`
    slots up to the one holding `slot`, with a running (online) softmax, so a long cache
    barely filled costs one block; only those blocks of a quantized cache are dequantized.

    Args:
      q: ``[batch, 1, H, group, D]`` queries, already scaled by ``1 / sqrt(D)`` and rotated
        like the cache.
      kv: the layer cache after this token was written at `slot`.
      slot: ``int32 []``, the query's slot.
      block: slots per block, dividing the cache length.
    Returns:
      ``[batch, 1, H, group, D]`` float32.
    """
    if not _fused_decode(q, kv):
        return _block_loop(q, kv, slot, block)

    def fused(q, kv, slot):
        fp8 = kv.config is not None and kv.config.format == "fp8"
        out = kernels.decode_attention(
            q[:, 0],
            fp8_codes(kv.keys) if fp8 else kv.keys,
            fp8_codes(kv.values) if fp8 else kv.values,
            kv.start,
            slot,
            kv.key_scales,
            kv.value_scales,
            integer_qk=kv.config is not None and kv.config.integer_qk,
        )
        return out[:, None]

    # The kernel where the step is lowered for CPU; the block loop on GPU / TPU. (The cache
    # is closed over: a LayerKV is not a pytree.)
    return jax.lax.platform_dependent(
        q,
        slot,
        cpu=lambda q, slot: fused(q, kv, slot),
        default=lambda q, slot: _block_loop(q, kv, slot, block),
    )


def _block_loop(q: jax.Array, kv: LayerKV, slot: jax.Array, block: int) -> jax.Array:
    """`_decode_attention` as a loop of XLA ops over the filled blocks (any platform)."""
    b, _, h, g, d = q.shape
    integer = kv.config is not None and kv.config.integer_qk

    def step(i, state):
        m, total, acc = state  # [b, H, g, 1], [b, H, g, 1], [b, H, g, D]
        first = i * block
        part = kv.slots(first, block)
        if integer:
            scores = int8_scores(q, part)
        else:
            scores = _scores(q, part.read_keys(q.dtype))
        scores = scores[:, :, :, 0].astype(jnp.float32)  # [b, H, g, block]
        t = first + jnp.arange(block, dtype=jnp.int32)
        valid = (t[None, :] >= kv.start[:, None]) & (t[None, :] <= slot)  # [b, block]
        valid = valid[:, None, None, :]
        scores = jnp.where(valid, scores, jnp.finfo(jnp.float32).min)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1, keepdims=True))
        p = jnp.where(valid, jnp.exp(scores - m_new), 0.0)
        carry = jnp.exp(m - m_new)
        values = part.read_values(jnp.float32)  # [b, H, block, D]
        pv = jnp.sum(p[..., None] * values[:, :, None], axis=3)  # [b, H, g, D]
        return m_new, total * carry + jnp.sum(p, axis=-1, keepdims=True), acc * carry + pv

    init = (
        jnp.full((b, h, g, 1), jnp.finfo(jnp.float32).min, jnp.float32),
        jnp.zeros((b, h, g, 1), jnp.float32),
        jnp.zeros((b, h, g, d), jnp.float32),
    )
    _, total, acc = jax.lax.fori_loop(0, slot // block + 1, step, init)
    return (acc / total)[:, None]


class Attention(nnx.Module):
    """Grouped-query self-attention with rotary positions."""

    def __init__(self, config: LlamaConfig, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
        self.config = config
        c = config
        kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = nnx.Linear(c.dim, c.n_heads * c.head_dim, **kw)
        self.k_proj = nnx.Linear(c.dim, c.n_kv_heads * c.head_dim, **kw)
        self.v_proj = nnx.Linear(c.dim, c.n_kv_heads * c.head_dim, **kw)
        self.o_proj = nnx.Linear(c.n_heads * c.head_dim, c.dim, **kw)

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        mask: jax.Array,
        kv: LayerKV | None,
        slot: jax.Array | None,
    ) -> tuple[jax.Array, LayerKV | None]:
        """x: ``[batch, seq, dim]``; mask: ``[batch, seq, keys]`` bool, True where attending.

        With a cache (`kv` and `slot`), the new keys/values are written at `slot` and attention
        reads them back from the cache (so a quantized cache's rounding is what attention
        sees); one decoded token per row reads only the blocks up to its slot
        (`_decode_attention`), longer inputs every slot under `mask`. The updated layer cache
        is returned.
        """
        c = self.config
        b, s, _ = x.shape
        q = self.q_proj(x).reshape(b, s, c.n_heads, c.head_dim)
        k = self.k_proj(x).reshape(b, s, c.n_kv_heads, c.head_dim)
        v = self.v_proj(x).reshape(b, s, c.n_kv_heads, c.head_dim)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        group = c.n_heads // c.n_kv_heads
        # Query head h uses key/value head h // group, as in Hugging Face's repeat_kv.
        q = q.reshape(b, s, c.n_kv_heads, group, c.head_dim)
        if kv is not None and s == 1 and decode_block(kv.keys.shape[2]) is not None:
            kv = kv.write(k, v, slot)
            q = kv.rotate(q) / jnp.sqrt(jnp.float32(c.head_dim)).astype(q.dtype)
            out = _decode_attention(q, kv, slot, decode_block(kv.keys.shape[2]))
            out = kv.rotate(out.astype(x.dtype))
            out = out.reshape(b, s, c.n_heads * c.head_dim)
            return self.o_proj(out), kv
        if kv is not None:
            kv = kv.write(k, v, slot)
            q = kv.rotate(q)  # a rotated cache: scores are the same with rotated queries
            if kv.config is not None and kv.config.integer_qk:
                scores = int8_scores(q, kv)
            else:
                scores = _scores(q, kv.read_keys(q.dtype))
            v = kv.read_values(x.dtype)
        else:
            k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
            scores = _scores(q, k.astype(q.dtype))
        scores = scores.astype(jnp.float32) / jnp.sqrt(jnp.float32(c.head_dim))
        scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        out = _weighted_values(probs, v.astype(x.dtype))
        if kv is not None:
            out = kv.rotate(out)  # back from rotated values (the rotation is its own inverse)
        out = out.reshape(b, s, c.n_heads * c.head_dim)
        return self.o_proj(out), kv


class MLP(nnx.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
        kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_proj = nnx.Linear(config.dim, config.ffn_dim, **kw)
        self.up_proj = nnx.Linear(config.dim, config.ffn_dim, **kw)
        self.down_proj = nnx.Linear(config.ffn_dim, config.dim, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: ``[batch, seq, dim]`` -> ``[batch, seq, dim]``."""
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    """Pre-norm decoder layer: attention then MLP, each with a residual connection."""

    def __init__(self, config: LlamaConfig, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.attn_norm = nnx.RMSNorm(config.dim, epsilon=config.norm_eps, **kw)
        self.attn = Attention(config, **kw)
        self.mlp_norm = nnx.RMSNorm(config.dim, epsilon=config.norm_eps, **kw)
        self.mlp = MLP(config, **kw)

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        mask: jax.Array,
        kv: LayerKV | None,
        slot: jax.Array | None,
    ) -> tuple[jax.Array, LayerKV | None]:
        """x: ``[batch, seq, dim]``; the other arguments and the result as in `Attention`."""
        h, new_kv = self.attn(self.attn_norm(x), cos, sin, mask, kv, slot)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), new_kv


class Llama(nnx.Module):
    """Llama decoder-only language model.

    Parameter paths read like ``layers/3/attn/q_proj/kernel``; kernels are
    ``[in_features, out_features]``; the token embedding ``embed/embedding`` is
    ``[vocab, dim]`` and, with tied embeddings, also produces the logits (`Embed.attend`).
    """

    def __init__(
        self,
        config: LlamaConfig,
        *,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.config = config
        self.dtype = dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.embed = nnx.Embed(config.vocab_size, config.dim, **kw)
        self.layers = nnx.List([Block(config, **kw) for _ in range(config.n_layers)])
        self.norm = nnx.RMSNorm(config.dim, epsilon=config.norm_eps, **kw)
        if not config.tie_embeddings:
            self.lm_head = nnx.Linear(config.dim, config.vocab_size, use_bias=False, **kw)

    @classmethod
    def abstract(
        cls, config: LlamaConfig, *, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32
    ) -> Llama:
        """A shape-only instance whose parameters are `jax.ShapeDtypeStruct` placeholders.

        The same module `nnx.eval_shape(lambda: Llama(...))` gives, for loaders to fill in, but
        built by tracing one layer and cloning it: NNX's tracing cost grows with the length
        of the trace, which makes tracing all layers at once take seconds.
        """
        return abstract_stack(cls, config, Block, dtype=dtype, param_dtype=param_dtype)

    def init_cache(
        self, batch: int, max_len: int, kv_cache: KVCacheConfig | str | None = None
    ) -> KVCache:
        """An empty KV cache for `batch` sequences of up to `max_len` tokens (see
        `init_kv_cache`; `kv_cache` picks a quantized cache)."""
        return init_kv_cache(self.config, batch, max_len, self.dtype, kv_cache)

    def __call__(
        self,
        tokens: jax.Array,
        *,
        positions: jax.Array | None = None,
        cache: KVCache | None = None,
        last_only: bool = False,
    ) -> jax.Array | tuple[jax.Array, KVCache]:
        """Next-token logits.

        Args:
          tokens: ``[batch, seq]`` int32.
          positions: ``[batch, seq]`` or ``[seq]`` int rotary positions; by default
            ``0..seq-1``, or, with a cache, each token's slot minus its row's ``cache.start``.
          cache: a `KVCache`; the tokens are written at slot ``cache.length`` and may attend
            to every slot from their row's ``cache.start`` up to their own. It must have room
            for them: writes past ``max_len`` are clipped by XLA and silently wrong.
          last_only: logits of the last position only, ``[batch, 1, vocab]`` (what generation
            samples from): the output projection then runs on one row per sequence instead
            of `seq` (a kernel call cannot be sliced after the fact).

        Returns:
          ``logits [batch, seq, vocab]`` without a cache; ``(logits, new_cache)`` with one.
        """
        b, s = tokens.shape
        if cache is None:
            slot = None
            offsets = jnp.arange(s, dtype=jnp.int32)
            key_slots = offsets
            first = jnp.zeros((b,), jnp.int32)
        else:
            slot = cache.length
            offsets = slot + jnp.arange(s, dtype=jnp.int32)
            key_slots = jnp.arange(cache.max_len, dtype=jnp.int32)
            first = cache.start
        if positions is None:
            positions = jnp.maximum(offsets[None, :] - first[:, None], 0)
        positions = jnp.broadcast_to(positions, (b, s))
        # Causal in slot order: a query sees keys in slots up to its own, none before its row's
        # first real slot.
        causal = key_slots[None, :] <= offsets[:, None]
        mask = causal[None] & (key_slots[None, None, :] >= first[:, None, None])
        cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_base)
        x = self.embed(tokens)
        layers_out = []
        for i, layer in enumerate(self.layers):
            kv = None if cache is None else cache.layer(i)
            x, new_kv = layer(x, cos, sin, mask, kv, slot)
            layers_out.append(new_kv)
        x = self.norm(x[:, -1:] if last_only else x)
        logits = self.embed.attend(x) if self.config.tie_embeddings else self.lm_head(x)
        if cache is None:
            return logits
        quantized = cache.config is not None
        new_cache = dataclasses.replace(
            cache,
            keys=tuple(kv.keys for kv in layers_out),
            values=tuple(kv.values for kv in layers_out),
            key_scales=tuple(kv.key_scales for kv in layers_out) if quantized else (),
            value_scales=tuple(kv.value_scales for kv in layers_out) if quantized else (),
            key_offsets=tuple(kv.key_offsets for kv in layers_out) if quantized else (),
            length=slot + s,
        )
        return logits, new_cache

    def decode_step(self, tokens: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Append `tokens` (``[batch, seq]``, usually seq 1) to `cache`.

        Returns ``(logits [batch, seq, vocab], new_cache)``; the input cache is not modified.
        """
        return self(tokens, cache=cache)
