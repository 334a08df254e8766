"""`lowbit quantize MODEL --recipe R --out DIR`: quantize a model and write a checkpoint.

A GGUF file with a recipe that selects weights by path (or ``gguf``) streams through
`lowbit.io.convert_checkpoint`, one tensor at a time, so models larger than memory convert;
the checkpoint is byte for byte the one the in-memory path writes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lowbit import serving
from lowbit.cli._common import (
    META_KIND,
    META_MODEL,
    META_RECIPE,
    add_calibration_arguments,
    add_recipe_argument,
    progress,
    quantize_with_progress,
    step,
)
from lowbit.eval import float32_bytes, param_bytes

NAME = "quantize"
HELP = "quantize a model by a recipe and write a checkpoint directory"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds this command's arguments to its sub-parser."""
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="smollm2 | minilm | path to a .gguf (Llama) or .safetensors (BERT) file; a .gguf "
        "file is converted one tensor at a time (larger than memory) when the recipe is gguf "
        "or selects weights by path only",
    )
    add_recipe_argument(
        parser,
        help="a preset (see `lowbit recipes`), a recipe JSON file, or gguf (GGUF models only)",
        required=True,
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory to write")
    add_calibration_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Runs the command with parsed `args`; returns the exit status (errors raise)."""
    from flax import nnx

    from lowbit.io import check_save_path, save_checkpoint

    serving.check_recipe_spec(args.recipe)
    check_save_path(args.out)  # before the work, not after: refuse a directory that is not ours
    if _streams(args.model, args.recipe):
        return _run_streaming(args)
    with progress() as bar:
        with step(bar, f"loading {args.model}"):
            loaded = serving.load_model(args.model)
        float_params = nnx.split(loaded.model)[1]
        with step(bar, f"quantizing with {args.recipe}"):
            params, recipe = quantize_with_progress(bar, loaded, float_params, args.recipe, args)
        label = serving.recipe_label(args.recipe)
        metadata = {META_MODEL: loaded.spec, META_RECIPE: label, META_KIND: loaded.kind}
        with step(bar, f"writing {args.out}"):
            save_checkpoint(args.out, params, recipe=recipe, metadata=metadata)
    size, reference = param_bytes(params), float32_bytes(float_params)
    print(
        f"wrote {args.out}: {loaded.name} with recipe {label}, {size / 1e6:.2f} MB "
        f"({size / reference:.3f} of float32 {reference / 1e6:.2f} MB)"
    )
    return 0


def _streams(model: str, spec: str) -> bool:
    """Whether `model` is converted one tensor at a time: a GGUF file, with ``gguf`` or a
    recipe whose rules all select by path (`lowbit.io.streaming_problem`)."""
    from lowbit.io import streaming_problem

    if not (model.endswith(".gguf") and Path(model).is_file()):
        return False
    return spec == serving.GGUF_RECIPE or streaming_problem(serving.load_recipe(spec)) is None


def _run_streaming(args: argparse.Namespace) -> int:
    """`run` for a GGUF file: read, quantize and write one tensor at a time, so a model
    larger than memory converts (the checkpoint is the one the in-memory path writes)."""
    from lowbit.io import convert_checkpoint
    from lowbit.models import decoder_config_from_gguf, gguf_param_map, read_gguf

    path = Path(args.model).resolve()
    keep = args.recipe == serving.GGUF_RECIPE
    recipe = None if keep else serving.load_recipe(args.recipe)
    label = serving.recipe_label(args.recipe)
    metadata = {META_MODEL: str(path), META_RECIPE: label, META_KIND: "lm"}
    with progress() as bar:
        with step(bar, f"converting {args.model} with {args.recipe}") as advance:
            report = convert_checkpoint(
                path,
                args.out,
                recipe,
                name_map=gguf_param_map(decoder_config_from_gguf(read_gguf(path))),
                # A recipe quantizes the float weights as the in-memory path does, from the
                # file's values; `gguf` keeps the file's blocks.
                quantized=keep,
                metadata=metadata,
                on_tensor=lambda done, total, _: advance(done, total),
            )
    size, reference = report.param_bytes, report.float32_bytes
    print(
        f"wrote {args.out}: {path.stem} with recipe {label}, {size / 1e6:.2f} MB "
        f"({size / reference:.3f} of float32 {reference / 1e6:.2f} MB), one tensor at a time"
    )
    return 0
