"""`lowbit generate DIR|MODEL --prompt TEXT`: stream a language model's continuation.

One prompt streams its continuation to stdout. Several (``--prompt`` repeated, or
``--prompts-file`` with one per line) run as one batch (left-padded, one compiled loop) and
print each continuation when the batch is done. ``--json`` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import sys
import time

from lowbit.api import program_directory
from lowbit.cli._common import (
    Command,
    add_int8_activations_argument,
    add_json_argument,
    add_language_model_arguments,
    chat_template,
    open_language_model,
    print_json,
    resolve_kv_cache,
    stop_ids,
)
from lowbit.models import Sampling, generate_tokens, stream_tokens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds this command's arguments to its sub-parser."""
    add_language_model_arguments(parser)
    parser.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="a prompt text; repeat for a batch of prompts",
    )
    parser.add_argument(
        "--prompts-file",
        metavar="FILE",
        help="a UTF-8 text file with one prompt per line (blank lines skipped), run as a batch",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt in the model's chat template (from the GGUF metadata)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=128, metavar="N", help="at most N new tokens"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)"
    )
    parser.add_argument("--top-k", type=int, default=None, metavar="K", help="top-k sampling")
    parser.add_argument(
        "--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling, in (0, 1]"
    )
    parser.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling")
    add_int8_activations_argument(parser)
    add_json_argument(
        parser,
        help="print one JSON object (prompts, continuations, token counts, seconds) as the only "
        "line on stdout, or the error as one",
    )


def _prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as err:
            raise ValueError(
                f"--prompts-file {args.prompts_file}: not UTF-8 text ({err})"
            ) from None
        lines = [line.strip() for line in text.splitlines()]
        from_file = [line for line in lines if line]
        if not from_file:
            raise ValueError(f"--prompts-file {args.prompts_file} holds no prompt (no text lines)")
        prompts += from_file
    if not prompts:
        raise ValueError("give a prompt: --prompt TEXT (repeatable) or --prompts-file FILE")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i + 1} is empty; give the text to continue")
    return prompts


class _TextStream:
    """Prints the decoded text of a growing token list, holding back incomplete characters."""

    def __init__(self, tokenizer, out):
        self.tokenizer = tokenizer
        self.out = out
        self.ids: list[int] = []
        self.printed = 0

    def add(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a multi-byte character split across tokens
            return
        self.out.write(text[self.printed :])
        self.out.flush()
        self.printed = len(text)

    def finish(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        self.out.write(text[self.printed :] + "\n")
        self.out.flush()


def run(args: argparse.Namespace) -> int:
    """Runs the command with parsed `args`; returns the exit status (errors raise)."""
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    prompts = _prompts(args)
    kv = resolve_kv_cache(args.kv_cache, args.recipe, args.target)
    target, metadata, params = open_language_model(args, "generate")
    loaded = target.loaded
    if args.chat:
        template = chat_template(metadata)
        prompts = [template(p) for p in prompts]
    tokenizer = loaded.tokenizer
    ids = [tokenizer.encode(p).ids for p in prompts]
    for i, row in enumerate(ids):
        if not row:
            raise ValueError(f"prompt {i + 1} encodes to no tokens")
    stops = stop_ids(loaded, metadata)
    options = dict(
        params=params,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        key=args.seed,
        stop_ids=stops,
        kv_cache=kv,
        program_dir=program_directory(),
    )
    summary = f"recipe {target.recipe}; kv cache {kv.to_text() if kv else 'float'}"
    if args.int8_activations:
        summary += "; int8 activations"
    if len(prompts) > 1 or args.json:
        start = time.perf_counter()
        result = generate_tokens(loaded.model, ids, **options)
        seconds = time.perf_counter() - start
        texts = [tokenizer.decode(row, skip_special_tokens=True) for row in result.tokens]
        if args.json:
            print_json(
                {
                    "completions": [
                        {"prompt": p, "text": t, "new_tokens": len(r), "stopped": s}
                        for p, t, r, s in zip(
                            prompts, texts, result.tokens, result.stopped, strict=True
                        )
                    ],
                    "prompt_tokens": result.prompt_lengths,
                    "seconds": seconds,
                    "recipe": str(target.recipe),
                    "kv_cache": kv.to_text() if kv else "float",
                    "int8_activations": bool(args.int8_activations),
                }
            )
        else:
            for i, (prompt, text) in enumerate(zip(prompts, texts, strict=True)):
                print(f"--- prompt {i + 1}: {prompt}")
                print(text)
            new = sum(len(r) for r in result.tokens)
            print(
                f"[{len(prompts)} prompts, {new} new tokens in {seconds:.2f} s including "
                f"compilation; {summary}]",
                file=sys.stderr,
            )
        return 0
    stream = _TextStream(tokenizer, sys.stdout)
    start = time.perf_counter()
    interrupted = False
    try:
        for new in stream_tokens(loaded.model, ids, **options):
            row = []
            for t in new[0]:
                if t < 0 or int(t) in stops:
                    break
                row.append(int(t))
            stream.add(row)
    except KeyboardInterrupt:
        interrupted = True
    stream.finish()
    seconds = time.perf_counter() - start
    n = len(stream.ids)
    note = "interrupted; " if interrupted else ""
    print(
        f"[{note}{n} tokens in {seconds:.2f} s including compilation; "
        f"prompt {len(ids[0])} tokens; {summary}]",
        file=sys.stderr,
    )
    return 130 if interrupted else 0


COMMAND = Command(
    "generate",
    "generate text from a language model (a checkpoint, or smollm2 | a .gguf file with "
    "--recipe), streamed to stdout as it is produced",
    add_arguments,
    run,
)
