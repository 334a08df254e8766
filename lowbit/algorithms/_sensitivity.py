"""Sensitivity of a weight to each candidate format: its cost in stored bytes and its output
error on the calibration data.

For a weight ``W`` (as a matrix ``[F, K]``, inputs last) quantized to ``Ŵ``, with the Gram
matrix ``G = Σ xᵀx`` of its inputs over the calibration rows (`capture`), the error is

    tr(ΔW G ΔWᵀ) = Σ_rows ‖ΔW x‖²,      ΔW = Ŵ − W,

the summed squared change of the layer's outputs: GPTQ's objective, comparable across weights
(all are sums over the same calibration rows). A stacked weight sums it over its layers. A
weight read only by a lookup (an untied embedding table) has no Gram matrix; each calibration
row then reads one row of it, so its error is ``rows / V · ‖ΔW‖²`` (rows drawn uniformly).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.algorithms._capture import WeightStats
from lowbit.algorithms._gptq import as_matrix, gptq_qarray
from lowbit.qarray import quantize
from lowbit.recipes._candidates import Candidate


@dataclasses.dataclass(frozen=True)
class Measured:
    """One candidate on one weight.

    Attributes:
      candidate: the candidate.
      nbytes: bytes the target stores for the weight.
      error: output error on the calibration data (see module docstring).
    """

    candidate: Candidate
    nbytes: int
    error: float


@jax.jit
def _weighted(delta: jax.Array, gram: jax.Array) -> jax.Array:
    """tr(Δ G Δᵀ) for Δ [F, K], G [K, K]."""
    return jnp.sum((delta @ gram) * delta)


def output_error(delta: jax.Array, stats: list[WeightStats], rows: int) -> float:
    """The error of a weight change `delta` [*shape] (see module docstring).

    Args:
      delta: quantized minus float weight.
      stats: the weight's `WeightStats` (one per stacked index); empty for a lookup table.
      rows: calibration rows, for a weight without statistics.
    """
    if not stats:
        return float(jnp.sum(jnp.square(delta))) * rows / max(delta.shape[0], 1)
    total = 0.0
    for s in stats:
        index = [slice(None)] * delta.ndim
        for axis, i in s.fixed:
            index[axis] = i
        kept = [a for a in range(delta.ndim) if not isinstance(index[a], int)]
        axes = tuple(kept.index(a) for a in s.input_axes)
        matrix = as_matrix(delta[tuple(index)], axes)[0]
        total += float(_weighted(matrix, jnp.asarray(s.gram, jnp.float32)))
    return total


@functools.partial(jax.jit, static_argnames="config")
def _rtn(w: jax.Array, config):
    return quantize(w, config)


@functools.partial(jax.jit, static_argnames="config")
def _rtn_delta(w: jax.Array, config) -> jax.Array:
    # Round to nearest and back in one compiled function: one compile per shape and config.
    return quantize(w, config).dequantize(jnp.float32) - w


def measure(
    path: str,
    w: jax.Array,
    stats: list[WeightStats],
    candidates: tuple[Candidate, ...],
    *,
    target: str,
    rows: int,
    factors: dict | None = None,
) -> list[Measured]:
    """Every candidate that fits the weight, with its bytes and error.

    Args:
      path: the parameter path (its layout: ``kernel`` / ``embedding`` / ``weight``).
      w: [*shape] float weight.
      stats: its `WeightStats` (empty: a lookup table, see module docstring).
      candidates: what to try; those whose groups do not divide the contraction axis, and
        GPTQ ones on a weight without statistics or with fewer calibration rows than inputs
        (where `quantize_params` would not run GPTQ either), are left out.
      target: ``"lowbit"`` (bytes of the QArray: codes, scales, zero points) or ``"gguf"``
        (bytes of the GGML blocks).
      rows: calibration rows (for a lookup table's error).
      factors: shared inverse-Hessian factors across weights (`gptq_matrix`).
    Returns:
      One `Measured` per candidate tried, in the order given.
    """
    shape = tuple(np.shape(w))
    w = jnp.asarray(w, jnp.float32)
    # GPTQ runs where `gptq_one` would: plain statistics with at least as many rows as inputs.
    gptq_ok = bool(stats) and all(not s.ragged and s.count >= int(s.gram.shape[0]) for s in stats)
    out = []
    for cand in candidates:
        if not cand.fits(path, shape) or (cand.algorithm is not None and not gptq_ok):
            continue
        config = cand.config(path, len(shape))
        if cand.algorithm is not None:
            q, _ = gptq_qarray(w, _rtn(w, config), stats, cand.algorithm, factors)
            delta = q.dequantize(jnp.float32) - w
        else:
            q = jax.eval_shape(functools.partial(quantize, config=config), w)  # shapes only
            delta = _rtn_delta(w, config)
        nbytes = cand.gguf_nbytes(shape) if target == "gguf" else int(q.nbytes)
        out.append(Measured(cand, nbytes, output_error(delta, stats, rows)))
    return out
