"""Per-input-channel scales folded into the parameter that produced the input: SmoothQuant, AWQ.

Both rescale input channel j of the weights that read an activation `h` by ``s_j`` and divide
the channel of `h` by ``s_j`` where it is made: ``(h / s)(s W)`` is the float model's product,
so the folding alone leaves the float model unchanged (up to float rounding), while the
quantizers see ``h / s`` and ``s W``. `h` can absorb the division where the probe saw it made
(`lowbit.engine.Scaled`): as ``a · p`` with `p` a norm's 1-D scale (divide `p`), or as the
output of a linear layer ``x @ U`` (divide U's output columns; in a gated MLP
``down(act(x @ G) * (x @ U))`` that is the up projection, which folds `down`'s scale).

  * SmoothQuant (Xiao et al., 2022): ``s = max|h|^α / max|W|^(1-α)`` per channel (max over all
    the weights reading `h`), moving activation outliers into the weights for w8a8 / w4a8.
  * AWQ (Lin et al., 2023): ``s = mean|h|^α / mean|Ŵ|^(1-α)`` (Ŵ: |W| over its block's max,
    as AutoAWQ's scales), α searched on a grid to minimize the quantized weights' output error
    on all calibration rows, ``Σ ‖X W - (X / s) Q(s W)‖² = Σ tr(Δᵀ XᵀX Δ)`` with
    ``Δ = W - Q(s W) / s``, read off the captured Gram matrix.

A scale is folded only where every weight reading `h` is one the recipe rescales with the same
algorithm, or a parameter the recipe leaves in float that reads `h` only as a plain matrix (a
MoE router ``flat @ router``, a shared expert's gate ``[dim, 1]``: its input rows are multiplied
by the scale, ``(h / s)(s R) = h R``, and it stays in float), and `h` (or the parameter making
it) is read by nothing but those products. Where
that fails, SmoothQuant (with ``in_op=True``) keeps its scale with the weight instead
(`QArray.input_scale`: the op divides `h` by it before quantizing it, a `Fold` without a
target); other weights keep round-to-nearest, and the report says why.

Routed experts (``[E, in, out]`` weights read by ``ragged_dot`` over rows gathered from `h`,
per-expert statistics from `capture`) take one scale for all experts: the rows every expert
reads are rows of the same `h`, so only a scale shared by all experts (and by every other
reader of `h`: the router, the shared expert) folds exactly into the norm making `h`. Its
search minimizes the summed output error of every reader on its own rows (each expert's error
on its Gram matrix, the shared expert's on all tokens); mean |h| and max |h| are pooled over
the readers' rows. The experts' down projection reads ``act(x G_e) * (x U_e)``; one scale for
all experts folds exactly into every up projection's output columns (``U_e[:, j] / s_j``), as
for a dense gated MLP. Per-expert scales would need a scale per (expert, channel) in the fold,
which this module does not do.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.algorithms._capture import Statistics, WeightStats, expert_use, single_matrix_use
from lowbit.qarray import QuantConfig
from lowbit.qarray import quantize as quantize_array
from lowbit.recipes import AWQ, SmoothQuant, map_params


@dataclasses.dataclass(frozen=True)
class Fold:
    """One folded scale.

    Attributes:
      target: the parameter that absorbs ``1 / scale``: a norm's 1-D scale or a linear
        layer's weight; None for a scale applied inside the op (`QArray.input_scale`).
      axis: the axis of `target` divided (0 for a norm's scale, the output axis of a weight).
      weights: the weights multiplied by `scale` along their input axis.
      scale: [K] float32.
      note: what the report says for each of `weights`.
      compensate: ``((path, input axis), ...)``: parameters left in float that read the same
        input; multiplied by `scale` along that axis so their products are unchanged.
    """

    target: str | None
    axis: int
    weights: tuple[str, ...]
    scale: np.ndarray
    note: str
    compensate: tuple[tuple[str, int], ...] = ()


def as_matrix(w: jax.Array, axis: int) -> jax.Array:
    """[K, N]: `w` with its input axis first and the others flattened."""
    return jnp.moveaxis(w, axis, 0).reshape(w.shape[axis], -1)


@functools.partial(jax.jit, static_argnums=(1,))
def fake_quant(w: jax.Array, config: QuantConfig) -> jax.Array:
    """`w` rounded to nearest by `config` and dequantized (same shape and dtype)."""
    return quantize_array(w, config).dequantize()


def block_shape(w: jax.Array, config: QuantConfig) -> tuple[int, ...]:
    """Elements per scale along each axis of `config`'s quantization of `w` (traced only)."""
    return jax.eval_shape(lambda x: quantize_array(x, config), w).block_shape


@functools.partial(jax.jit, static_argnums=(3, 4))
def _scaled_error(h: jax.Array, w: jax.Array, s: jax.Array, axis: int, config: QuantConfig):
    """``tr(Δᵀ H Δ)`` with ``Δ = W - Q(s W) / s`` (s along `axis`): the output error of the
    quantized, rescaled weight on the rows whose Gram matrix is `h` [K, K]; for experts
    (`w` [E, K, N], axis 1) `h` is [E, K, K], each expert's error on its own rows, summed."""
    shape = [1] * w.ndim
    shape[axis] = -1
    s = s.reshape(shape)
    if h.ndim == 3:
        d = w - fake_quant(w * s, config) / s
        hd = jnp.einsum("ekl,eln->ekn", h, d, precision=jax.lax.Precision.HIGHEST)
        return jnp.sum(d * hd)
    d = as_matrix(w - fake_quant(w * s, config) / s, axis)
    return jnp.sum(d * jnp.dot(h, d, precision=jax.lax.Precision.HIGHEST))


def block_max(w: jax.Array, config: QuantConfig) -> jax.Array:
    """max |w| over each scale block of `config`'s quantization of `w`, broadcast to w.shape."""
    block = block_shape(w, config)
    shape = [d for n, b in zip(w.shape, block, strict=True) for d in (n // b, b)]
    m = jnp.max(jnp.abs(w).reshape(shape), axis=tuple(range(1, len(shape), 2)), keepdims=True)
    return jnp.broadcast_to(m, shape).reshape(w.shape)


def _awq_scale(
    hs: list[jax.Array],
    weights: list[tuple[jax.Array, int, QuantConfig]],
    mean_abs: jax.Array,
    grid: int,
) -> tuple[np.ndarray, float]:
    """The AWQ scale [K] minimizing the group's output error; `hs` per weight the Gram matrix
    of its input rows ([K, K], or [E, K, K] per expert), `weights` (parameter, its input axis,
    its weight config) per weight."""
    k = mean_abs.shape[0]
    relative = jnp.concatenate(
        [as_matrix(jnp.abs(w) / jnp.maximum(block_max(w, c), 1e-8), a) for w, a, c in weights],
        axis=1,
    )
    w_mean = jnp.maximum(relative.mean(axis=1), 1e-4)
    x_mean = jnp.maximum(mean_abs, 1e-8)
    best, best_alpha, best_err = jnp.ones(k), 0.0, np.inf
    for i in range(grid):
        alpha = i / grid
        s = jnp.clip(x_mean**alpha / w_mean ** (1 - alpha), 1e-4, None)
        s = s / jnp.sqrt(s.max() * s.min())
        err = sum(
            float(_scaled_error(h, w, s, a, c)) for h, (w, a, c) in zip(hs, weights, strict=True)
        )
        if np.isfinite(err) and err < best_err:
            best, best_alpha, best_err = s, alpha, err
    return np.asarray(best), best_alpha


@functools.partial(jax.jit, static_argnums=(4, 5, 6))
def _w8a8_error(x, ref, w, s, axis: int, config: QuantConfig, activation: QuantConfig):
    """``‖ref - Qa(x / s) Qw(s W)‖²`` on rows `x` [n, K] (s along W's input `axis`)."""
    shape = [1] * w.ndim
    shape[axis] = -1
    xq = fake_quant(x / s, activation)
    wq = as_matrix(fake_quant(w * s.reshape(shape), config), axis)
    return jnp.sum((jnp.dot(xq, wq, precision=jax.lax.Precision.HIGHEST) - ref) ** 2)


def _smoothquant_alpha(sample, group, activations, smooth, algorithm) -> float:
    """The alpha (of `algorithm.grid` values in [0, 1), and `algorithm.alpha`) whose scales give
    the group the least output error with weights and activations quantized, on `sample`."""
    if sample is None:
        raise ValueError("SmoothQuant(grid > 0) needs sampled inputs: capture(..., sample_rows=)")
    x = jnp.asarray(sample, jnp.float32)
    refs = [jnp.dot(x, as_matrix(w, a), precision=jax.lax.Precision.HIGHEST) for w, a, _ in group]
    best, best_err = algorithm.alpha, np.inf
    for alpha in sorted({algorithm.alpha, *(i / algorithm.grid for i in range(algorithm.grid))}):
        s = smooth(alpha)
        err = sum(
            float(_w8a8_error(x, ref, w, s, a, c, act))
            for (w, a, c), ref, act in zip(group, refs, activations, strict=True)
        )
        if np.isfinite(err) and err < best_err:
            best, best_err = alpha, err
    return best


def _source_problem(source: str, readers: set[str], wanted: dict, statistics: Statistics):
    """Why a scale cannot be folded into `source` (None if it can)."""
    if source in statistics.escaped:
        return f"{source} (or its output) is also read outside the matmuls"
    if readers - set(wanted):
        return f"{source} also feeds {sorted(readers - set(wanted))}, not rescaled by the recipe"
    if len({type(wanted[p][1].algorithm) for p in readers}) > 1:
        return f"the weights reading {source} ask for different algorithms"
    return None


def _compensable(reader: str, source: str, floats: frozenset[str], statistics: Statistics):
    """The input axis along which float parameter `reader` can absorb a scale folded into
    `source` (every use of it a plain matmul of an input `source` scales), or None."""
    if reader not in floats or reader in statistics.read_directly:
        return None
    axes = statistics.reader_axes.get(reader, set())
    scales = statistics.reader_scales.get(reader, set())
    if len(axes) != 1 or min(axes) < 0:
        return None
    if not scales or not all(sc and source in {p for p, _ in sc} for sc in scales):
        return None
    return next(iter(axes))


def plan_folds(
    params: dict[str, Any],
    wanted: dict[str, tuple[Any, Any]],
    statistics: Statistics,
    floats: frozenset[str] = frozenset(),
) -> tuple[list[Fold], dict[str, str]]:
    """Which scales to fold, into what.

    Args:
      params: {path: float array} of the float params.
      wanted: {path: (decision, rule)} of the weights whose rule is AWQ or SmoothQuant.
      statistics: captured on the float model.
      floats: parameters the recipe leaves in float: those reading a folded input as a plain
        matrix are compensated (multiplied by the scale) instead of preventing the fold.
    Returns:
      (folds, {path: reason} for wanted weights that get no scale).
    """
    skipped: dict[str, str] = {}
    sources: dict[str, dict[str, int]] = {}  # weight -> {source: axis}
    for path in wanted:
        stats = statistics.for_path(path)
        if not (single_matrix_use(stats) or expert_use(stats)):
            skipped[path] = "needs one 2-D use with statistics (stacked or einsum weights: rtn)"
        elif not stats[0].activation_scale:
            skipped[path] = (
                "its input is not made by a norm's scale or a linear layer (nothing to fold a "
                "scale into): rtn"
            )
        else:
            sources[path] = dict(stats[0].activation_scale)
    folds, done, problems = [], set(), {}
    for source in sorted({s for axes in sources.values() for s in axes}):
        readers = statistics.scale_readers.get(source, set())
        compensate = {
            r: a
            for r in readers - set(wanted)
            if (a := _compensable(r, source, floats, statistics)) is not None
        }
        readers = readers - set(compensate)
        if readers & done or not readers <= set(sources):
            continue
        problem = _source_problem(source, readers, wanted, statistics)
        if problem is not None:
            for p in readers:
                problems.setdefault(p, problem)
            continue
        paths = sorted(readers)
        axis = sources[paths[0]][source]
        fold = _fold(source, axis, paths, params, wanted, statistics)
        if compensate:
            kept = ", ".join(sorted(compensate))
            fold = dataclasses.replace(
                fold,
                compensate=tuple(sorted(compensate.items())),
                note=fold.note[:-1] + f"; {kept} compensated in float)",
            )
        folds.append(fold)
        done |= readers
    for path in sources:
        if path not in done:
            skipped[path] = problems.get(path, "its input is scaled with other weights': rtn")
            skipped[path] += "" if skipped[path].endswith("rtn") else ": rtn"
    for path in list(skipped):
        algorithm = wanted[path][1].algorithm
        one_use = single_matrix_use(statistics.for_path(path))
        if isinstance(algorithm, SmoothQuant) and algorithm.in_op and one_use:
            why = skipped.pop(path).removesuffix(": rtn")
            fold = _fold(None, -1, [path], params, wanted, statistics)
            folds.append(dataclasses.replace(fold, note=f"{fold.note}; no fold: {why}"))
    return folds, skipped


def _expert_gram(stats: list[WeightStats], norm: int) -> jax.Array:
    """[E, K, K] per-expert Gram matrices (expert order) over `norm` rows."""
    by_expert = sorted(stats, key=lambda s: s.fixed)
    return jnp.stack([s.gram for s in by_expert]) / max(norm, 1)


def _pooled(per_weight: list[list[WeightStats]]):
    """(Gram per weight, mean |h|, max |h|, sample rows) of a group's input `h`: of its one
    set of statistics where every weight has one, else pooled over all the weights' rows (the
    Gram matrices over one row count, so each weight's error weighs the rows it reads)."""
    if all(len(st) == 1 and not st[0].ragged for st in per_weight):
        first = per_weight[0][0]
        h = first.gram / max(first.count, 1)
        return [h] * len(per_weight), first.abs_mean, first.abs_max, first.sample
    every = [s for st in per_weight for s in st]
    norm = max(s.count for s in every)
    hs = [
        _expert_gram(st, norm) if st[0].ragged else st[0].gram / max(norm, 1) for st in per_weight
    ]
    count = sum(s.count for s in every)
    mean_abs = sum(s.abs_sum for s in every) / max(count, 1)
    abs_max = functools.reduce(jnp.maximum, [s.abs_max for s in every])
    dense = [s.sample for s in every if not s.ragged and s.sample is not None]
    routed = [s.sample for s in every if s.ragged and s.sample is not None]
    sample = dense[0] if dense else (np.concatenate(routed) if routed else None)
    return hs, mean_abs, abs_max, sample


def _fold(source, axis, paths, params, wanted, statistics) -> Fold:
    algorithm = wanted[paths[0]][1].algorithm
    per_weight = [statistics.for_path(p) for p in paths]
    group = [
        (jnp.asarray(params[p], jnp.float32), st[0].input_axes[0], wanted[p][0].config)
        for p, st in zip(paths, per_weight, strict=True)
    ]
    hs, mean_abs, abs_max, sample = _pooled(per_weight)
    if isinstance(algorithm, SmoothQuant):
        act = jnp.maximum(abs_max, 1e-5)
        wmax = jnp.max(jnp.stack([jnp.abs(as_matrix(w, a)).max(axis=1) for w, a, _ in group]), 0)

        def smooth(alpha: float) -> jax.Array:
            s = act**alpha / jnp.maximum(wmax, 1e-5) ** (1 - alpha)
            return jnp.clip(jnp.where(jnp.isfinite(s) & (s > 0), s, 1.0), 1e-5, None)

        alpha = algorithm.alpha
        if algorithm.grid:
            activations = [wanted[p][1].activation for p in paths]
            alpha = _smoothquant_alpha(sample, group, activations, smooth, algorithm)
        scale = np.asarray(smooth(alpha))
        searched = f", searched on {algorithm.grid}" if algorithm.grid else ""
        note = f"smoothquant (alpha {alpha:.2f}{searched}"
    else:  # AWQ, or GPTQ(scale=True): AWQ's scales
        grid = getattr(algorithm, "grid", AWQ.grid)
        scale, alpha = _awq_scale(hs, group, mean_abs, grid)
        note = f"awq (alpha {alpha:.2f}"
    if source is None:
        where = "applied to the input inside the op"
    elif axis == 0 and np.ndim(params[source]) == 1:
        where = f"folded into {source}"
    else:
        where = f"folded into {source}'s output"
    return Fold(source, axis, tuple(paths), scale, f"{note}, {where})")


def fold_factors(folds: list[Fold], input_axes: dict[str, int]) -> dict[str, list]:
    """{path: [(factor [K] float, axis), ...]}: each fold's weights (and the float parameters it
    compensates) are multiplied by its scale along their input axis and its target divided
    along its axis (a weight can be both: scaled inputs and divided outputs)."""
    factors: dict[str, list] = {}
    for f in folds:
        for p in f.weights:
            factors.setdefault(p, []).append((f.scale, input_axes[p]))
        for p, axis in f.compensate:
            factors.setdefault(p, []).append((f.scale, axis))
        if f.target is not None:
            factors.setdefault(f.target, []).append((1.0 / f.scale, f.axis))
    return factors


def input_scales(folds: list[Fold], input_axes: dict[str, int], ndims: dict[str, int]):
    """{path: [*shape with 1 off the input axis] float32}: the `QArray.input_scale` (``1 / s``)
    of each weight whose scale is applied inside the op (folds without a target)."""
    out = {}
    for f in folds:
        if f.target is None:
            for p in f.weights:
                shape = [1] * ndims[p]
                shape[input_axes[p]] = -1
                out[p] = jnp.asarray(1.0 / f.scale, jnp.float32).reshape(shape)
    return out


def scale_leaf(leaf: Any, factors: list) -> jax.Array:
    """`leaf` multiplied by each ``(factor [n], axis)`` of `factors` along its axis."""
    out = jnp.asarray(leaf, jnp.float32)
    for s, axis in factors:
        shape = [1] * np.ndim(leaf)
        shape[axis] = -1
        out = out * jnp.asarray(s, jnp.float32).reshape(shape)
    return out.astype(leaf.dtype)


def apply_factors(params: Any, factors: dict[str, list]) -> Any:
    """`params` with the leaves `factors` names multiplied by their factors (`fold_factors`)."""
    return map_params(lambda p, x: scale_leaf(x, factors[p]) if p in factors else x, params)


def apply_folds(params: Any, folds: list[Fold], input_axes: dict[str, int]) -> Any:
    """`params` with each fold's weights scaled along their input axis and its target divided
    along its axis (a weight can be both: scaled inputs and divided outputs)."""
    return apply_factors(params, fold_factors(folds, input_axes))
