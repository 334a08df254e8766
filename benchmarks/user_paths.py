"""The paths users write, timed against float32 and the prepared path, on every ISA path.

The README's code (``lowbit.quantize(params, recipe)`` then ``jax.jit(lowbit.run(fn))``), the
NNX path (``quantize_model`` then ``nnx.split`` and ``jax.jit(lowbit.run(...))``), the explicit
``lowbit.prepare`` path, and logical QArrays (``kernel_layouts=False``: what the README
path gave before weights were laid out at quantize time) on a linear layer K = N = 4096 at
M in {1, 8, 64, 512}; then the MLP anchor's int4 decode through the NNX path beside torchao's
int4 CPU path in the same process (when torch and torchao import: `make bench-env`).

Each instruction-set path this CPU has (AVX2 and up) is timed in turn (`lowbit.kernels.set_isa`;
``LOWBIT_CPU_ISA`` forces one from the shell). Run with `python -m benchmarks user_paths`.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import lowbit
from benchmarks._machine import cpu_model
from benchmarks._timing import best_time, best_times
from lowbit import kernels

K = 4096
BATCHES = (1, 8, 64, 512)
PRESETS = {
    "int4 g128 (int4_weight_only)": "int4_weight_only",
    "int8 weight-only": "int8_weight_only",
    "w8a8": "int8_dynamic_activation_int8_weight",
}
PATHS = ("README", "nnx.split + jit", "prepared", "logical (before)")
MLP = (1024, 4096, 4)  # d_model, d_ffn, layers (up and down per layer)
if os.environ.get("LOWBIT_BENCH_SMOKE", "") not in ("", "0"):
    K, BATCHES, MLP = 512, (1, 8), (256, 512, 2)


def _time(fn: Callable[[], object]) -> float:
    return best_time(fn, min_seconds=0.3, min_reps=5, max_reps=15)


def _paths(w: jax.Array, preset: str, x_example: jax.Array) -> dict[str, Callable]:
    """Path name -> fn(x) for one weight and preset, each built as a user would build it."""
    forward = lambda p, x: x @ p["proj"]["kernel"]
    params = {"proj": {"kernel": w}}
    readme = jax.jit(lowbit.run(forward))
    q_readme = lowbit.quantize(params, preset)
    q_logical = lowbit.quantize(params, preset, kernel_layouts=False)
    q_prepared = lowbit.prepare(q_logical, forward, x_example)

    layer = nnx.Linear(w.shape[0], w.shape[1], use_bias=False, rngs=nnx.Rngs(0))
    layer.kernel.value = w
    graphdef, state = nnx.split(lowbit.quantize_model(layer, preset))
    nnx_fn = jax.jit(lowbit.run(lambda s, x: nnx.merge(graphdef, s)(x)))
    return {
        "README": lambda x: readme(q_readme, x),
        "nnx.split + jit": lambda x: nnx_fn(state, x),
        "prepared": lambda x: readme(q_prepared, x),
        "logical (before)": lambda x: readme(q_logical, x),
    }


def _measure_linear(rng: np.random.Generator) -> dict[tuple[str, str, int], float]:
    """{(preset label, path, M): seconds}, plus ("float32", "", M)."""
    w = jnp.asarray(rng.standard_normal((K, K), dtype=np.float32) / K**0.5)
    dot = jax.jit(jnp.dot)
    out: dict[tuple[str, str, int], float] = {}
    xs = {m: jnp.asarray(rng.standard_normal((m, K), dtype=np.float32)) for m in BATCHES}
    paths = {label: _paths(w, preset, xs[1]) for label, preset in PRESETS.items()}
    for m in BATCHES:
        # Every path and the float baseline of one M interleaved (`best_times`): the paths
        # run the same kernels, so only interleaving keeps load drift out of their ratios.
        fns = {("float32", "", m): lambda m=m: dot(xs[m], w)}
        for label, by_path in paths.items():
            for path, fn in by_path.items():
                fns[(label, path, m)] = lambda fn=fn, m=m: fn(xs[m])
        out.update(best_times(fns, min_seconds=0.3, min_reps=5, max_reps=15))
        for label, by_path in paths.items():
            print(
                f"[user_paths] {kernels.status().split(',')[0]} {label} M={m}: "
                + ", ".join(f"{p} {out[(label, p, m)] * 1e3:.2f} ms" for p in by_path)
                + f", f32 {out[('float32', '', m)] * 1e3:.2f} ms",
                flush=True,
            )
    return out


class _MLP(nnx.Module):
    def __init__(self, d: int, f: int, layers: int, rngs: nnx.Rngs):
        self.up = nnx.List([nnx.Linear(d, f, use_bias=False, rngs=rngs) for _ in range(layers)])
        self.down = nnx.List([nnx.Linear(f, d, use_bias=False, rngs=rngs) for _ in range(layers)])

    def __call__(self, x):
        for up, down in zip(self.up, self.down, strict=True):
            x = down(jax.nn.silu(up(x)))
        return x


def _measure_mlp(rng: np.random.Generator) -> dict[str, float | None]:
    """Decode (M = 1) seconds per token: float32 and int4 g128 through the NNX path, and
    torchao's int4 CPU path when importable."""
    d, f, layers = MLP
    model = _MLP(d, f, layers, nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((1, d), dtype=np.float32))
    graphdef, state = nnx.split(model)
    float_fn = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    qgraph, qstate = nnx.split(lowbit.quantize_model(model, "int4_weight_only"))
    int4_fn = jax.jit(lowbit.run(lambda s, x: nnx.merge(qgraph, s)(x)))
    out: dict[str, float | None] = {
        "float32 (jax.jit)": _time(lambda: float_fn(state, x)),
        "lowbit int4 g128 (nnx.split + jit)": _time(lambda: int4_fn(qstate, x)),
        "torchao int4 g128 (torch.compile)": None,
    }
    from benchmarks import _torchao

    if _torchao.load() is not None:
        tfn, tin = _torchao.build("torchao int4 g128", [(d, f), (f, d)] * layers)
        tx = tin(1)
        out["torchao int4 g128 (torch.compile)"] = _time(lambda: tfn(tx))
    return out


