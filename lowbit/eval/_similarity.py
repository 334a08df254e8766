"""Embedding similarity of a quantized encoder to its float original."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimilarityResult:
    """Attributes:
    mean: mean cosine similarity over the sentences.
    min: the smallest one (the worst sentence).
    count: number of sentences.
    """

    mean: float
    min: float
    count: int


def cosine_similarity(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity, computed in float64.

    Args:
      a: [n, d] float.
      b: [n, d] float.
    Returns:
      [n] float64 in [-1, 1]; a zero row against a zero row counts as 1 (identical), a zero row
      against a non-zero one as 0.
    Raises:
      ValueError: if the shapes differ or are not 2-D.
    """
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"cosine_similarity needs two [n, d] arrays; got {a.shape} and {b.shape}")
    dot = np.sum(a * b, axis=-1)
    norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    both_zero = ~np.any(a, axis=-1) & ~np.any(b, axis=-1)
    safe = np.where(norms > 0, norms, 1.0)
    cos = np.where(norms > 0, dot / safe, 0.0)
    return np.clip(np.where(both_zero, 1.0, cos), -1.0, 1.0)


def embedding_similarity(reference: np.ndarray, embeddings: np.ndarray) -> SimilarityResult:
    """Cosine of each sentence embedding to its float reference.

    Args:
      reference: [n, d] float, embeddings from the float model.
      embeddings: [n, d] float, embeddings of the same sentences from the quantized model.
    Returns:
      A `SimilarityResult`.
    Raises:
      ValueError: as `cosine_similarity`, or if there are no sentences.
    """
    cos = cosine_similarity(reference, embeddings)
    if cos.size == 0:
        raise ValueError("embedding_similarity needs at least one sentence")
    return SimilarityResult(mean=float(cos.mean()), min=float(cos.min()), count=int(cos.size))
