"""Per-input-channel scales folded into the preceding norm: SmoothQuant and AWQ.

Both rescale input channel j of the weights that read a normalized activation ``h = a · p``
(`p` the norm's 1-D scale parameter) by ``s_j`` and divide ``p_j`` by ``s_j``: ``(h / s)(s W)``
is the float model's product, so the folding alone leaves the float model unchanged (up to
float rounding), while the quantizers see ``h / s`` and ``s W``.

  * SmoothQuant (Xiao et al., 2022): ``s = max|h|^α / max|W|^(1-α)`` per channel (max over all
    the weights reading `h`), moving activation outliers into the weights for w8a8 / w4a8.
  * AWQ (Lin et al., 2023): ``s = mean|h|^α`` (normalized), α searched on a grid to minimize
    the quantized weights' output error ``Σ ‖X W - (X / s) Q(s W)‖²`` on sampled inputs.

A scale is folded only where the probe saw the pattern (`lowbit.engine.Scaled`): `p` is read
by nothing but that product, and every weight reading `h` is one the recipe rescales with the
same algorithm. Other weights keep round-to-nearest, and the report says why.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.algorithms._capture import Statistics
from lowbit.qarray import QuantConfig
from lowbit.qarray import quantize as quantize_array
from lowbit.recipes import SmoothQuant, map_params


@dataclasses.dataclass(frozen=True)
class Fold:
    """One folded scale: the norm parameter, the weights rescaled, the scale [K], and how."""

    norm: str
    weights: tuple[str, ...]
    scale: np.ndarray
    note: str


def _fake_quant(w: jax.Array, config: QuantConfig) -> jax.Array:
    return quantize_array(w, config).dequantize()


_fake_quant_jit = jax.jit(_fake_quant, static_argnums=1)


def _awq_scale(
    x: np.ndarray, weights: list[tuple[jax.Array, int, QuantConfig]], mean_abs: jax.Array, grid: int
) -> tuple[np.ndarray, float]:
    """The AWQ scale minimizing the group's output error on sample rows `x` [n, K].

    `weights`: (parameter, its input axis, its weight config) per weight of the group.
    """
    x = jnp.asarray(x, jnp.float32)
    k = x.shape[1]
    as_matrix = lambda w, axis: jnp.moveaxis(w, axis, 0).reshape(k, -1)
    refs = [x @ as_matrix(w, axis) for w, axis, _ in weights]
    best, best_alpha, best_err = None, 0.0, np.inf
    base = jnp.maximum(mean_abs, 1e-8)
    for i in range(grid):
        alpha = i / grid
        s = base**alpha
        s = s / jnp.sqrt(s.max() * s.min())
        err = 0.0
        for (w, axis, config), ref in zip(weights, refs, strict=True):
            shape = [1] * w.ndim
            shape[axis] = k
            q = _fake_quant_jit(w * s.reshape(shape), config)
            err += float(jnp.sum(((x / s) @ as_matrix(q, axis) - ref) ** 2))
        if err < best_err:
            best, best_alpha, best_err = s, alpha, err
    return np.asarray(best), best_alpha


def plan_folds(
    params: dict[str, Any],
    wanted: dict[str, tuple[Any, Any]],
    statistics: Statistics,
) -> tuple[list[Fold], dict[str, str]]:
    """Which norm scales to fold, with which scales.

    Args:
      params: {path: float array} of the float params.
      wanted: {path: (decision, rule)} of the weights whose rule is AWQ or SmoothQuant.
      statistics: captured with samples (AWQ).
    Returns:
      (folds, {path: reason} for wanted weights that get no scale).
    """
    groups: dict[str, list[str]] = {}
    skipped: dict[str, str] = {}
    for path in wanted:
        stats = statistics.for_path(path)
        if len(stats) != 1 or stats[0].fixed or len(stats[0].input_axes) != 1:
            skipped[path] = "needs one 2-D use with statistics (stacked or einsum weights: rtn)"
            continue
        norm = stats[0].activation_scale
        if norm is None:
            skipped[path] = "its input is not a norm's output (no scale to fold into): rtn"
            continue
        groups.setdefault(norm, []).append(path)
    folds = []
    for norm, paths in groups.items():
        readers = statistics.scale_readers.get(norm, set())
        algorithms = {type(wanted[p][1].algorithm) for p in paths}
        reason = None
        if norm in statistics.escaped:
            reason = f"{norm} is also read outside the matmuls"
        elif readers - set(paths):
            reason = f"{norm} also feeds {sorted(readers - set(paths))}, not rescaled by the recipe"
        elif len(algorithms) > 1:
            reason = f"the weights reading {norm} ask for different algorithms"
        if reason is not None:
            for p in paths:
                skipped[p] = f"{reason}: rtn"
            continue
        algorithm = wanted[paths[0]][1].algorithm
        stats = [statistics.for_path(p)[0] for p in paths]
        axes = [s.input_axes[0] for s in stats]
        arrays = [jnp.asarray(params[p], jnp.float32) for p in paths]
        if isinstance(algorithm, SmoothQuant):
            act = jnp.maximum(stats[0].abs_max, 1e-5)
            wmax = jnp.max(
                jnp.stack(
                    [
                        jnp.abs(jnp.moveaxis(w, a, 0)).reshape(w.shape[a], -1).max(axis=1)
                        for w, a in zip(arrays, axes, strict=True)
                    ]
                ),
                axis=0,
            )
            s = act**algorithm.alpha / jnp.maximum(wmax, 1e-5) ** (1 - algorithm.alpha)
            s = jnp.where(jnp.isfinite(s) & (s > 0), s, 1.0)
            scale = np.asarray(jnp.clip(s, 1e-5, None))
            note = f"smoothquant (alpha {algorithm.alpha}"
        else:
            if stats[0].sample is None:
                raise ValueError("AWQ needs sampled inputs: capture(..., sample_rows=...)")
            group = [
                (w, a, wanted[p][0].config) for w, a, p in zip(arrays, axes, paths, strict=True)
            ]
            scale, alpha = _awq_scale(stats[0].sample, group, stats[0].abs_mean, algorithm.grid)
            note = f"awq (alpha {alpha:.2f}"
        folds.append(Fold(norm, tuple(paths), scale, f"{note}, folded into {norm})"))
    return folds, skipped


def apply_folds(params: Any, folds: list[Fold], input_axes: dict[str, int]) -> Any:
    """`params` with each fold's weights scaled along their input axis and the norm divided."""
    weight_scale = {p: (f.scale, input_axes[p]) for f in folds for p in f.weights}
    norm_scale = {f.norm: f.scale for f in folds}

    def one(path: str, leaf: Any) -> Any:
        if path in weight_scale:
            s, axis = weight_scale[path]
            shape = [1] * np.ndim(leaf)
            shape[axis] = -1
            return (jnp.asarray(leaf, jnp.float32) * s.reshape(shape)).astype(leaf.dtype)
        if path in norm_scale:
            return (jnp.asarray(leaf, jnp.float32) / norm_scale[path]).astype(leaf.dtype)
        return leaf

    return map_params(one, params)
