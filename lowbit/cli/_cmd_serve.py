"""`lowbit serve DIR|MODEL`: an OpenAI-compatible HTTP server with continuous batching.

MODEL is anything `lowbit generate` takes, or a BERT encoder (``minilm``, a BERT checkpoint),
which serves ``/v1/embeddings`` only; the chat template and stop tokens come from the model as
for ``generate --chat``. The server answers ``/health`` with "loading" while it
compiles, then "ok". SIGTERM drains: running requests finish (up to ``--grace`` seconds), then
the process exits 0. See docs/serve.md.
"""

from __future__ import annotations

import argparse
import os
import sys

from lowbit.api import program_directory
from lowbit.cli._common import (
    Command,
    add_int8_activations_argument,
    add_language_model_arguments,
    chat_template,
    open_language_model,
    open_target,
    progress,
    resolve_kv_cache,
    settings_from_args,
    stop_ids,
)
from lowbit.ops import with_int8_activations


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds this command's arguments to its sub-parser."""
    add_language_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: the "
        "LOWBIT_API_KEY environment variable, else none)",
    )
    parser.add_argument(
        "--slots", type=int, default=8, metavar="N", help="requests decoded together (default 8)"
    )
    parser.add_argument(
        "--max-len",
        type=int,
        default=2048,
        metavar="N",
        help="KV cache tokens per slot: prompt plus answer (default 2048, at most the model's "
        "context; a bucket size: 2^k or 3 * 2^k)",
    )
    parser.add_argument(
        "--queue",
        type=int,
        default=64,
        metavar="N",
        help="requests that may wait for a slot; more get 429 (default 64)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="per-request deadline (default 600)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        metavar="N",
        help="largest request body accepted; larger ones get 413 without being read "
        "(default 1048576, 1 MiB)",
    )
    parser.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a client must send a request's headers within this long of connecting (or of "
        "the previous answer), and its body within this long of the headers; a slower one is "
        "dropped and never holds a slot (default 30)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long running requests may take to finish (default 30)",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=256,
        metavar="N",
        help="prompts of up to N tokens are prefilled in one pass, longer ones in chunks of N "
        "between the running requests' decode steps (a power of two >= 16; default 256)",
    )
    parser.add_argument(
        "--kv-memory",
        type=_size,
        default=None,
        metavar="SIZE",
        help="memory for the prefix cache: keys and values of earlier prompts, reused by "
        "requests that start with the same tokens (bytes, or with a K, M or G suffix; 0 turns "
        "it off; default: half of what the slots' KV cache takes)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=1,
        metavar="N",
        help="decode steps per compiled call while no request waits (1-8, default 1)",
    )
    parser.add_argument(
        "--speculate",
        metavar="ngram|MODEL",
        default=None,
        help="speculative decoding: 'ngram' guesses each greedy request's next tokens from "
        "its own prompt and answer (prompt lookup); a model of the same tokenizer (a name, "
        "GGUF file or checkpoint, opened with its own default: a GGUF runs its own blocks) "
        "guesses them as a draft model. The served "
        "model checks the guesses in one forward pass: the same tokens, faster when the "
        "guesses hold (default: off)",
    )
    parser.add_argument(
        "--speculate-tokens",
        type=int,
        default=8,
        metavar="K",
        help="tokens guessed per request and step with --speculate (1-8, default 8)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="run every decode step over all slots and prefill every prompt alone, so that a "
        "request's tokens never depend on which others run beside it, also for a float model "
        "or a mixture of experts (slower for a few clients; default: the busy rows only, "
        "waiting prompts together, which gives the same tokens on the CPU kernels)",
    )
    parser.add_argument(
        "--embeddings",
        action="store_true",
        help="also serve POST /v1/embeddings (mean-pooled final hidden states, normalized; "
        "inputs of up to --prefill-chunk tokens): compiles a few more programs at start. An "
        "encoder (minilm, a BERT checkpoint) always serves it, and only it",
    )
    add_int8_activations_argument(
        parser,
        help="quantize the activations of int8 / int4 / uint4 weights to int8 in the CPU "
        "kernels (as `lowbit generate --int8-activations`)",
    )


