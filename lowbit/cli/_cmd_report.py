"""`lowbit report DIR`: size, quality, per-layer SQNR table and plots of a checkpoint."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

from rich.table import Table

from lowbit.cli._cmd_bench import BENCH_FILE
from lowbit.cli._cmd_eval import EVAL_FILE
from lowbit.cli._common import (
    Command,
    is_checkpoint,
    open_target,
    progress,
    read_json,
    stdout_console,
    step,
    write_json,
)
from lowbit.eval import (
    DivergenceResult,
    ModelSession,
    ResultRow,
    float32_bytes,
    output_sqnr,
    param_bytes,
    plot_kld_by_position,
    plot_layer_sqnr,
    plot_size_vs_quality,
    print_table,
    weight_sqnr,
    write_report,
)

WORST_SHOWN = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds this command's arguments to its sub-parser."""
    parser.add_argument(
        "directory", metavar="DIR", help="a checkpoint written by `lowbit quantize`"
    )
    parser.add_argument(
        "--no-eval",
        action="store_true",
        help="do not run the quality evaluation when DIR has no eval.json yet",
    )


def _layer_table(weight: dict[str, float], output: dict[str, float]) -> Table:
    table = Table(title=f"lowest-SQNR layers (of {len(weight)})")
    for name in ("layer", "weight dB", "output dB"):
        table.add_column(name, justify="left" if name == "layer" else "right")
    ranked = sorted(weight, key=lambda p: output.get(p, weight[p]))
    for path in ranked[:WORST_SHOWN]:
        out = output.get(path, math.nan)
        table.add_row(path, f"{weight[path]:.1f}", f"{out:.1f}")
    return table


def _divergence(stored: dict | None) -> tuple[DivergenceResult | None, str]:
    """The divergence `lowbit eval --against` stored in eval.json, and its base's label."""
    if not stored or "divergence" not in stored:
        return None, ""
    base = f"{stored.get('against_model', stored.get('against'))} ({stored.get('against_recipe')})"
    try:
        return DivergenceResult.from_json(stored["divergence"]), base
    except ValueError as err:
        raise ValueError(f"{EVAL_FILE}: {err}; run `lowbit eval --against` again") from None


def run(args: argparse.Namespace) -> int:
    """Runs the command with parsed `args`; returns the exit status (errors raise)."""
    directory = Path(args.directory)
    if not is_checkpoint(args.directory):
        raise ValueError(f"DIR {args.directory!r} is not a checkpoint (no manifest.json)")
    with progress() as bar:
        target = open_target(args.directory, None, bar)
        with step(bar, "per-layer SQNR"):
            weight = weight_sqnr(target.float_params, target.params)
            output = output_sqnr(target.float_params, target.params)
        stored = read_json(directory / EVAL_FILE)
        if stored is None and not args.no_eval:
            session = ModelSession(target.loaded)
            with step(bar, f"evaluating {target.recipe}") as advance:
                row = session.row(target.recipe, target.params, on_window=advance)
            stored = row.to_json()
            write_json(directory / EVAL_FILE, stored)
    reference = float32_bytes(target.float_params)
    metric = "ppl" if target.loaded.kind == "lm" else "cosine"
    row = ResultRow(
        model=target.loaded.name,
        recipe=target.recipe,
        size_bytes=param_bytes(target.params),
        float32_bytes=reference,
        metric=metric,
    )
    if stored is not None:
        row = dataclasses.replace(row, value=stored.get("value"), worst=stored.get("worst"))
    speed = read_json(directory / BENCH_FILE) or {}
    row = dataclasses.replace(
        row,
        prefill_tokens_per_s=speed.get("prefill_tokens_per_s"),
        decode_tokens_per_s=speed.get("decode_tokens_per_s"),
    )
    divergence, against = _divergence(stored)
    float_value = 1.0 if metric == "cosine" else None
    if divergence is not None and against == f"{row.model} (float)":
        float_value = divergence.base_perplexity  # measured on the same windows
    float_row = ResultRow(
        model=row.model,
        recipe="float",
        size_bytes=reference,
        float32_bytes=reference,
        metric=metric,
        value=float_value,
    )
    rows = [float_row, row]
    console = stdout_console()
    print_table(rows, title=f"lowbit report: {args.directory}", console=console)
    if divergence is not None:
        for line in divergence.lines(against):
            console.print(line)
    if weight:
        console.print(_layer_table(weight, output))
    name = f"{row.model}/{row.recipe}"
    extra = {}
    if divergence is not None:
        extra = {"against": against, "divergence": stored["divergence"]}
    write_report(
        directory, rows, layer_sqnr={name: {"weight": weight, "output": output}}, extra=extra
    )
    written = [directory / "report.json"]
    if weight:
        written.append(
            plot_layer_sqnr(
                {f"{name} weights": weight, f"{name} layer outputs": output},
                directory / "layer_sqnr.png",
                title=f"per-layer SQNR: {name}",
            )
        )
    if any(r.value is not None for r in rows):
        written.append(plot_size_vs_quality(rows, directory / "size_vs_quality.png"))
    if divergence is not None and divergence.position_starts:
        written.append(
            plot_kld_by_position(
                divergence,
                directory / "kld_by_position.png",
                title=f"KL-divergence of {name} to {against} by position in the window",
            )
        )
    console.print("wrote " + ", ".join(str(p) for p in written))
    return 0


COMMAND = Command(
    "report",
    "report on a checkpoint: size, perplexity or cosine, per-layer SQNR of weights and layer "
    "outputs, and the KL-divergence that `lowbit eval DIR --against BASE` stored; writes "
    "report.json, layer_sqnr.png, size_vs_quality.png (and kld_by_position.png) into DIR",
    add_arguments,
    run,
)
