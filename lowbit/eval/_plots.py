"""PNG plots of a report: per-layer SQNR bars, size against quality across recipes, and
KL-divergence to a base model by position in the window.

Every ``plot_*`` function writes one PNG file at `path` (its folder made if missing) and returns
that path as a `Path`; a ``title`` argument titles the figure; ValueError when there is nothing
to draw. Uses matplotlib's Agg backend through an explicit `Figure` (no pyplot state, no
display).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lowbit._atomic import atomic_write
from lowbit.eval._divergence import DivergenceResult
from lowbit.eval._report import ResultRow

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def _figure(**options) -> Figure:
    # matplotlib is imported on first use: it takes seconds, and every command imports lowbit.
    from matplotlib.figure import Figure

    return Figure(**options)


def _save(fig: Figure, path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    # A reader never sees half a PNG, and a link planted at the name is refused.
    atomic_write(path, lambda f: fig.savefig(f, dpi=110, format="png"))
    return path


def plot_layer_sqnr(
    series: Mapping[str, Mapping[str, float]],
    path: str | os.PathLike[str],
    *,
    title: str = "per-layer SQNR",
) -> Path:
    """Bars of SQNR (dB) per layer, one panel per series (e.g. per recipe).

    Args:
      series: ``{label: {layer path: dB}}``; infinite values (exact layers) are drawn at the
        panel's largest finite value and hatched.
    Raises:
      ValueError: if `series` is empty or a series has no layer.
    """
    if not series:
        raise ValueError("plot_layer_sqnr needs at least one series")
    fig = _figure(figsize=(11, 1.0 + 2.0 * len(series)), layout="constrained")
    axes = fig.subplots(len(series), 1, squeeze=False)[:, 0]
    for ax, (label, values) in zip(axes, series.items(), strict=True):
        if not values:
            raise ValueError(f"series {label!r} has no layer")
        db = list(values.values())
        finite = [v for v in db if math.isfinite(v)]
        top = max(finite) if finite else 1.0
        heights = [v if math.isfinite(v) else top for v in db]
        bars = ax.bar(range(len(db)), heights, width=0.85, color="tab:blue")
        for bar, v in zip(bars, db, strict=True):
            if not math.isfinite(v):
                bar.set_hatch("//")
                bar.set_color("tab:gray")
        mean = sum(finite) / len(finite) if finite else math.nan
        ax.set_title(f"{label}  (mean {mean:.1f} dB over {len(db)} layers)", fontsize=9)
        ax.set_ylabel("dB")
        ax.set_xlim(-1, len(db))
        step = max(1, len(db) // 12)
        ticks = list(range(0, len(db), step))
        names = list(values)
        ax.set_xticks(ticks, [names[i] for i in ticks], rotation=20, ha="right", fontsize=6)
    fig.suptitle(title)
    return _save(fig, path)


_COLORS = (
    "tab:blue",
    "tab:orange",
    "tab:green",
    "tab:red",
    "tab:purple",
    "tab:brown",
    "tab:pink",
    "tab:gray",
    "tab:olive",
    "tab:cyan",
)
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")


def plot_size_vs_quality(rows: Sequence[ResultRow], path: str | os.PathLike[str]) -> Path:
    """Scatter of stored size (MB) against perplexity or cosine, one panel per model.

    Args:
      rows: results; rows without a value are left out (ValueError if no row has one).
    """
    models: dict[str, list[ResultRow]] = {}
    for row in rows:
        if row.value is not None:
            models.setdefault(row.model, []).append(row)
    if not models:
        raise ValueError("plot_size_vs_quality needs at least one row with a measured value")
    fig = _figure(figsize=(5.5 * len(models), 4.2), layout="constrained")
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    for ax, (model, model_rows) in zip(axes, models.items(), strict=True):
        # One colour and marker per recipe, named in the legend: recipes of similar size and
        # quality sit on top of each other, where text labels would overlap.
        for i, r in enumerate(model_rows):
            ax.scatter(
                r.size_mb,
                r.value,
                color=_COLORS[i % len(_COLORS)],
                marker=_MARKERS[i % len(_MARKERS)],
                s=40,
                zorder=3,
                label=r.recipe,
            )
        ax.legend(fontsize=7, loc="best")
        metric = model_rows[0].metric
        ax.set_xlabel("stored size (MB)")
        ax.set_ylabel("perplexity (lower is better)" if metric == "ppl" else "mean cosine to float")
        ax.set_title(model)
        ax.grid(True, alpha=0.3)
    return _save(fig, path)


def plot_loss_curve(
    losses: Sequence[float], path: str | os.PathLike[str], *, title: str = "training loss"
) -> Path:
    """Loss per step (faint) and its 10-step moving average.

    Args:
      losses: one value per step (at least one).
    """
    if not losses:
        raise ValueError("plot_loss_curve needs at least one loss value")
    steps = range(1, len(losses) + 1)
    window = 10
    averaged = [
        sum(losses[max(0, i - window) : i]) / (i - max(0, i - window))
        for i in range(1, len(losses) + 1)
    ]
    fig = _figure(figsize=(6.0, 3.8), layout="constrained")
    ax = fig.subplots()
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=1, label="per step")
    ax.plot(steps, averaged, color="tab:blue", linewidth=2, label=f"{window}-step average")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_bits_per_layer(
    bits: Mapping[str, float],
    path: str | os.PathLike[str],
    *,
    title: str = "stored bits per weight",
) -> Path:
    """Bars of mean stored bits per weight (scales included) per layer of a plan.

    Args:
      bits: ``{layer: bits}`` in model order (`lowbit.api.BudgetPlan.bits_per_layer`), at
        least one layer.
    """
    if not bits:
        raise ValueError("plot_bits_per_layer needs at least one layer")
    fig = _figure(figsize=(max(6.0, 0.3 * len(bits) + 2), 3.6), layout="constrained")
    ax = fig.subplots()
    ax.bar(range(len(bits)), list(bits.values()), width=0.85, color="tab:blue")
    ax.set_xticks(range(len(bits)), list(bits), rotation=90, fontsize=6)
    ax.set_ylabel("bits per weight")
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)


def plot_kld_by_position(
    result: DivergenceResult,
    path: str | os.PathLike[str],
    *,
    title: str = "KL-divergence by position in the window",
) -> Path:
    """Bars of mean KLD (with 95% confidence intervals) per bucket of window positions: how
    the divergence changes with the context a prediction has seen.

    Args:
      result: a `DivergenceResult` with at least one position bucket.
    """
    if not result.position_starts:
        raise ValueError("plot_kld_by_position needs a result with position buckets")
    ends = [*result.position_starts[1:], result.context]
    labels = [f"{a}-{b - 1}" for a, b in zip(result.position_starts, ends, strict=True)]
    fig = _figure(figsize=(6.5, 3.8), layout="constrained")
    ax = fig.subplots()
    ax.bar(
        range(len(labels)),
        result.position_kld,
        yerr=result.position_ci95,
        width=0.8,
        color="tab:blue",
        capsize=3,
    )
    ax.axhline(result.kld_mean, color="tab:red", linewidth=1, label=f"mean {result.kld_mean:.4f}")
    ax.set_xticks(range(len(labels)), labels, rotation=20, fontsize=7)
    ax.set_xlabel("position in the window (tokens of context seen)")
    ax.set_ylabel("mean KLD (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