def _size(text: str) -> int:
    """``"512M"`` -> bytes (K, M, G: powers of 1024; a bare number is bytes)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    digits, unit = (text[:-1], text[-1].upper()) if text[-1:].isalpha() else (text, "")
    if unit and unit not in units or not digits.isdigit():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give bytes, or a number with K, M or G (e.g. 512M)"
        )
    return int(digits) * units.get(unit, 1)


def _draft_model(args: argparse.Namespace, spec: str, served: object) -> object:
    """``--speculate MODEL``: the draft model as ``lowbit serve MODEL`` would open it (a GGUF
    file runs its own blocks, a checkpoint its own recipe), with ``--int8-activations`` as
    the served one. ``--recipe`` is the served model's only: a float model's draft is then
    typically its own quantized file.

    Raises:
      ValueError: naming --speculate, for an encoder or another tokenizer.
    """
    from lowbit import server

    with progress() as bar:
        target = open_target(spec, None, bar)
    draft = target.loaded
    if draft.kind != "lm":
        raise ValueError(f"--speculate {spec}: {draft.name} is an encoder, not a draft model")
    if draft.tokenizer.get_vocab() != served.tokenizer.get_vocab():
        raise ValueError(
            f"--speculate {spec}: {draft.name}'s tokenizer is not {served.name}'s; a draft "
            "model must share the served model's tokenizer (the same tokens and ids)"
        )
    params = with_int8_activations(target.params) if args.int8_activations else target.params
    return server.DraftModel(draft.model, params)


def run(args: argparse.Namespace) -> int:
    """Runs the command with parsed `args`; returns the exit status (errors raise)."""
    # The server (starlette, uvicorn, llguidance: ~0.5 s, ~150 modules) loads for `serve` only,
    # not for every command.
    from lowbit import server

    if not 0 < args.port < 65536:
        raise ValueError(f"--port={args.port} must be in 1..65535")
    if args.timeout <= 0 or args.grace < 0:
        raise ValueError("--timeout must be > 0 and --grace >= 0")
    if args.max_body_bytes < 1 or not args.read_timeout > 0:
        raise ValueError(
            f"--max-body-bytes={args.max_body_bytes} must be >= 1 and "
            f"--read-timeout={args.read_timeout} > 0"
        )
    # --prefill-chunk is both the longest prompt prefilled in one pass and the chunk size.
    draft_spec = args.speculate if args.speculate not in (None, "ngram") else None
    speculate = "draft" if draft_spec else args.speculate
    config = settings_from_args(
        server.SchedulerConfig,
        argparse.Namespace(**{**vars(args), "speculate": speculate}),
        single_pass="prefill_chunk",
        chunk="prefill_chunk",
    )
    resolve_kv_cache(args.kv_cache, args.recipe)  # a bad --kv-cache fails before the load
    target, metadata, params = open_language_model(args, "serve", encoders=True)
    loaded = target.loaded
    encoder = loaded.kind != "lm"
    # An encoder keeps no cache: a GGUF file's float16 default is not asked of it.
    kv = resolve_kv_cache(args.kv_cache, args.recipe, None if encoder else args.target)
    if encoder and args.speculate is not None:
        raise ValueError(f"--speculate: {loaded.name} is an encoder; it generates no tokens")
    draft = None if draft_spec is None else _draft_model(args, draft_spec, loaded)
    if encoder and kv is not None:
        raise ValueError(f"--kv-cache: {loaded.name} is an encoder; it keeps no KV cache")
    template = None
    try:
        template = None if encoder else chat_template(metadata)
    except ValueError as err:
        print(f"lowbit serve: no chat endpoint ({err})", file=sys.stderr)
    scheduler = server.Scheduler(
        loaded.model, params, kv, config, program_dir=program_directory(), draft=draft
    )
    served = server.ServedModel(
        name=loaded.name,
        tokenizer=loaded.tokenizer,
        chat_template=template,
        stop_ids=frozenset() if encoder else frozenset(stop_ids(loaded, metadata)),
        scheduler=scheduler,
        api_key=args.api_key or os.environ.get("LOWBIT_API_KEY") or None,
        request_timeout=args.timeout,
        max_body_bytes=args.max_body_bytes,
        read_timeout=args.read_timeout,
    )
    if encoder:
        serves = f"embeddings of up to {scheduler.max_embedding_tokens} tokens (an encoder)"
    else:
        serves = (
            f"kv cache {kv.to_text() if kv else 'float'}; {scheduler.config.slots} slots of "
            f"{scheduler.config.max_len} tokens"
        )
    print(
        f"lowbit serve: {loaded.name} ({target.recipe}) on http://{args.host}:{args.port}, "
        f"{serves}; compiling (GET /health says ok when ready)",
        file=sys.stderr,
        flush=True,
    )
    server.run(served, host=args.host, port=args.port, grace=args.grace)
    return 0


COMMAND = Command(
    "serve",
    "serve a language model over an OpenAI-compatible HTTP API (completions, chat, streaming, "
    "embeddings) with continuous batching, or an encoder's embeddings",
    add_arguments,
    run,
)
