"""Plain-NumPy all-MiniLM-L6-v2 sentence embedding, written independently of `lowbit.models`.

Reads the Hugging Face tensor names directly, computes in float64, one sentence at a time (so
no padding is involved at all), then mean-pools and L2-normalises.
"""

from __future__ import annotations

import math

import numpy as np

_erf = np.frompyfunc(math.erf, 1, 1)
_EPS = 1e-12


def _get(weights: dict[str, np.ndarray], name: str) -> np.ndarray:
    return weights[name].astype(np.float64)


def _layer_norm(weights, prefix: str, x: np.ndarray) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + _EPS)
    return y * _get(weights, prefix + ".weight") + _get(weights, prefix + ".bias")


def _dense(weights, prefix: str, x: np.ndarray) -> np.ndarray:
    return x @ _get(weights, prefix + ".weight").T + _get(weights, prefix + ".bias")


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))


def _encoder_layer(weights, p: str, h: np.ndarray, n_heads: int) -> np.ndarray:
    seq, dim = h.shape
    hd = dim // n_heads

    def heads(name: str) -> np.ndarray:
        return _dense(weights, p + name, h).reshape(seq, n_heads, hd).transpose(1, 0, 2)

    q, k, v = (
        heads("attention.self.query"),
        heads("attention.self.key"),
        heads("attention.self.value"),
    )
    s = q @ k.transpose(0, 2, 1) / math.sqrt(hd)
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    ctx = ((s / s.sum(axis=-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(seq, dim)
    h = _layer_norm(
        weights,
        p + "attention.output.LayerNorm",
        h + _dense(weights, p + "attention.output.dense", ctx),
    )
    ff = _dense(
        weights, p + "output.dense", _gelu_erf(_dense(weights, p + "intermediate.dense", h))
    )
    return _layer_norm(weights, p + "output.LayerNorm", h + ff)


def minilm_embedding(weights: dict[str, np.ndarray], ids: list[int], n_heads: int = 12):
    """Embedding [dim] float64 of one tokenized sentence (ids include [CLS] and [SEP])."""
    seq = len(ids)
    h = (
        _get(weights, "embeddings.word_embeddings.weight")[ids]
        + _get(weights, "embeddings.position_embeddings.weight")[:seq]
        + _get(weights, "embeddings.token_type_embeddings.weight")[0]
    )
    h = _layer_norm(weights, "embeddings.LayerNorm", h)
    layer = 0
    while f"encoder.layer.{layer}.attention.self.query.weight" in weights:
        h = _encoder_layer(weights, f"encoder.layer.{layer}.", h, n_heads)
        layer += 1
    pooled = h.mean(axis=0)
    return pooled / np.linalg.norm(pooled)
