"""`lowbit export DIR|MODEL --gguf OUT.gguf`: write a model as a GGUF file for llama.cpp."""

from __future__ import annotations

import argparse
import os
from typing import Any

from lowbit import serving
from lowbit.cli._common import (
    Command,
    add_recipe_argument,
    add_target_argument,
    open_target,
    progress,
    step,
)
from lowbit.gguf import read_gguf
from lowbit.io import (
    EXPORT_TYPES,
    SourceParams,
    check_export_type,
    checkpoint_leaves,
    export_gguf,
    has_adapters,
)
from lowbit.models import decoder_config_from_gguf, gguf_param_map, smollm2_gguf_path
from lowbit.ops import logical_weights


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds this command's arguments to its sub-parser."""
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
    check_export_type(args.type)
    lines: list[str] = []
    streamed = _stream_source(args.target, args.recipe)
    if streamed is not None:
        with progress() as bar, step(bar, f"writing {args.gguf} one tensor at a time"):
            report = _export_streaming(args, *streamed, lines.append)
        _print_report(lines, report)
        return 0
    with progress() as bar:
        target = open_target(args.target, args.recipe, bar)
        config = getattr(target.loaded.model, "config", None)
        if target.loaded.kind != "lm" or not hasattr(config, "n_kv_heads"):
            raise ValueError(
                f"GGUF export writes Llama language models; {target.loaded.name!r} is not one"
            )
        rotation = target.loaded.rotation
        if rotation is not None and rotation.online:
            raise ValueError(
                f"recipe rotates the input of {', '.join(rotation.online)} online "
                f"(rotate={rotation.to_text()!r}), which llama.cpp does not do; export a recipe "
                "with rotate='hadamard:offline' (only the rotations fused into the weights)"
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
    _print_report(lines, report)
    return 0


def _print_report(lines: list[str], report: Any) -> None:
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


def _stream_source(target: str, recipe: str | None) -> tuple[str, str, bool] | None:
    """What `target` streams from, or None to export from memory: ``(kind, GGUF model file,
    keep blocks)`` for a checkpoint of a GGUF decoder without adapters (``"checkpoint"``), or
    a GGUF file with no recipe (floats), or ``gguf`` (its blocks kept) (``"gguf"``)."""
    if serving.is_checkpoint(target):
        if recipe is not None or has_adapters(target):
            return None  # refused by `open_target` / merged with the base in memory
        stored = serving.checkpoint_recipe(target)
        if stored is not None and stored.rotate is not None:
            return None  # a rotated model: its structure is the rotated one, in memory
        model = serving.checkpoint_metadata(target)[serving.META_MODEL]
        if model == "smollm2":
            model = str(smollm2_gguf_path())
        return ("checkpoint", model, True) if model.endswith(".gguf") else None
    if target.endswith(".gguf") and os.path.isfile(target):
        if recipe in (None, serving.FLOAT_RECIPE, serving.GGUF_RECIPE):
            return "gguf", target, recipe == serving.GGUF_RECIPE
    return None


def _export_streaming(args: argparse.Namespace, kind: str, model: str, keep: bool, log) -> Any:
    """`export_gguf` reading one leaf at a time from the checkpoint or the GGUF file."""
    source = read_gguf(model)  # read once: config, metadata and (from a GGUF file) tensors
    config = decoder_config_from_gguf(source)
    options = dict(config=config, type=args.type, source=source, strict=args.strict, log=log)
    if kind == "checkpoint":
        with checkpoint_leaves(args.target) as leaves:
            return export_gguf(leaves, args.gguf, **options)
    with SourceParams(source, gguf_param_map(config).get, quantized=keep) as params:
        return export_gguf(params, args.gguf, **options)


COMMAND = Command(
    "export",
    "export a checkpoint or a model to a GGUF file that llama.cpp, Ollama and LM Studio run",
    add_arguments,
    run,
)
