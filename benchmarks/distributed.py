"""Benchmark section: quantization and generation over several local JAX processes.

Each measurement starts N processes on this machine with a coordinator on a free localhost
port (`jax.distributed.initialize`, CPU devices, gloo collectives), as the multi-process
tests do, and runs the same script in each.

1. **Peak memory of quantizing a sharded model.** A Llama-shaped stack of random float32
   kernels (`MEMORY_MODEL`: q/k/v/o and gate/up/down per layer, about 0.7 GB) is built as
   global arrays on a mesh of every process's devices (one per process): q/k/v/gate/up split
   by columns, o/down by rows, Megatron-style. Each process builds only its own pieces
   (`jax.make_array_from_callback`, every block of a kernel from its own seeded generator, so
   any process count builds the same model), then `lowbit.quantize(params, MEMORY_RECIPE)`.
   The peak is the process's VmHWM from /proc/self/status, reset (``clear_refs``) after JAX,
   the coordinator and lowbit have started; "growth" is that peak minus the resident size at
   the reset (the runtime's own memory is left out). One process is measured twice: with
   `lowbit.quantize`'s default CPU-kernel layouts (which it builds only for weights on one
   device, so the sharded processes skip that step) and with ``kernel_layouts=False``. The
   target compares growths: the largest per-process peak on 4 processes <= 0.35x the smaller
   one-process peak, for the same model.
2. **Decode throughput of SmolLM2-135M** (`DECODE_RECIPE` weights, float32 KV cache, greedy)
   with `lowbit.models.stream_tokens(..., mesh=...)` on: one process with one device (no
   mesh; again with logical QArrays, ``kernel_layouts=False``; again on a 1x1 mesh, the mesh
   path without any device crossing); two processes with a ``"data"`` axis of 2 (the batch
   split); and a ``"model"`` axis of 2 (tensor parallel; SmolLM2's 3 kv heads are padded
   with a zero head to 4) both in one process with 2 CPU devices and in 2 processes. Params are
   placed once (`shard_for_generation`); the decode rate is ``batch * (NEW - 1)`` tokens over
   the time from the first token (the prefill's) to the last, one compiled decode loop, best
   of `REPS` after a warm-up. Each run names its threads (`_DECODE_RUNS`). The section counts
   the collectives in the compiled decode program (XLA's optimized HLO dumped by process 0)
   and, for the tensor-parallel runs, times that step's all-reduces alone.

``LOWBIT_BENCH_SMOKE=1`` shrinks the model, the batch and the token counts: a quick check
that the code runs (numbers meaningless). Run with ``python -m benchmarks distributed``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._machine import cpu_model

ROOT = Path(__file__).resolve().parent.parent
SMOKE = os.environ.get("LOWBIT_BENCH_SMOKE", "") not in ("", "0")
MIB = 2**20

# Llama-shaped kernels [in, out]: hidden 2048, 16 heads of 128 with 4 kv heads, MLP 5632.
MEMORY_MODEL = {"dim": 2048, "kv_dim": 512, "ffn": 5632, "layers": 4}
MEMORY_RECIPE = "int4w_g32_asym"
MEMORY_PROCESSES = 4
MEMORY_TARGET = 0.35
DECODE_RECIPE = "int8w"
BATCH, PROMPT, NEW, REPS = 8, 64, 33, 2
TP_TARGET = 0.8
if SMOKE:
    MEMORY_MODEL = {"dim": 256, "kv_dim": 128, "ffn": 512, "layers": 1}
    BATCH, PROMPT, NEW, REPS = 2, 8, 5, 1

# What every process runs: argv = task, config (JSON), process id. Prints one JSON line.
_WORKER = r"""
import json, os, re, sys, time
task, cfg, pid = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
if cfg.get("cores"):
    os.sched_setaffinity(0, {cfg["cores"][pid % len(cfg["cores"])]})
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
if cfg["processes"] > 1:
    jax.distributed.initialize(f"127.0.0.1:{cfg['port']}", num_processes=cfg["processes"],
                               process_id=pid, initialization_timeout=120)
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import lowbit


def status_kib(field):
    return int(re.search(field + r":\s+(\d+)", open("/proc/self/status").read()).group(1))


