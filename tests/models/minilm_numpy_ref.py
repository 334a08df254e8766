"""Plain-NumPy all-MiniLM-L6-v2 sentence embedding, written independently of `lowbit.models`.

Reads the Hugging Face tensor names directly, computes in float64, one sentence at a time (so
no padding is involved at all), then mean-pools and L2-normalises.
"""

from __future__ import annotations

import math

import numpy as np

_erf = np.frompyfunc(math.erf, 1, 1)


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))


def minilm_embedding(weights: dict[str, np.ndarray], ids: list[int], n_heads: int = 12):
    """Embedding [dim] float64 of one tokenized sentence (ids include [CLS] and [SEP])."""
    w = lambda name: weights[name].astype(np.float64)
    eps = 1e-12
    seq = len(ids)
    h = (
        w("embeddings.word_embeddings.weight")[ids]
        + w("embeddings.position_embeddings.weight")[:seq]
        + w("embeddings.token_type_embeddings.weight")[0]
    )
    h = _layer_norm(h, w("embeddings.LayerNorm.weight"), w("embeddings.LayerNorm.bias"), eps)
    dim = h.shape[-1]
    hd = dim // n_heads
    layer = 0
    while f"encoder.layer.{layer}.attention.self.query.weight" in weights:
        p = f"encoder.layer.{layer}."
        dense = lambda x, name: x @ w(p + name + ".weight").T + w(p + name + ".bias")
        q = dense(h, "attention.self.query").reshape(seq, n_heads, hd).transpose(1, 0, 2)
        k = dense(h, "attention.self.key").reshape(seq, n_heads, hd).transpose(1, 0, 2)
        v = dense(h, "attention.self.value").reshape(seq, n_heads, hd).transpose(1, 0, 2)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(hd)
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        ctx = ((s / s.sum(axis=-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(seq, dim)
        ln = lambda x, name: _layer_norm(x, w(p + name + ".weight"), w(p + name + ".bias"), eps)
        h = ln(h + dense(ctx, "attention.output.dense"), "attention.output.LayerNorm")
        ff = dense(_gelu_erf(dense(h, "intermediate.dense")), "output.dense")
        h = ln(h + ff, "output.LayerNorm")
        layer += 1
    pooled = h.mean(axis=0)
    return pooled / np.linalg.norm(pooled)
