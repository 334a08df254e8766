"""`lowbit quantize MODEL --recipe R --out DIR`: quantize a model and write a checkpoint.

With ``--bits B`` or ``--max-bytes N`` instead of a recipe, a format per weight is chosen under
that size budget (`lowbit.cli._budget`). An output ending in ``.gguf`` is written as a GGUF file
(in memory) instead of a checkpoint directory.

A GGUF file with a recipe that selects weights by path (or ``gguf``) streams through
`lowbit.io.convert_checkpoint`, one tensor at a time, so models larger than memory convert;
the checkpoint is byte for byte the one the in-memory path writes. With ``--by-layer``, a GGUF
file or Hugging Face decoder directory with a data-driven recipe (GPTQ, AWQ, SmoothQuant)
streams one layer at a time, calibrated on the `--calibration` text.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from flax import nnx
from tokenizers import Tokenizer

from lowbit import serving
from lowbit.cli._budget import add_budget_arguments, budget_requested, run_budget, write_output
from lowbit.cli._common import (
    META_KIND,
    META_MODEL,
    META_RECIPE,
    Command,
    add_calibration_arguments,
    add_recipe_argument,
    calibration_sequences,
    print_rotation,
    progress,
    quantize_with_progress,
    step,
)
from lowbit.eval import float32_bytes, lm_calibration_batches, param_bytes
from lowbit.gguf import read_gguf
from lowbit.io import check_save_path, convert_checkpoint, save_checkpoint, streaming_problem
from lowbit.models import (
    HF_MODEL_TYPES,
    Decoder,
    decoder_config_from_gguf,
    decoder_config_from_hf,
    gguf_param_map,
    hf_param_map,
    read_hf_config,
    tokenizer_from_gguf,
)
from lowbit.ops import logical_weights


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
        help="a preset (see `lowbit recipes`), a recipe JSON file (a plan from --plan-out), or "
        "gguf (GGUF models only); or give a size budget instead (--bits / --max-bytes)",
    )
    parser.add_argument(
        "--out",
        required=True,
        metavar="DIR|FILE.gguf",
        help="checkpoint directory to write, or a .gguf file (Llama-family models)",
    )
    add_calibration_arguments(parser)
    parser.add_argument(
        "--by-layer",
        action="store_true",
        help="a .gguf file or Hugging Face decoder directory with a data-driven recipe (GPTQ, "
        "AWQ, SmoothQuant): read, calibrate, quantize and write one layer at a time, so a "
        "model larger than memory converts (each layer calibrated behind the quantized ones)",
    )
    add_budget_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Runs the command with parsed `args`; returns the exit status (errors raise)."""
    if budget_requested(args):
        return run_budget(args)
    serving.check_recipe_spec(args.recipe)
    if str(args.out).endswith(".gguf"):
        return _run_to_gguf(args)
    check_save_path(args.out)  # before the work, not after: refuse a directory that is not ours
    if getattr(args, "by_layer", False) or _streams(args.model, args.recipe):
        return _run_streaming(args)
    with progress() as bar:
        loaded, float_params, params, recipe = _load_and_quantize(bar, args)
        label = serving.recipe_label(args.recipe)
        metadata = {META_MODEL: loaded.spec, META_RECIPE: label, META_KIND: loaded.kind}
        with step(bar, f"writing {args.out}"):
            save_checkpoint(args.out, serving.storable(params), recipe=recipe, metadata=metadata)
    size, reference = param_bytes(params), float32_bytes(float_params)
    print(
        f"wrote {args.out}: {loaded.name} with recipe {label}, {size / 1e6:.2f} MB "
        f"({size / reference:.3f} of float32 {reference / 1e6:.2f} MB)"
    )
    return 0


def _load_and_quantize(bar, args: argparse.Namespace):
    """``(loaded, float_params, params, recipe)``: the model, rotated as the recipe says (if it
    does, the rotation reported), its float params, and the params quantized by the recipe."""
    with step(bar, f"loading {args.model}"):
        loaded = serving.load_model(args.model)
    loaded = serving.rotated_for_spec(loaded, args.recipe)
    print_rotation(bar, loaded)
    float_params = nnx.split(loaded.model)[1]
    with step(bar, f"quantizing with {args.recipe}"):
        params, recipe = quantize_with_progress(bar, loaded, float_params, args.recipe, args)
    return loaded, float_params, params, recipe


def _run_to_gguf(args: argparse.Namespace) -> int:
    """`run` with a ``.gguf`` output: quantize in memory, write each weight as the GGML type
    its format maps onto (a plan's choices; other formats are re-encoded as Q8_0)."""
    with progress() as bar:
        loaded, _, params, recipe = _load_and_quantize(bar, args)
        label = serving.recipe_label(args.recipe)
        write_output(bar, args, loaded, logical_weights(params), recipe, label)
    return 0