def memory():
    m = cfg["model"]
    d, kv, f = m["dim"], m["kv_dim"], m["ffn"]
    # name -> (shape [in, out], split axis): columns for q/k/v/gate/up, rows for o/down.
    kernels = {"q_proj": ((d, d), 1), "k_proj": ((d, kv), 1), "v_proj": ((d, kv), 1),
               "o_proj": ((d, d), 0), "gate_proj": ((d, f), 1), "up_proj": ((d, f), 1),
               "down_proj": ((f, d), 0)}
    blocks = cfg["blocks"]
    # Automatic axes: on a one-device mesh with explicit axes (JAX's default), quantize's
    # kernel-layout step fails on row-split weights (a ShardingTypeError in a reshape).
    mesh = jax.make_mesh((jax.device_count(),), ("x",), axis_types=(jax.sharding.AxisType.Auto,))

    def build(seed, shape, axis):
        # Block j of the split axis comes from generator (seed, j): any process count builds
        # the same values, and a process builds only the blocks of its own pieces.
        step = shape[axis] // blocks

        def piece(index):
            sl = index[axis]
            lo, hi = sl.start or 0, shape[axis] if sl.stop is None else sl.stop
            out_shape = list(shape)
            out_shape[axis] = hi - lo
            out = np.empty(out_shape, np.float32)
            for j in range(lo // step, hi // step):
                rng = np.random.default_rng((seed, j))
                block = list(shape)
                block[axis] = step
                where = [slice(None)] * 2
                where[axis] = slice(j * step - lo, (j + 1) * step - lo)
                out[tuple(where)] = rng.standard_normal(block, dtype=np.float32) * 0.02
            return out

        spec = P(None, "x") if axis == 1 else P("x", None)
        return jax.make_array_from_callback(shape, NamedSharding(mesh, spec), piece)

    jax.block_until_ready(jax.jit(lambda x: x + 1)(np.zeros(4, np.float32)))
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS now
    base = status_kib("VmRSS")
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        params = {}
        for i in range(m["layers"]):
            params[f"layer_{i}"] = {
                name: {"kernel": build(i * 16 + k, shape, axis)}
                for k, (name, (shape, axis)) in enumerate(kernels.items())
            }
        built = status_kib("VmHWM")
        q = lowbit.quantize(params, cfg["recipe"], kernel_layouts=cfg["layouts"])
        q = jax.block_until_ready(q)
    seconds = time.perf_counter() - start
    peak = status_kib("VmHWM")
    down = q["layer_0"]["down_proj"]["kernel"]
    # A CPU-kernel layout (one device) holds no codes; its logical QArray does (read after
    # the peak).
    codes = down.codes if hasattr(down, "codes") else down.logical().codes
    local = sum(s.data.nbytes for leaf in jax.tree.leaves(params) for s in leaf.addressable_shards)
    print(json.dumps({"base": base * 1024, "peak": peak * 1024, "built": built * 1024,
                      "local_float_bytes": local, "seconds": seconds,
                      "codes_shape": list(codes.shape),
                      "codes_local": list(codes.addressable_shards[0].data.shape)}))


def decode():
    from flax import nnx
    from lowbit.eval import default_text
    from lowbit.models import load_smollm2, shard_for_generation, stream_tokens

    model, tokenizer = load_smollm2()
    layouts = cfg.get("layouts", True)
    params = lowbit.quantize(nnx.split(model)[1], cfg["recipe"], kernel_layouts=layouts)
    b, p, new = cfg["batch"], cfg["prompt"], cfg["new"]
    ids = np.asarray(tokenizer.encode(default_text()).ids)
    prompts = [ids[r * p:(r + 1) * p].tolist() for r in range(b)]
    mesh, tp = None, 1
    if cfg["mesh"] is not None:
        data, tp = cfg["mesh"]
        mesh = jax.make_mesh((data, tp), ("data", "model"))
        params, mesh = shard_for_generation(params, mesh, model.config)

    def once():
        stamps = []
        for chunk in stream_tokens(model, prompts, params=params, max_new_tokens=new,
                                   chunk=None, mesh=mesh):
            stamps.append(time.perf_counter())
        return stamps[-1] - stamps[0]

    once()  # compiles
    best = min(once() for _ in range(cfg["reps"]))
    out = {"decode_seconds": best, "tok_s": b * (new - 1) / best,
           "step_ms": best / (new - 1) * 1000, "devices": jax.device_count()}
    if tp > 1:
        # Two all-reduces per layer (after o_proj and after down_proj).
        count = 2 * model.config.n_layers
        each = allreduce_us(mesh.mesh, b, model.config.dim, count)
        out["allreduce_step_ms"] = each * count / 1000
    print(json.dumps(out))


def allreduce_us(mesh, rows, dim, count):
    # `count` all-reduces over "model" of one decode step's activation [rows, 1, dim] float32,
    # one after another (each needs the last), timed alone: the collectives' cost of a step.

    def body(x):
        return jax.lax.fori_loop(0, count, lambda i, y: jax.lax.psum(y, "model") * 0.5, x)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, "model"),
                              out_specs=P(None, "model"), check_vma=False))
    tp = mesh.shape["model"]
    host = np.ones((rows, tp, dim), np.float32)
    x = jax.make_array_from_callback(host.shape, NamedSharding(mesh, P(None, "model")),
                                     lambda index: host[index])
    jax.block_until_ready(f(x))
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(f(x))
        best = min(best, time.perf_counter() - start)
    return best / count * 1e6


