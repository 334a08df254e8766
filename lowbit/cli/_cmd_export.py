"""`lowbit export DIR|MODEL --gguf OUT.gguf`: write a model as a GGUF file for llama.cpp."""

from __future__ import annotations

import argparse

from lowbit.cli._common import (
    add_recipe_argument,
    add_target_argument,
    open_target,
    progress,
    step,
)
from lowbit.ops import logical_weights

NAME = "export"
HELP = "export a checkpoint or a model to a GGUF file that llama.cpp, Ollama and LM Studio run"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds this command's arguments to its sub-parser."""
    from lowbit.io import EXPORT_TYPES

    add_target_argument(parser, "smollm2 | a decoder .gguf file (any supported architecture)")
    parser.add_argument("--gguf", required=True, metavar="OUT.gguf", help="the file to write")
    parser.add_argument(
        "--type",
        metavar="TYPE",
        help="GGUF type for weights that do not map directly onto one: "
        + ", ".join(EXPORT_TYPES)
        + " (default: keep quantized weights, the rest Q8_0; floats F32)",
    )
    add_recipe_argument(parser)
    parser.add_argument(
        "--strict",
        action="store_true",
        help="fail instead of falling back to another type when a tensor's rows are not whole "
        "blocks of the requested type",
    )


def run(args: argparse.Namespace) -> int:
    """Runs the command with parsed `args`; returns the exit status (errors raise)."""
    from lowbit.io import export_gguf
    from lowbit.io._gguf_export import check_type

    check_type(args.type)
    lines: list[str] = []
    with progress() as bar:
        target = open_target(args.target, args.recipe, bar)
        config = getattr(target.loaded.model, "config", None)
        if target.loaded.kind != "lm" or not hasattr(config, "n_kv_heads"):
            raise ValueError(
                f"GGUF export writes Llama language models; {target.loaded.name!r} is not one"
            )
        with step(bar, f"writing {args.gguf}"):
            report = export_gguf(
                logical_weights(target.params),
                args.gguf,
                config=config,
                type=args.type,
                source=target.loaded.gguf_path,
                strict=args.strict,
                log=lines.append,
            )
    for line in lines:
        print(line)
    kinds = {}
    for note in report.tensors:
        kinds[note.ggml_type] = kinds.get(note.ggml_type, 0) + 1
    summary = ", ".join(f"{n} {t}" for t, n in sorted(kinds.items()))
    direct = sum(n.how == "direct" for n in report.tensors)
    print(
        f"wrote {report.path}: {report.nbytes / 1e6:.2f} MB, {len(report.tensors)} tensors "
        f"({summary}); {direct} written directly without requantizing"
    )
    return 0
