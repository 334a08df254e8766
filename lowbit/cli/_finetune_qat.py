"""`lowbit finetune MODEL --qat gguf:TYPE|gguf:MIX --text FILE --out DIR`: QAT onto a GGUF mix.

Trains MODEL onto the exact grids of a llama.cpp mix (``gguf:Q2_K``, ``gguf:Q3_K_M``,
``gguf:Q4_0``, ...: llama.cpp's per-tensor types), or of the GGML types a budget plan chose
(``gguf:plan.json`` from ``lowbit quantize MODEL --max-bytes N --target gguf --plan-out
plan.json``), distilled from its own float logits
(`lowbit.eval.qat_gguf`: block by block, then end to end on block scales and norms), and
writes DIR: a checkpoint whose quantized weights are the trained GGUF blocks (`lowbit export
DIR --gguf F` writes them as they are), ``loss.png`` and ``finetune.json`` (settings, the
types, the losses, the KL divergence to the float model before and after).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from lowbit import serving
from lowbit.cli._common import (
    META_KIND,
    META_MODEL,
    META_RECIPE,
    progress,
    settings_from_args,
    step,
    write_json,
)
from lowbit.eval import (
    QatGGUFSettings,
    default_training_text,
    plot_loss_curve,
    qat_gguf,
    read_text,
    recipe_types,
)
from lowbit.io import check_mix, save_checkpoint

FINETUNE_FILE = "finetune.json"
LOSS_PLOT = "loss.png"
_PREFIX = "gguf:"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``--qat`` arguments to `lowbit finetune`'s parser."""
    parser.add_argument(
        "--qat",
        metavar="gguf:TYPE|gguf:MIX|gguf:PLAN.json",
        help="quantization-aware training onto a llama.cpp mix's grids (gguf:Q2_K, "
        "gguf:Q3_K_M, gguf:Q4_0, ...) or a budget plan's GGML types (gguf:plan.json from "
        "lowbit quantize --max-bytes N --target gguf --plan-out plan.json), distilled from "
        "the float model, instead of LoRA",
    )
    defaults = QatGGUFSettings()
    parser.add_argument(
        "--windows",
        type=int,
        metavar="W",
        help=f"--qat: calibration windows of --seq-len tokens ({defaults.windows})",
    )
    parser.add_argument(
        "--block-steps",
        type=int,
        metavar="N",
        help=f"--qat: steps per layer ({defaults.block_steps})",
    )
    parser.add_argument(
        "--e2e-steps",
        type=int,
        metavar="N",
        help=f"--qat: end-to-end steps ({defaults.e2e_steps})",
    )


def parse_qat(text: str) -> str:
    """The llama.cpp mix (or plan file) of a ``--qat`` value; ValueError naming the flag and
    the forms."""
    if not str(text).lower().startswith(_PREFIX):
        raise ValueError(
            f"--qat {text!r}: accepted: gguf:TYPE, gguf:MIX or gguf:PLAN.json, e.g. gguf:Q3_K_M"
        )
    name = text[len(_PREFIX) :]
    if name.endswith(".json"):
        return name
    try:
        return check_mix(name)
    except ValueError as e:
        raise ValueError(f"--qat {text!r}: {e}") from None


def run(args: argparse.Namespace) -> int:
    """Runs ``lowbit finetune --qat``; returns the exit status (errors raise)."""
    mix = parse_qat(args.qat)
    # One --lr for the three groups; every flag left out keeps QatGGUFSettings' default.
    lr = {"weight_lr": "lr", "grid_lr": "lr", "norm_lr": "lr"}
    settings = settings_from_args(QatGGUFSettings, args, **lr)
    out = Path(args.out)
    label = f"{_PREFIX}{mix}"
    with progress() as bar:
        with step(bar, f"loading {args.model}"):
            loaded = serving.load_model(args.model)
        if loaded.kind != "lm" or not hasattr(loaded.model, "layer_inputs"):
            raise ValueError(f"--qat trains decoder language models; {loaded.name} is not one")
        text = read_text(args.text) if args.text else default_training_text()
        with step(bar, "tokenizing"):
            tokens = serving.as_numpy_tokens(loaded.tokenizer, text)
        types = None
        if mix.endswith(".json"):
            float_params = nnx.split(loaded.model)[1].to_pure_dict()
            types = recipe_types(serving.load_recipe(mix), float_params)
        with step(bar, f"QAT onto {mix}") as advance:
            total = loaded.model.config.n_layers * settings.block_steps + settings.e2e_steps
            done = [0]

            def on_step(phase: str, i: int, n: int, loss: float) -> None:
                done[0] += 1
                bar.update(bar.tasks[-1].id, description=f"QAT {phase}: loss {loss:.4f}")
                advance(done[0], total)

            start = time.perf_counter()
            result = qat_gguf(loaded.model, tokens, mix, settings, types=types, on_step=on_step)
            seconds = time.perf_counter() - start
        served = result.served()
        for leaf in jax.tree.leaves(served):
            if np.issubdtype(leaf.dtype, np.floating) and not np.isfinite(np.asarray(leaf)).all():
                raise FloatingPointError("QAT produced non-finite parameters; nothing written")
        metadata = {META_MODEL: loaded.spec, META_RECIPE: label, META_KIND: loaded.kind}
        with step(bar, f"writing {out}"):
            save_checkpoint(out, served, recipe=result.recipe, metadata=metadata)
            curve = [x for layer in result.block_losses for x in layer] + list(result.e2e_losses)
            if curve:
                plot_loss_curve(
                    curve, out / LOSS_PLOT, title=f"QAT {mix} on {loaded.name} (blocks, then KL)"
                )
    summary = {
        "model": loaded.spec,
        "qat": label,
        "windows": settings.windows,
        "seq_len": settings.seq_len,
        "batch": settings.batch,
        "block_steps": settings.block_steps,
        "e2e_steps": settings.e2e_steps,
        "learning_rate": lr,
        "types": result.types,
        "kl_before": result.kl_before,
        "kl_after": result.kl_after,
        "kl_tokens": result.kl_tokens,
        "block_losses": [list(x) for x in result.block_losses],
        "e2e_losses": list(result.e2e_losses),
        "seconds": seconds,
    }
    write_json(out / FINETUNE_FILE, summary)
    print(
        f"wrote {out}: {loaded.name} trained onto {mix} ({len(result.types)} weights); KL to "
        f"the float model {result.kl_before:.4f} -> {result.kl_after:.4f} nats/token on the "
        f"first {result.kl_tokens} calibration tokens, {seconds:.0f} s; export it with "
        f"lowbit export {out} --gguf F"
    )
    return 0
