"""`lowbit bench DIR|MODEL`: stored size and prefill / decode throughput."""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from lowbit.cli._common import measuring_command, open_measured, progress, report_row, step
from lowbit.eval import ModelSession
from lowbit.models import init_kv_cache

BENCH_FILE = "bench.json"


def _add_decode_steps(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--decode-steps", type=int, default=16, metavar="N", help="tokens per timed decode run"
    )


def run(args: argparse.Namespace) -> int:
    """Runs the command with parsed `args`; returns the exit status (errors raise)."""
    if args.decode_steps < 1:
        raise ValueError(f"--decode-steps={args.decode_steps} must be >= 1")
    with progress() as bar:
        measured = open_measured(args, bar)
        target, kv = measured.target, measured.kv_cache
        session = ModelSession(target.loaded, kv_cache=kv)
        with step(bar, f"timing {target.recipe} (compile, warm up, then timed runs)"):
            speed = session.speed(target.params, decode_steps=args.decode_steps)
    decode = speed.decode_tokens_per_s if target.loaded.kind == "lm" else None
    row = dataclasses.replace(
        session.row(measured.label, target.params, measure_quality=False),
        prefill_tokens_per_s=speed.prefill_tokens_per_s,
        decode_tokens_per_s=decode,
    )
    payload = {
        **row.to_json(),
        "prefill_tokens": speed.prefill_tokens,
        "decode_steps": speed.decode_steps,
        "int8_activations": measured.int8_activations,
    }
    notes = ()
    if target.loaded.kind == "lm":
        cache = _cache_memory(target.loaded.model, kv, speed.prefill_tokens)
        payload.update(cache)
        notes = (
            f"KV cache ({cache['kv_cache']}) for {speed.prefill_tokens} tokens, batch 1: "
            f"{cache['kv_cache_bytes'] / 2**20:.2f} MiB, {cache['kv_cache_ratio']:.3f}x float32",
        )
    report_row(row, payload, target, args, file=BENCH_FILE, notes=notes)
    return 0


def _cache_memory(model, kv, tokens: int) -> dict:
    """Bytes of a batch-1 KV cache of `tokens` slots, against a float32 cache."""

    def nbytes(kv_cache):
        shapes = jax.eval_shape(
            lambda: init_kv_cache(model.config, 1, tokens, jnp.float32, kv_cache)
        )
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))

    used, f32 = nbytes(kv), nbytes(None)
    return {
        "kv_cache": kv.to_text() if kv else "float32",
        "kv_cache_bytes": used,
        "kv_cache_ratio": used / f32,
    }


COMMAND = measuring_command(
    "bench",
    "measure stored size and throughput: prefill tokens/s (512 tokens, batch 1) and KV-cache "
    "decode tokens/s (batch 1) for language models, embedded tokens/s for encoders",
    _add_decode_steps,
    run,
)
