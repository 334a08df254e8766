"""Sensitivity of a weight to each candidate format: its cost in stored bytes and its output
error on the calibration data.

For a weight ``W`` (as a matrix ``[F, K]``, inputs last) quantized to ``Ŵ``, with the Gram
matrix ``G = Σ xᵀx`` of its inputs over the calibration rows (`capture`), the error is

    tr(ΔW G ΔWᵀ) = Σ_rows ‖ΔW x‖²,      ΔW = Ŵ − W,

the summed squared change of the layer's outputs: GPTQ's objective, comparable across weights
(all are sums over the same calibration rows). A stacked weight sums it over its layers. A
weight read only by a lookup (an untied embedding table) has no Gram matrix; each calibration
row then reads one row of it, so its error is ``rows / V · ‖ΔW‖²`` (rows drawn uniformly).

A layer's own output error does not say how much the *model's* output moves: errors before a
softmax (queries, keys) or in early layers are amplified or damped by everything after them.
`output_sensitivity` measures that instead, a second-order Taylor (Gauss-Newton) score from
`jax.grad`: with ``J`` the Jacobian of the model's output ``f`` over the calibration batches,
the output's change is

    ‖Δf‖² ≈ ‖J Δw‖² ≈ Σ_ij diag(JᵀJ)_ij ΔW_ij²,

and ``diag(JᵀJ)`` is estimated by random projections, ``E_v[(∂(v·f)/∂W)²]`` for ``v ~ N(0, I)``
(one backward pass per batch and probe). The diagonal drops the correlations inside a layer
that the Gram matrix keeps, and gains the path to the output. On all-MiniLM-L6-v2 with lowbit's
default candidates, plans chosen on it reached a mean cosine to float of 0.911 at 3.5 bits and
0.981 at 4.5 bits, against 0.872 and 0.944 for plans chosen on the layers' own output errors
(docs/budget.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.algorithms._capture import WeightStats
from lowbit.algorithms._gptq import as_matrix, gptq_qarray
from lowbit.algorithms._walk import batch_args
from lowbit.qarray import quantize
from lowbit.recipes import Candidate, param_leaves


@dataclasses.dataclass(frozen=True)
class Measured:
    """One candidate on one weight.

    Attributes:
      candidate: the candidate.
      nbytes: bytes the target stores for the weight.
      error: output error on the calibration data (see module docstring).
      seconds: its kernel time per token on this machine, once timed
        (`lowbit.api.time_candidates`), else None.
    """

    candidate: Candidate
    nbytes: int
    error: float
    seconds: float | None = None


@jax.jit
def _weighted(delta: jax.Array, gram: jax.Array) -> jax.Array:
    """tr(Δ G Δᵀ) for Δ [F, K], G [K, K]."""
    return jnp.sum((delta @ gram) * delta)


@jax.jit
def _sensitivity_weighted(delta: jax.Array, sensitivity: jax.Array) -> jax.Array:
    return jnp.sum(sensitivity * jnp.square(delta))


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


def output_sensitivity(
    fn: Callable[..., Any],
    params: Any,
    batches: Sequence[tuple[Any, ...]],
    *,
    paths: Sequence[str] | None = None,
    probes: int = 4,
    seed: int = 0,
    row_mask: Callable[..., Any] | None = None,
) -> dict[str, jax.Array]:
    """The Gauss-Newton diagonal of every weight: how far the model's output moves per squared
    change of each weight element, summed over the calibration batches (see module docstring).

    Args:
      fn: ``fn(params, *batch) -> output`` (any array; a pytree's leaves are all counted).
      params: float params (a pytree of pure dicts, as `lowbit.recipes.param_leaves` reads).
      batches: calibration batches, each a tuple of `fn`'s arguments after `params` (a batch
        that is not a tuple is one argument, as in `capture`).
      paths: the weights to score (``"a/b/kernel"``); default every floating leaf.
      probes: random projections per batch (the estimate's variance falls as 1 / probes).
      seed: of the projections.
      row_mask: ``row_mask(*batch) -> [B, T]`` nonzero for the positions that count (an
        encoder's attention mask), broadcast over the output's trailing axes; padded positions
        then add nothing.
    Returns:
      {path: float32 array of the weight's shape}.
    Raises:
      ValueError: for no batches, probes < 1, or a path that is not a floating leaf.
    """
    if not batches or probes < 1:
        raise ValueError(
            f"output_sensitivity needs calibration batches and probes >= 1; got "
            f"{len(batches)} batches, probes={probes}"
        )
    leaves = dict(param_leaves(params))
    floating = [p for p, x in leaves.items() if jnp.issubdtype(jnp.result_type(x), jnp.floating)]
    paths = tuple(floating if paths is None else paths)
    missing = [p for p in paths if p not in floating]
    if missing:
        raise ValueError(
            f"output_sensitivity: {missing[0]!r} is not a floating parameter of params "
            f"({len(floating)} are, e.g. {floating[:3]})"
        )

    @jax.jit
    def squared_gradients(p, key, *batch):
        def projected(p):
            out = fn(p, *batch)
            total = jnp.float32(0.0)
            for i, y in enumerate(jax.tree.leaves(out)):
                v = jax.random.normal(jax.random.fold_in(key, i), y.shape, jnp.float32)
                if row_mask is not None:
                    mask = jnp.asarray(row_mask(*batch), jnp.float32)
                    v = v * mask.reshape(mask.shape + (1,) * (y.ndim - mask.ndim))
                total = total + jnp.sum(v * y.astype(jnp.float32))
            return total

        grads = dict(param_leaves(jax.grad(projected)(p)))
        return {path: jnp.square(grads[path].astype(jnp.float32)) for path in paths}

    total: dict[str, jax.Array] | None = None
    key = jax.random.key(seed)
    for b, batch in enumerate(batches):
        batch = batch_args(batch)
        for probe in range(probes):
            sub = jax.random.fold_in(jax.random.fold_in(key, b), probe)
            squares = squared_gradients(params, sub, *batch)
            total = squares if total is None else jax.tree.map(jnp.add, total, squares)
    return {path: value / probes for path, value in total.items()}


@functools.partial(jax.jit, static_argnames="config")
def _rtn(w: jax.Array, config):
    return quantize(w, config)


@functools.partial(jax.jit, static_argnames="config")
def _rtn_delta(w: jax.Array, config) -> jax.Array:
    # Round to nearest and back in one compiled function: one compile per shape and config.
    return quantize(w, config).dequantize(jnp.float32) - w


def stored_nbytes(
    path: str,
    w: Any,
    candidate: Candidate,
    *,
    target: str,
    nbytes: Callable[[str, Any], int] | None = None,
) -> int:
    """Bytes the target stores for the weight `w` (an array or a shape struct: only its shape
    is read) at `path` as `candidate`: the QArray's (``"lowbit"``), the GGML blocks'
    (``"gguf"``), or a file's own count, ``nbytes(path, q)`` of the QArray's shapes."""
    if nbytes is None and target == "gguf":
        return candidate.gguf_nbytes(tuple(np.shape(w)))
    shapes = _quantized_shapes(tuple(np.shape(w)), candidate.config(path, len(np.shape(w))))
    return int(shapes.nbytes) if nbytes is None else int(nbytes(path, shapes))


@functools.lru_cache(maxsize=4096)
def _quantized_shapes(shape: tuple[int, ...], config) -> Any:
    # Traced once per shape and config: a model's weights share a few shapes.
    w = jax.ShapeDtypeStruct(shape, jnp.float32)
    return jax.eval_shape(functools.partial(quantize, config=config), w)


def measure(
    path: str,
    w: jax.Array,
    stats: list[WeightStats],
    candidates: tuple[Candidate, ...],
    *,
    target: str,
    rows: int,
    factors: dict | None = None,
    sensitivity: jax.Array | None = None,
    nbytes: Callable[[str, Any], int] | None = None,
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
      sensitivity: the weight's `output_sensitivity`; given, the error is ``Σ s ΔW²`` (the
        model's output change) instead of the layer's own output error.
      nbytes: ``nbytes(path, q)``, the bytes a file holds for the weight quantized as `q` (a
        QArray of shape structs), instead of the target's (`lowbit.api.FileBytes`).
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
            delta = _rtn_delta(w, config)
        stored = stored_nbytes(path, w, cand, target=target, nbytes=nbytes)
        if sensitivity is None:
            error = output_error(delta, stats, rows)
        else:
            error = float(_sensitivity_weighted(delta, jnp.asarray(sensitivity, jnp.float32)))
        out.append(Measured(cand, stored, error))
    return out