{"memory": memory, "decode": decode}[task]()
if cfg["processes"] > 1:
    jax.distributed.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(
    task: str,
    processes: int,
    cfg: dict,
    *,
    devices: int = 1,
    single_thread: bool = False,
    pin: bool = False,
    dump: Path | None = None,
    timeout: float = 600.0,
) -> list[dict]:
    """Runs `_WORKER` `task` in `processes` local processes; each one's JSON result.

    `devices`: CPU devices per process. `single_thread`: XLA's Eigen and lowbit's kernels on
    one thread each. `pin`: process i on core i mod (cores of this process). `dump`: XLA's
    optimized HLO of process 0 written there.
    """
    cores = sorted(os.sched_getaffinity(0))
    cfg = {**cfg, "processes": processes, "port": _free_port(), "cores": cores if pin else None}
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "LOWBIT_NUM_THREADS")}
    base["JAX_PLATFORMS"] = "cpu"
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), base.get("PYTHONPATH")]))
    flags = [f"--xla_force_host_platform_device_count={devices}"]
    if single_thread:
        flags.append("--xla_cpu_multi_thread_eigen=false")
        base["LOWBIT_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix="lowbit-dist-") as tmp:
        procs, logs = [], []
        for i in range(processes):
            env = dict(base)
            extra = [f"--xla_dump_to={dump}", "--xla_dump_hlo_as_text"] if dump and i == 0 else []
            env["XLA_FLAGS"] = " ".join(flags + extra)
            logs.append(Path(tmp, f"worker{i}.log"))
            with open(logs[i], "w") as log:
                cmd = [sys.executable, "-c", _WORKER, task, json.dumps(cfg), str(i)]
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + timeout
        failed = []
        for i, proc in enumerate(procs):
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = "timeout"
            if code != 0:
                failed.append((i, code))
        if failed:
            for proc in procs:
                proc.kill()
            tails = "\n".join(
                f"--- worker {i} ({code}) ---\n" + "\n".join(logs[i].read_text().splitlines()[-30:])
                for i, code in failed
            )
            raise RuntimeError(f"{task} on {processes} processes failed:\n{tails}")
        results = []
        for log in logs:
            lines = [x for x in log.read_text().splitlines() if x.startswith("{")]
            results.append(json.loads(lines[-1]))
    return results


_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def collectives_per_step(dump: Path) -> dict[str, int]:
    """Collective ops in the compiled decode loop (XLA's optimized HLO of the module that
    holds the decode `while`): {op: count}. One loop iteration is one decode step and the
    collectives all sit in its body, so these are counts per step."""
    best: dict[str, int] = {}
    for path in dump.glob("*after_optimizations.txt"):
        if "decode" not in path.name:
            continue
        text = path.read_text()
        counts = {op: len(re.findall(rf"= \S+ {op}(?:-start)?\(", text)) for op in _COLLECTIVES}
        if sum(counts.values()) > sum(best.values()):
            best = counts
    return {op: n for op, n in best.items() if n}


def _memory() -> tuple[list[str], bool]:
    cfg = {"model": MEMORY_MODEL, "recipe": MEMORY_RECIPE, "blocks": MEMORY_PROCESSES}
    # lowbit.quantize lays weights out for the CPU kernels where they lie on one device
    # (kernel_layouts=True): the one-process run does that step, the sharded one does not,
    # so one process is also measured without it, and the target uses the smaller peak.
    runs = [
        ("1, CPU-kernel layouts (default)", [_launch("memory", 1, {**cfg, "layouts": True})[0]]),
        ("1, logical QArrays", [_launch("memory", 1, {**cfg, "layouts": False})[0]]),
        (
            f"{MEMORY_PROCESSES}, default",
            _launch(
                "memory", MEMORY_PROCESSES, {**cfg, "layouts": True}, single_thread=True, pin=True
            ),
        ),
    ]
    growth = lambda r: r["peak"] - r["base"]  # noqa: E731
    one = min((rs[0] for _, rs in runs[:2]), key=growth)
    worst = max(runs[2][1], key=growth)
    ratio = growth(worst) / growth(one)
    met = ratio <= MEMORY_TARGET
    m = MEMORY_MODEL
    total = m["layers"] * 4 * m["dim"] * (2 * m["dim"] + 2 * m["kv_dim"] + 3 * m["ffn"])
    lines = [
        "### Peak memory of quantizing a model sharded over processes",
        "",
        f"Random float32 Llama-shaped kernels: {m['layers']} layers of hidden {m['dim']}, "
        f"kv {m['kv_dim']}, MLP {m['ffn']} ({total / MIB:.0f} MiB), `lowbit.quantize(params, "
        f'"{MEMORY_RECIPE}")` on global arrays over a mesh (automatic axes) of one CPU '
        "device per process (q/k/v/gate/up split by columns, o/down by rows); each process "
        "builds only its own pieces, block by block from seeded generators. Peak = VmHWM "
        "after a reset (`/proc/self/clear_refs`) once JAX, the coordinator and lowbit have "
        "started; growth = peak - resident size at the reset (the runtime's "
        f"~{one['base'] / MIB:.0f} MiB left out). The sharded processes run one thread each, "
        "one core each (round-robin).",
        "",
        "| processes | process | float pieces MiB | peak growth MiB | peak RSS MiB "
        "| down_proj codes (local / global) | time s |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for label, rows in runs:
        for i, r in enumerate(rows):
            lines.append(
                f"| {label} | {i} | {r['local_float_bytes'] / MIB:.0f} | "
                f"{growth(r) / MIB:.0f} | {r['peak'] / MIB:.0f} | "
                f"{r['codes_local']} / {r['codes_shape']} | {r['seconds']:.1f} |"
            )
    lines += [
        "",
        f"- Target: per-process peak growth on {MEMORY_PROCESSES} processes <= "
        f"{MEMORY_TARGET}x the one-process peak growth (the smaller of the two one-process "
        f"runs): {ratio:.2f}x, **{'met' if met else 'NOT met'}**. Counting the runtime too "
        f"(peak RSS): {worst['peak'] / one['peak']:.2f}x (not the target's measure: the "
        "runtime's share does not shrink with more processes).",
        "",
    ]
    return lines, met


# (label, processes, CPU devices each, (data, model) mesh or None, threads): "all" = every
# core, XLA's and lowbit's default threads; "pinned" = one core each (round-robin), one
# thread; "single" = one thread each, not pinned (the collectives' own threads may then run
# on the other core).
_LOGICAL = "1 process, 1 device, no mesh, logical QArrays"
_DECODE_RUNS = (
    ("1 process, 1 device, no mesh", 1, 1, None, "all"),
    (_LOGICAL, 1, 1, None, "all"),
    ("1 process, 1 device, 1x1 mesh", 1, 1, (1, 1), "all"),
    ("2 processes, data=2", 2, 1, (2, 1), "pinned"),
    ("1 process, 2 devices, model=2", 1, 2, (1, 2), "all"),
    ("2 processes, model=2", 2, 1, (1, 2), "pinned"),
    ("2 processes, model=2, not pinned", 2, 1, (1, 2), "single"),
)
_THREADS = {
    "all": "all cores, default threads",
    "pinned": "one core each (pinned), 1 thread",
    "single": "1 thread each, not pinned",
}


def _decode() -> tuple[list[str], bool | None]:
    cfg = {"recipe": DECODE_RECIPE, "batch": BATCH, "prompt": PROMPT, "new": NEW, "reps": REPS}
    runs = []  # (label, processes, devices each, mesh, threads, result, collectives)
    with tempfile.TemporaryDirectory(prefix="lowbit-hlo-") as tmp:
        for label, n, devices, mesh, threads in _DECODE_RUNS:
            dump = Path(tmp, f"hlo{len(runs)}")
            result = _launch(
                "decode",
                n,
                {**cfg, "mesh": mesh, "layouts": label != _LOGICAL},
                devices=devices,
                single_thread=threads != "all",
                pin=threads == "pinned",
                dump=dump,
            )[0]
            runs.append((label, n, devices, mesh, threads, result, collectives_per_step(dump)))
    base = runs[0][5]["tok_s"]
    lines = [
        "### Decode throughput of SmolLM2-135M over processes",
        "",
        f"`{DECODE_RECIPE}` weights (`lowbit.quantize` on the float model), float32 KV cache, "
        f"greedy; batch {BATCH} x {PROMPT}-token prompts, {NEW} new tokens; decode tok/s = "
        f"batch x {NEW - 1} tokens over the time from the first token to the last (one "
        f"compiled decode loop), best of {REPS} after a warm-up. Collectives: ops in the "
        "compiled decode loop's body (XLA's optimized HLO), i.e. per step; all-reduce alone: "
        "that many all-reduces of one step's [batch, 1, 576] float32 activation over "
        '"model", timed in a loop by themselves.',
        "",
        "| run | threads | decode tok/s | x one process | ms / step | collectives per step "
        "| all-reduce alone, ms / step |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    for label, _, _, _, threads, r, coll in runs:
        counts = ", ".join(f"{v} {k}" for k, v in coll.items()) or "none"
        alone = r.get("allreduce_step_ms")
        share = "-" if alone is None else f"{alone:.1f}"
        lines.append(
            f"| {label} | {_THREADS[threads]} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}x | "
            f"{r['step_ms']:.1f} | {counts} | {share} |"
        )
    speed = {label: r["tok_s"] / base for label, *_, r, _ in runs}
    step = {label: r["step_ms"] for label, *_, r, _ in runs}
    by_label = {label: r for label, *_, r, _ in runs}
    plain, logical = step["1 process, 1 device, no mesh"], step[_LOGICAL]
    mesh1 = step["1 process, 1 device, 1x1 mesh"]
    tp_run, tp_dev = by_label["2 processes, model=2"], by_label["1 process, 2 devices, model=2"]
    loose = by_label["2 processes, model=2, not pinned"]
    tp = max(speed["2 processes, model=2"], speed["2 processes, model=2, not pinned"])
    lines += [
        "",
        f"- Target: tensor-parallel decode on 2 processes >= {TP_TARGET}x one process on the "
        f"same cores: {tp:.2f}x (the better of the two 2-process runs), "
        f"**{'met' if tp >= TP_TARGET else 'NOT met'}** (SmolLM2's 3 kv heads padded with a "
        "zero head to 4: each process runs 2 kv heads and 6 query heads, half the MLP "
        f"columns); 2 processes data-parallel {speed['2 processes, data=2']:.2f}x.",
        f"- Where the time goes: one device with its CPU-kernel layouts takes {plain:.1f} ms "
        f"a step; the same weights as logical QArrays (`kernel_layouts=False`, laid out inside "
        f"every call) {logical:.1f} ms; the mesh path with nothing to split or sum across "
        f"devices (1x1 mesh) {mesh1:.1f} ms. On 2 processes the step's all-reduces, timed "
        f"alone, take {tp_run['allreduce_step_ms']:.1f} of its {tp_run['step_ms']:.1f} ms "
        f"({tp_run['allreduce_step_ms'] / tp_run['step_ms']:.0%}; gloo over loopback TCP, "
        "each process's compute and collective threads sharing its one core), "
        f"{loose['allreduce_step_ms']:.1f} of {loose['step_ms']:.1f} ms not pinned; in "
        f"one process with 2 devices {tp_dev['allreduce_step_ms']:.1f} of "
        f"{tp_dev['step_ms']:.1f} ms. The rest is compute and each process waiting for the "
        "other inside a collective (lock-stepped processes on a shared 2-core machine): each "
        "process runs half the attention (with the padded head: 4/3 of half) and MLP work, "
        "and the embedding, norms and the 49152-row output projection whole.",
        "",
    ]
    return lines, None


def run() -> str:
    begin = time.perf_counter()
    memory_lines, _ = _memory()
    decode_lines, _ = _decode()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [
        "## Several processes: sharded quantization memory and decode throughput",
        "",
        f"- Date: {time.strftime('%Y-%m-%d')}; CPU: {cpu_model()}, {os.cpu_count()} cores; "
        f"load average at the end {load}. Command: `python -m benchmarks distributed`"
        + (" (LOWBIT_BENCH_SMOKE=1: tiny shapes, not a measurement)" if SMOKE else "")
        + ".",
        "- Processes are local (coordinator on a localhost port, CPU devices, gloo "
        "collectives), as in the multi-process tests; the collectives run over loopback TCP "
        "on the same cores as the compute, so they are far costlier than on real hosts.",
        "",
        *memory_lines,
        *decode_lines,
        f"Section time: {time.perf_counter() - begin:.0f} s.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(run())
