"""Result rows of an evaluation, as a terminal table (rich) and as JSON."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from lowbit._atomic import atomic_write

METRICS = ("ppl", "cosine")
REPORT_FILE = "report.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResultRow:
    """One (model, recipe) evaluation.

    Attributes:
      model: model name, e.g. ``"smollm2"``.
      recipe: recipe name, e.g. ``"int8w"``; ``"float"`` for the reference.
      size_bytes: bytes of all parameters as stored (QArrays packed).
      float32_bytes: bytes of the same parameters in float32.
      metric: ``"ppl"`` (perplexity, lower is better) or ``"cosine"`` (mean embedding cosine
        to the float model, higher is better).
      value: the metric, or None when not measured.
      worst: the smallest per-sentence cosine (encoders), or None.
      prefill_tokens_per_s: prompt throughput, or None.
      decode_tokens_per_s: generation throughput, or None.
    """

    model: str
    recipe: str
    size_bytes: int
    float32_bytes: int
    metric: str
    value: float | None = None
    worst: float | None = None
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None

    def __post_init__(self):
        if self.metric not in METRICS:
            raise ValueError(f"metric={self.metric!r}; accepted: {METRICS}")

    @property
    def size_mb(self) -> float:
        return self.size_bytes / 1e6

    @property
    def ratio(self) -> float:
        """Stored size over float32 size."""
        return self.size_bytes / self.float32_bytes if self.float32_bytes else math.nan

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ResultRow:
        """Inverse of `to_json`; ValueError naming a missing or unknown field."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(
                f"result row has unknown field {unknown[0]!r}; accepted: {sorted(names)}"
            )
        try:
            return cls(**data)
        except TypeError as err:
            raise ValueError(f"result row {dict(data)!r} is incomplete: {err}") from None


def relative_change(rows: Sequence[ResultRow], row: ResultRow) -> float | None:
    """``value / reference - 1`` against the same model's ``float`` row, or None if absent."""
    for ref in rows:
        if ref.model == row.model and ref.recipe == "float" and ref.metric == row.metric:
            if ref.value and row.value is not None:
                return row.value / ref.value - 1.0
    return None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _quality(rows: Sequence[ResultRow], row: ResultRow) -> str:
    if row.value is None:
        return "-"
    if row.metric == "cosine":
        return f"cos {row.value:.5f}"
    delta = relative_change(rows, row)
    tail = "" if delta is None or row.recipe == "float" else f" ({delta:+.2%})"
    return f"ppl {row.value:.3f}{tail}"


def results_table(rows: Sequence[ResultRow], *, title: str = "lowbit results") -> Table:
    """A rich table: model, recipe, size MB, size/f32, ppl (Δ vs float) or cosine, tok/s."""
    table = Table(title=title)
    for name, justify in (
        ("model", "left"),
        ("recipe", "left"),
        ("size MB", "right"),
        ("size/f32", "right"),
        ("ppl / cosine", "right"),
        ("prefill tok/s", "right"),
        ("decode tok/s", "right"),
    ):
        table.add_column(name, justify=justify)
    for row in rows:
        table.add_row(
            row.model,
            row.recipe,
            f"{row.size_mb:.2f}",
            f"{row.ratio:.3f}",
            _quality(rows, row),
            _fmt(row.prefill_tokens_per_s, ".0f"),
            _fmt(row.decode_tokens_per_s, ".1f"),
        )
    return table


def print_table(
    rows: Sequence[ResultRow], *, title: str = "lowbit results", console: Console | None = None
) -> None:
    """Prints `results_table` to `console` (default: stdout)."""
    (console or Console()).print(results_table(rows, title=title))


def write_report(
    directory: str | os.PathLike[str],
    rows: Iterable[ResultRow],
    *,
    layer_sqnr: Mapping[str, Mapping[str, Mapping[str, float]]] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Writes ``report.json``: ``{"rows": [...], "layer_sqnr": {...}, **extra}``.

    Args:
      directory: created if missing.
      rows: the results.
      layer_sqnr: ``{"model/recipe": {"weight"|"output": {path: dB}}}``; infinities are
        written as null (JSON has no infinity).
      extra: more top-level fields (e.g. wall time).
    Returns:
      The path written.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)

    def finite(x: float) -> float | None:
        return x if math.isfinite(x) else None

    payload: dict[str, Any] = {"rows": [r.to_json() for r in rows]}
    if layer_sqnr:
        payload["layer_sqnr"] = {
            name: {kind: {p: finite(v) for p, v in vals.items()} for kind, vals in kinds.items()}
            for name, kinds in layer_sqnr.items()
        }
    payload.update(extra or {})
    path = directory / REPORT_FILE
    atomic_write(path, (json.dumps(payload, indent=1) + "\n").encode("utf-8"), within=directory)
    return path


def read_rows(path: str | os.PathLike[str]) -> list[ResultRow]:
    """Rows of a ``report.json`` written by `write_report`.

    Raises:
      FileNotFoundError, or ValueError for a file that is not such a report.
    """
    path = Path(path)
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{os.fspath(path)!r} is not valid JSON: {err}") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("rows"), list):
        raise ValueError(f"{os.fspath(path)!r} has no 'rows' list; it is not a lowbit report")
    return [ResultRow.from_json(r) for r in payload["rows"]]