def _isas() -> list[str]:
    """The paths to time: AVX2 and up (the portable one is not a serving path), or the one
    LOWBIT_CPU_ISA forces."""
    if os.environ.get("LOWBIT_CPU_ISA"):
        return [kernels.status().split("isa=")[1].split()[0]]
    return [isa for isa in kernels.supported_isas() if isa != "scalar"]


def run() -> str:
    rng = np.random.default_rng(0)
    today = datetime.date.today().isoformat()
    lines = [
        "## User paths: the README's code at prepared speed",
        "",
        f"`python -m benchmarks user_paths`, {today}, {cpu_model()}, {os.cpu_count()} cores;"
        f" ISA paths this CPU has: {', '.join(kernels.supported_isas()) or 'none (no kernels)'}."
        f" Linear K = N = {K}, float32 activations, best wall time of up to 15 calls, ms; the"
        " paths and the float32 baseline of one M timed interleaved (rounds in shuffled order,"
        " each call timed after an untimed one)."
        " README: `lowbit.quantize(params, preset)` + `jax.jit(lowbit.run(fn))`; nnx: "
        "`quantize_model` + `nnx.split` + `jax.jit(lowbit.run(...))`; prepared: "
        "`lowbit.prepare` on the logical QArrays; logical: `kernel_layouts=False`, the layout"
        " built inside every call (what the README path ran before). Ratio: prepared time / path"
        " time (>= 0.9 is the target; above 1 is faster). The float32 baseline is XLA's GEMM as"
        " this CPU runs it in every ISA table: lowbit's ISA path is forced, XLA's GEMM is not"
        " (on an AVX-512 CPU it is XNNPACK's AVX-512 kernel, 32 registers, also under"
        " `XLA_FLAGS=--xla_cpu_max_isa=AVX2`), so the `avx2` table's 'slower than float' compares"
        " AVX2 kernels with an AVX-512 GEMM an AVX2-only CPU would not run.",
    ]
    if not kernels.available():
        return "\n".join([*lines, "", f"Not measured: {kernels.status()}"])
    targets = []
    start = kernels.status().split("isa=")[1].split()[0]
    try:
        for isa in _isas():
            kernels.set_isa(isa)
            res = _measure_linear(rng)
            lines += ["", f"### ISA path `{isa}`", ""]
            header = "| weights | path | " + " | ".join(f"M = {m}" for m in BATCHES) + " |"
            lines += [header, "|---|---|" + "---:|" * len(BATCHES)]
            cells = [f"{res[('float32', '', m)] * 1e3:.2f}" for m in BATCHES]
            lines.append("| float32 | `jnp.dot` | " + " | ".join(cells) + " |")
            for label in PRESETS:
                for path in PATHS:
                    cells = []
                    for m in BATCHES:
                        t, p = res[(label, path, m)], res[(label, "prepared", m)]
                        f32 = res[("float32", "", m)]
                        cells.append(f"{t * 1e3:.2f} ({p / t:.2f}x prep, {f32 / t:.2f}x f32)")
                    lines.append(f"| {label} | {path} | " + " | ".join(cells) + " |")
                for path in ("README", "nnx.split + jit"):
                    worst = min(
                        res[(label, "prepared", m)] / res[(label, path, m)] for m in BATCHES
                    )
                    slower = [m for m in BATCHES if res[(label, path, m)] > res[("float32", "", m)]]
                    ok = worst >= 0.9 and not slower
                    targets.append(
                        f"- `{isa}` {label}, {path}: worst {worst:.2f}x the prepared path"
                        f"{', slower than float at M = ' + str(slower) if slower else ''}:"
                        f" {'met' if ok else 'MISSED'}"
                    )
    finally:
        kernels.set_isa(start)
    mlp = _measure_mlp(rng)
    d, f, layers = MLP
    lines += [
        "",
        f"### MLP anchor ({layers} x ({d} -> {f} -> {d}), SiLU, decode M = 1, ISA `{start}`)",
        "",
        "| model | ms / token | tok/s |",
        "|---|---:|---:|",
    ]
    for name, t in mlp.items():
        if t is None:
            lines.append(f"| {name} | not measured (torch / torchao not importable) | - |")
        else:
            lines.append(f"| {name} | {t * 1e3:.3f} | {1 / t:.0f} |")
    ours, theirs = (
        mlp["lowbit int4 g128 (nnx.split + jit)"],
        mlp["torchao int4 g128 (torch.compile)"],
    )
    if theirs is not None:
        targets.append(
            f"- MLP int4 decode through the NNX path >= torchao's: {theirs / ours:.2f}x:"
            f" {'met' if ours <= theirs else 'MISSED'}"
        )
    return "\n".join([*lines, "", "Targets:", "", *targets])
