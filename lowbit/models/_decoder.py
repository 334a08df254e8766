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

from lowbit import kernels
from lowbit.models._abstract import LayerStack
from lowbit.models._kv_cache import KVCache, LayerKV, fp8_codes, int8_scores
from lowbit.models._kv_cache import init_kv_cache as _init_cache
from lowbit.recipes import KVCacheConfig

ACTIVATIONS = ("silu", "gelu_tanh")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Hyper-parameters of a decoder; the defaults are SmolLM2-135M's (Llama architecture).

    Attributes:
      architecture: the family it was read as (``"llama"``, ``"qwen3"``, ``"gemma2"`` ...),
        for messages and export; the fields below decide the computation.
      vocab_size, dim, n_layers, ffn_dim, n_heads, n_kv_heads, head_dim: shapes. ``head_dim``
        need not be ``dim / n_heads`` (Gemma).
      norm_eps: RMSNorm epsilon.
      tie_embeddings: the embedding also produces the logits.
      qkv_bias: q/k/v projections have biases (Qwen2).
      rope_base: RoPE base of global layers (and of all layers without `rope_base_local`).
      context_length: the longest context the model was trained for.
      qk_norm: RMSNorm over each head's queries and keys before RoPE (Qwen3, Gemma 3).
      post_norms: RMSNorm on each sub-block's output before the residual add (Gemma 2/3).
      activation: the gated MLP's activation: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU).
      embed_scale: multiply embeddings by ``sqrt(dim)`` (Gemma).
      query_scale: the factor on ``q · k``; None for ``head_dim ** -0.5``.
      attn_softcap, final_softcap: ``c * tanh(x / c)`` on attention scores / logits (Gemma 2).
      sliding_window: local layers attend to the last this many positions (their own
        included); None for none.
      global_every: with a window, every `global_every`-th layer (1-based) attends globally
        (Gemma 2: 2, Gemma 3: 6); 0 puts the window on every layer (Mistral).
      rope_base_local: RoPE base of local layers (Gemma 3); None for `rope_base`.
      rope_scale: linear RoPE scaling (positions divided by it) on layers using `rope_base`.
      rope_freq_factors: per-frequency divisors (``head_dim / 2`` of them): Llama 3's scaling.
      n_experts, n_experts_used, expert_ffn_dim: a mixture of experts in place of the MLP when
        `n_experts` > 0: each token goes to its `n_experts_used` best experts.
      norm_topk: renormalize the chosen experts' router probabilities to sum to 1.
      shared_ffn_dim: a shared expert MLP every token uses, gated by ``sigmoid(x · w)``
        (Qwen2-MoE); 0 for none.
      fused_qkv: one ``qkv_proj`` whose outputs are q, k then v (Phi-3), in place of three.
      fused_gate_up: one ``gate_up_proj`` whose outputs are gate then up (Phi-3).
    """

    # The family, the residual stream, then attention and its positions.
    architecture: str = "llama"
    vocab_size: int = 49152
    dim: int = 576
    n_layers: int = 30
    ffn_dim: int = 1536
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    n_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    qkv_bias: bool = False
    rope_base: float = 100000.0
    context_length: int = 8192
    qk_norm: bool = False
    post_norms: bool = False
    activation: str = "silu"
    embed_scale: bool = False
    query_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_window: int | None = None
    global_every: int = 0
    rope_base_local: float | None = None
    rope_scale: float = 1.0
    rope_freq_factors: tuple[float, ...] | None = None
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn_dim: int = 0
    norm_topk: bool = True
    shared_ffn_dim: int = 0
    fused_qkv: bool = False
    fused_gate_up: bool = False

    def __post_init__(self) -> None:
        positive = ("vocab_size", "dim", "n_heads", "n_kv_heads", "head_dim", "context_length")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(
                    f"DecoderConfig.{name} is {getattr(self, name)!r}; it must be a "
                    "positive integer"
                )
        if self.n_layers < 0 or (self.ffn_dim < 1 and self.n_experts == 0):
            raise ValueError(
                f"DecoderConfig: n_layers={self.n_layers}, ffn_dim={self.ffn_dim} "
                "must be non-negative / positive"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"DecoderConfig.n_heads={self.n_heads} is not a multiple of "
                f"n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"DecoderConfig.head_dim={self.head_dim} must be even for rotary embeddings"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"DecoderConfig.activation is {self.activation!r}; accepted: {ACTIVATIONS}"
            )
        for name in ("rope_base", "norm_eps", "rope_scale"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"DecoderConfig.{name} is {value!r}; it must be finite and > 0")
        for name in ("query_scale", "attn_softcap", "final_softcap", "rope_base_local"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(
                    f"DecoderConfig.{name} is {value!r}; give a positive number or None"
                )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"DecoderConfig.sliding_window is {self.sliding_window}; give a positive "
                "number of positions or None"
            )
        if self.global_every < 0:
            raise ValueError(f"DecoderConfig.global_every is {self.global_every}; it must be >= 0")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(
                f"DecoderConfig.rope_freq_factors has {len(self.rope_freq_factors)} entries; "
                f"head_dim={self.head_dim} needs {self.head_dim // 2}"
            )
        if self.n_experts:
            if not 1 <= self.n_experts_used <= self.n_experts or self.expert_ffn_dim < 1:
                raise ValueError(
                    f"DecoderConfig: n_experts={self.n_experts} needs 1 <= n_experts_used "
                    f"(={self.n_experts_used}) <= n_experts and expert_ffn_dim "
                    f"(={self.expert_ffn_dim}) >= 1"
                )
        elif self.n_experts_used or self.shared_ffn_dim:
            raise ValueError("DecoderConfig: n_experts_used / shared_ffn_dim need n_experts > 0")

    @property
    def attn_scale(self) -> float:
        """The factor on ``q · k``."""
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    def is_local(self, layer: int) -> bool:
        """Whether `layer` (0-based) attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return self.global_every == 0 or (layer + 1) % self.global_every != 0


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
    out = x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
    return out.astype(x.dtype)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(x / cap)`` (Gemma 2's soft capping); `x` itself when `cap` is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


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


def _softmax_values(
    scores: jax.Array, v: jax.Array, mask: jax.Array, scale: jax.Array, cap: float | None
) -> jax.Array:
    """Scaled, capped, masked softmax of ``scores [b, H, g, s, T]`` over ``v [b, H, T, D]``,
    in v's dtype -> ``[b, s, H, g, D]``; mask ``[b, s, T]`` (True where attending)."""
    scores = softcap(scores.astype(jnp.float32) * scale, cap)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return _weighted_values(probs, v)


# Queries per block of a long input's attention (`_causal_attention`).
PREFILL_QUERY_BLOCK = 64


def _causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    scale: jax.Array,
    cap: float | None,
    slot: jax.Array | None = None,
) -> jax.Array:
    """`_softmax_values` of ``q [b, s, H, g, D]`` against ``k, v [b, H, T, D]`` whose last `s`
    possible slots hold these queries' own tokens, in blocks of `PREFILL_QUERY_BLOCK` queries.

    The s new tokens sit at slots ``slot .. slot + s - 1`` with ``slot + s <= T``, and each
    attends only to slots up to its own (`mask` is causal), so queries ``[i, j)`` need only
    keys ``[0, T - s + j)``: a prompt filling most of the cache computes about half the
    scores, exponentials and products of attending to every slot, with the same result.
    With `slot` given and shorter than the cache, a prompt written at slot 0 (a prefill into
    an empty cache, as generation and the server do) reads only its own `s` slots: a
    128-token prompt in a 192-slot cache computes 192 key columns a head instead of 320.
    """
    s, t = q.shape[1], k.shape[2]
    v = v.astype(q.dtype)
    if slot is not None and 1 < s < t:
        return jax.lax.cond(
            slot == 0,
            lambda: _causal_attention(q, k[:, :, :s], v[:, :, :s], mask[..., :s], scale, cap),
            lambda: _causal_attention(q, k, v, mask, scale, cap),
        )
    if s < 2 * PREFILL_QUERY_BLOCK:
        return _softmax_values(_scores(q, k), v, mask, scale, cap)
    out = []
    for i in range(0, s, PREFILL_QUERY_BLOCK):
        j = min(s, i + PREFILL_QUERY_BLOCK)
        keys = min(t, t - s + j)
        scores = _scores(q[:, i:j], k[:, :, :keys])
        out.append(_softmax_values(scores, v[:, :, :keys], mask[:, i:j, :keys], scale, cap))
    return jnp.concatenate(out, axis=1)


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
    a float32, float16 or bfloat16 cache (a bfloat16 model's), or an int8 / int4 / fp8 one
    (read by dequantizing, or for `integer_qk` by int8 products), with the kernels built,
    where the step is lowered for CPU. On XLA:CPU the block loop below costs mostly per-op
    dispatch (about 150 us a layer for SmolLM2 at 576 filled slots, against 30 us for the
    kernel)."""
    floats = {jnp.dtype(t) for t in (jnp.float32, jnp.float16, jnp.bfloat16)}
    cache_ok = kv.config is not None or (
        jnp.dtype(kv.keys.dtype) in floats and kv.values.dtype == kv.keys.dtype
    )
    return cache_ok and jnp.dtype(q.dtype) in floats and kernels.available()


def _decode_attention(
    q: jax.Array,
    kv: LayerKV,
    slot: jax.Array,
    block: int,
    first: jax.Array,
    cap: float | None = None,
) -> jax.Array:
    """One query per row attending to cache slots ``first .. slot`` only.

    The cost follows the filled length, not the cache's size: a loop over blocks of `block`
    slots up to the one holding `slot`, with a running (online) softmax, so a long cache
    barely filled costs one block; only those blocks of a quantized cache are dequantized.

    Args:
      q: ``[batch, 1, H, group, D]`` queries, already scaled by ``1 / sqrt(D)`` and rotated
        like the cache.
      kv: the layer cache after this token was written at `slot`.
      slot: ``int32 []``, the query's slot.
      block: slots per block, dividing the cache length.
      first: ``int32 [batch]``, each row's first visible slot: its ``kv.start``, or later
        under a sliding window.
      cap: soft cap on the scores (`softcap`), or None.
    Returns:
      ``[batch, 1, H, group, D]`` float32.
    """
    if not _fused_decode(q, kv):
        return _block_loop(q, kv, slot, block, first, cap)

    def fused(q, kv, slot):
        fp8 = kv.config is not None and kv.config.format == "fp8"
        # The kernel takes float32 queries (a bfloat16 model's are widened: its scores are
        # then float32 products, as the block loop's are not).
        out = kernels.decode_attention(
            q[:, 0].astype(jnp.float32),
            fp8_codes(kv.keys) if fp8 else kv.keys,
            fp8_codes(kv.values) if fp8 else kv.values,
            first,
            slot,
            kv.key_scales,
            kv.value_scales,
            integer_qk=kv.config is not None and kv.config.integer_qk,
            softcap=cap,
            rows=kv.rows,
        )
        return out[:, None]

    # The kernel where the step is lowered for CPU; the block loop on GPU / TPU. (The cache
    # is closed over: a LayerKV is not a pytree.)
    return jax.lax.platform_dependent(
        q,
        slot,
        cpu=lambda q, slot: fused(q, kv, slot),
        default=lambda q, slot: _block_loop(q, kv, slot, block, first, cap),
    )


def _block_loop(
    q: jax.Array,
    kv: LayerKV,
    slot: jax.Array,
    block: int,
    first_slot: jax.Array,
    cap: float | None,
) -> jax.Array:
    """`_decode_attention` as a loop of XLA ops over the visible blocks (any platform)."""
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
        scores = softcap(scores[:, :, :, 0].astype(jnp.float32), cap)  # [b, H, g, block]
        t = first + jnp.arange(block, dtype=jnp.int32)
        valid = (t[None, :] >= first_slot[:, None]) & (t[None, :] <= slot)  # [b, block]
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
    lo = jnp.min(first_slot) // block
    _, total, acc = jax.lax.fori_loop(lo, slot // block + 1, step, init)
    return (acc / total)[:, None]


class LayerView(NamedTuple):
    """Where one layer's tokens sit: what it reads besides the hidden states and its cache.

    Attributes:
      cos, sin: rotary tables ``[batch, seq, head_dim // 2]``.
      mask: ``[batch, seq, keys]`` bool, True where a query attends.
      first: ``int32 [batch]``, the first slot a decoded token may see (its row's start, or
        later under a sliding window).
      slot: int32 [] cache slot the tokens are written at, or None without a cache.
    """

    cos: jax.Array
    sin: jax.Array
    mask: jax.Array
    first: jax.Array
    slot: jax.Array | None


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
            self.q_norm = nnx.RMSNorm(c.head_dim, epsilon=c.norm_eps, **kw)
            self.k_norm = nnx.RMSNorm(c.head_dim, epsilon=c.norm_eps, **kw)

    def __call__(
        self, x: jax.Array, at: LayerView, kv: LayerKV | None
    ) -> tuple[jax.Array, LayerKV | None]:
        """x: ``[batch, seq, dim]``; `at` says where the tokens sit (`LayerView`).

        With a cache (`kv`, and `at.slot`), the new keys/values are written at that slot and
        attention reads them back from the cache (so a quantized cache's rounding is what
        attention sees); one decoded token per row reads only the blocks from `at.first` up to
        its slot (`_decode_attention`), longer inputs every slot under `at.mask`. The updated
        layer cache is returned.
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
            # Several tokens on some rows in place (a speculative check): one decode-attention
            # call per token, each up to its own slot, from the first slot its mask shows
            # (the row's start, or later on a sliding-window layer).
            out = jnp.concatenate(
                [
                    _decode_attention(
                        q[:, j : j + 1],
                        kv,
                        slot + j,
                        block,
                        at.first if s == 1 else jnp.argmax(mask[:, j], axis=-1).astype(jnp.int32),
                        c.attn_softcap,
                    )
                    for j in range(s)
                ],
                axis=1,
            )
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
            v = kv.read_values(x.dtype)
            if kv.config is not None and kv.config.integer_qk:
                scores = int8_scores(q, kv)
                out = _softmax_values(scores, v, mask, scale, c.attn_softcap)
            else:
                keys = kv.read_keys(q.dtype)
                out = _causal_attention(q, keys, v, mask, scale, c.attn_softcap, slot)
        else:
            k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
            out = _causal_attention(q, k.astype(q.dtype), v, mask, scale, c.attn_softcap)
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
        norm = lambda: nnx.RMSNorm(config.dim, epsilon=config.norm_eps, **kw)
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
            h = self.post_attn_norm(h)
        x = x + h
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        h = ffn(self.mlp_norm(x))
        if hasattr(self, "post_mlp_norm"):
            h = self.post_mlp_norm(h)
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
        self.norm = nnx.RMSNorm(config.dim, epsilon=config.norm_eps, **kw)
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
            slot = cache.length
            offsets = slot + jnp.arange(s, dtype=jnp.int32)
            key_slots = jnp.arange(cache.max_len, dtype=jnp.int32)
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
            # Gemma multiplies by sqrt(dim) rounded to the activation dtype.
            x = x * jnp.asarray(math.sqrt(self.config.dim), x.dtype)
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

        Returns:
          ``logits [batch, seq, vocab]`` without a cache; ``(logits, new_cache)`` with one.
        """
        inputs = self.layer_inputs(tokens.shape, positions=positions, cache=cache)
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
