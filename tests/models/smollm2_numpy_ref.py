"""Plain-NumPy SmolLM2 forward pass, written independently of `lowbit.models.Decoder`.

It works directly in GGUF's layout: weights keyed by GGUF tensor name, `[out, in]`, and the
query/key rows left in llama.cpp's interleaved order, so the rotary embedding rotates adjacent
feature pairs `(2i, 2i+1)`. The module under test un-permutes those rows and rotates halves
instead; agreement checks the permutation as well as the arithmetic. Computes in float64.
"""

from __future__ import annotations

import numpy as np


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope_adjacent_pairs(x: np.ndarray, base: float) -> np.ndarray:
    """x: [seq, heads, head_dim]; rotates each pair (2i, 2i+1) by pos * base^(-2i/head_dim)."""
    seq, _, d = x.shape
    freqs = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    theta = np.arange(seq, dtype=np.float64)[:, None] * freqs[None, :]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def smollm2_logits(weights: dict[str, np.ndarray], metadata: dict, tokens: list[int]) -> np.ndarray:
    """Logits [seq, vocab] float64 for one token sequence."""
    n_layers = metadata["llama.block_count"]
    n_head = metadata["llama.attention.head_count"]
    n_kv = metadata["llama.attention.head_count_kv"]
    eps = metadata["llama.attention.layer_norm_rms_epsilon"]
    base = metadata["llama.rope.freq_base"]
    w = lambda name: weights[name].astype(np.float64)
    embed = w("token_embd.weight")
    h = embed[np.asarray(tokens)]
    seq, dim = h.shape
    hd = dim // n_head
    causal = np.tril(np.ones((seq, seq), dtype=bool))
    for i in range(n_layers):
        p = f"blk.{i}."
        x = _rms_norm(h, w(p + "attn_norm.weight"), eps)
        q = (x @ w(p + "attn_q.weight").T).reshape(seq, n_head, hd)
        k = (x @ w(p + "attn_k.weight").T).reshape(seq, n_kv, hd)
        v = (x @ w(p + "attn_v.weight").T).reshape(seq, n_kv, hd)
        q, k = _rope_adjacent_pairs(q, base), _rope_adjacent_pairs(k, base)
        heads = []
        for head in range(n_head):
            kv = head // (n_head // n_kv)
            s = q[:, head] @ k[:, kv].T / np.sqrt(hd)
            s = np.where(causal, s, -np.inf)
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            heads.append((s / s.sum(axis=-1, keepdims=True)) @ v[:, kv])
        h = h + np.concatenate(heads, axis=-1) @ w(p + "attn_output.weight").T
        x = _rms_norm(h, w(p + "ffn_norm.weight"), eps)
        gate = _silu(x @ w(p + "ffn_gate.weight").T)
        h = h + (gate * (x @ w(p + "ffn_up.weight").T)) @ w(p + "ffn_down.weight").T
    h = _rms_norm(h, w("output_norm.weight"), eps)
    return h @ embed.T
