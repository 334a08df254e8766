"""Benchmark section: the README's preset table, measured.

SmolLM2-135M perplexity on 4096 tokens of the evaluation speeches (windows of 512) and
all-MiniLM-L6-v2 mean cosine of 32 sentence embeddings to the float ones, with stored size,
prefill (512 tokens, batch 1) and decode (batch 1, KV cache) speed, as `lowbit demo` measures
them (`lowbit.eval.evaluate_recipes`). Data-driven recipes calibrate as the demo does: SmolLM2
on 16 sequences of 512 tokens of other speeches, MiniLM on the CLI's default sentences.
"""

from __future__ import annotations

import datetime
import os

from benchmarks._machine import cpu_model
from lowbit import kernels
from lowbit.eval import ResultRow, evaluate_recipes, relative_change
from lowbit.models import has_minilm, has_smollm2

RECIPES = {
    "smollm2": (
        "float",
        "int8w",
        "int8_smoothquant",
        "int4w_g32_asym",
        "int4w_g64",
        "int4w_g64_gptq",
        "int4w_g64_awq",
        "nf4_g64",
        "gguf",
    ),
    "minilm": ("float", "int8", "int8_smoothquant", "int4w_g32_asym_gptq"),
}
CALIBRATION = {"smollm2": 16, "minilm": None}
NAMES = {"smollm2": "SmolLM2", "minilm": "MiniLM"}


def _quality(rows: list[ResultRow], row: ResultRow) -> str:
    if row.metric == "cosine":
        return f"cos {row.value:.5f}"
    if row.recipe == "float":
        return f"ppl {row.value:.3f}"
    return f"ppl {row.value:.3f} ({relative_change(rows, row):+.2%})"


def _speed(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def run() -> str:
    rows: list[ResultRow] = []
    available = {"smollm2": has_smollm2(), "minilm": has_minilm()}
    for model, recipes in RECIPES.items():
        if available[model]:
            suite = evaluate_recipes(
                model, recipes, calibration_sequences=CALIBRATION[model], measure_speed=True
            )
            rows.extend(suite.rows)
    lines = [
        "## Presets: size, quality and speed (`benchmarks/presets.py`)",
        "",
        f"- Date: {datetime.date.today().isoformat()}; CPU: {cpu_model()}, {os.cpu_count()} "
        f"cores; {kernels.status()}; load average at the end "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}.",
        "- " + __doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
        "",
        "| model | preset | size / float32 | quality | prefill tok/s | decode tok/s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {NAMES[row.model]} | `{row.recipe}` | {row.size_bytes / row.float32_bytes:.3f} "
            f"| {_quality(rows, row)} | {_speed(row.prefill_tokens_per_s, '.0f')} "
            f"| {_speed(row.decode_tokens_per_s, '.1f')} |"
        )
    if not rows:
        lines.append("| - | the model packages are not installed | | | | |")
    return "\n".join(lines) + "\n"
