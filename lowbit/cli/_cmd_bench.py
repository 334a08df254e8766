"""`lowbit bench DIR|MODEL`: stored size and prefill / decode throughput."""

from __future__ import annotations

import argparse
import dataclasses

from lowbit.cli._common import (
    add_calibration_arguments,
    open_target,
    print_json,
    progress,
    stderr_console,
    stdout_console,
    step,
    write_json,
)
from lowbit.eval import print_table
from lowbit.eval._session import ModelSession

NAME = "bench"
HELP = (
    "measure stored size and throughput: prefill tokens/s (512 tokens, batch 1) and KV-cache "
    "decode tokens/s (batch 1) for language models, embedded tokens/s for encoders"
)
BENCH_FILE = "bench.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds this command's arguments to its sub-parser."""
    parser.add_argument(
        "target",
        metavar="DIR|MODEL",
        help="a checkpoint written by `lowbit quantize`, or smollm2 | minilm | a model file",
    )
    parser.add_argument(
        "--recipe",
        metavar="NAME|FILE.json",
        help="quantize MODEL with this recipe first (default: float); not with a checkpoint",
    )
    parser.add_argument(
        "--decode-steps", type=int, default=16, metavar="N", help="tokens per timed decode run"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the result (or the error) as one JSON object: the only line on stdout, "
        "tables go to stderr",
    )
    add_calibration_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Runs the command with parsed `args`; returns the exit status (errors raise)."""
    if args.decode_steps < 1:
        raise ValueError(f"--decode-steps={args.decode_steps} must be >= 1")
    with progress() as bar:
        target = open_target(args.target, args.recipe, bar, args)
        session = ModelSession(target.loaded)
        with step(bar, f"timing {target.recipe} (compile, warm up, then timed runs)"):
            speed = session.speed(target.params, decode_steps=args.decode_steps)
    decode = speed.decode_tokens_per_s if target.loaded.kind == "lm" else None
    row = dataclasses.replace(
        session.row(target.recipe, target.params, measure_quality=False),
        prefill_tokens_per_s=speed.prefill_tokens_per_s,
        decode_tokens_per_s=decode,
    )
    payload = {
        **row.to_json(),
        "prefill_tokens": speed.prefill_tokens,
        "decode_steps": speed.decode_steps,
    }
    console = stderr_console() if args.json else stdout_console()
    print_table([row], title=f"lowbit bench: {target.loaded.name}", console=console)
    if target.directory is not None:
        write_json(target.directory / BENCH_FILE, payload)
    if args.json:
        print_json(payload)
    return 0