def _streams(model: str, spec: str) -> bool:
    """Whether `model` is converted one tensor at a time: a GGUF file (with ``gguf`` or a
    recipe whose rules all select by path, `lowbit.io.streaming_problem`), or a Hugging Face
    decoder directory with such a recipe whose tensors each fill one parameter as stored
    (not Gemma's ``1 + w`` norms or per-expert tensors, which are stacked in memory)."""
    path = Path(model)
    if path.suffix == ".gguf" and path.is_file():
        return spec == serving.GGUF_RECIPE or streaming_problem(serving.load_recipe(spec)) is None
    if spec == serving.GGUF_RECIPE or _hf_stream_map(path) is None:
        return False
    return streaming_problem(serving.load_recipe(spec)) is None


def _hf_stream_map(path: Path) -> dict | None:
    """The name map of a Hugging Face decoder directory when every tensor streams, else None."""
    if not (path.is_dir() and (path / "config.json").is_file()):
        return None
    config_json = read_hf_config(path)
    if config_json.get("model_type") not in HF_MODEL_TYPES:
        return None
    mapping = hf_param_map(decoder_config_from_hf(config_json, path / "config.json"))
    plain = all(
        not isinstance(m, tuple) and not m.offset and m.expert is None and m.part is None
        for m in mapping.values()
    )
    return mapping if plain else None


def _run_streaming(args: argparse.Namespace) -> int:
    """`run` for a GGUF file or a Hugging Face directory: read, quantize and write one tensor
    at a time, so a model larger than memory converts (the checkpoint is the one the
    in-memory path writes)."""
    path = Path(args.model).resolve()
    keep = args.recipe == serving.GGUF_RECIPE
    recipe = None if keep else serving.load_recipe(args.recipe)
    label = serving.recipe_label(args.recipe)
    metadata = {META_MODEL: str(path), META_RECIPE: label, META_KIND: "lm"}
    by_layer = getattr(args, "by_layer", False)
    if path.is_dir():
        # Float weights quantized from float32, as the in-memory path loads them.
        name_map, options = _hf_stream_map(path), dict(dtype=np.float32)
        if name_map is None:
            raise ValueError(
                f"--by-layer: {args.model!r} is not a Hugging Face decoder directory whose "
                "tensors each fill one parameter as stored (Gemma's 1 + w norms and "
                "per-expert tensors are stacked in memory): load it without --by-layer"
            )
        config = _hf_config(path) if by_layer else None
        tokenizer_of = lambda: Tokenizer.from_file(str(path / "tokenizer.json"))  # noqa: E731
    elif path.suffix == ".gguf" and path.is_file():
        gguf_file = read_gguf(path)
        config = decoder_config_from_gguf(gguf_file)
        tokenizer_of = lambda: tokenizer_from_gguf(gguf_file.metadata)  # noqa: E731
        name_map = gguf_param_map(config)
        # A recipe quantizes the float weights as the in-memory path does, from the file's
        # values; `gguf` keeps the file's blocks.
        options = dict(quantized=keep)
    else:
        raise ValueError(
            f"--by-layer: MODEL {args.model!r} must be a .gguf file or a Hugging Face decoder "
            "directory"
        )
    if by_layer:
        if recipe is None:
            raise ValueError("--by-layer needs a recipe to quantize with, not --recipe gguf")
        # The calibration windows of --calibration in the model file's own tokenizer.
        sequences = calibration_sequences(args)
        batches = lm_calibration_batches(tokenizer_of(), args.calibration, sequences)
        options.update(model=config, calibration=batches)
    if recipe is not None and recipe.shapes is not None and config is not None:
        _check_plan_shapes(recipe, config)
    with progress() as bar:
        with step(bar, f"converting {args.model} with {args.recipe}") as advance:
            report = convert_checkpoint(
                path,
                args.out,
                recipe,
                name_map=name_map,
                metadata=metadata,
                on_tensor=lambda done, total, _: advance(done, total),
                **options,
            )
    size, reference = report.param_bytes, report.float32_bytes
    name = path.stem if path.is_file() else path.name
    print(
        f"wrote {args.out}: {name} with recipe {label}, {size / 1e6:.2f} MB "
        f"({size / reference:.3f} of float32 {reference / 1e6:.2f} MB), one "
        f"{'layer' if by_layer else 'tensor'} at a time"
    )
    return 0


def _hf_config(path: Path):

    return decoder_config_from_hf(read_hf_config(path), path / "config.json")


def _check_plan_shapes(recipe, config) -> None:
    """A plan's recorded shapes against the decoder `config` describes (no weight is read).

    Raises:
      ValueError: naming the first planned weight this model lacks or shapes otherwise.
    """
    recipe.check_shapes(nnx.to_pure_dict(nnx.state(Decoder.abstract(config), nnx.Param)))


COMMAND = Command(
    "quantize",
    "quantize a model by a recipe and write a checkpoint directory",
    add_arguments,
    run,
)
