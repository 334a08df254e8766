"""Benchmark section: memory of loading a quantized SmolLM2 checkpoint.

For each recipe, `lowbit quantize smollm2 --recipe R` writes a checkpoint, and a fresh Python
process (JAX runtime warmed up first) loads it with `lowbit.io.load_checkpoint`, with and
without the CPU kernels' stored weight layouts. Reported from `/proc/self/status`:

- peak: growth of the peak resident set (VmHWM) during the load, glibc's default settings;
- kept: growth of anonymous resident memory (RssAnon) after it, once with glibc's defaults
  and once with a fixed mmap threshold (`MALLOC_MMAP_THRESHOLD_=65536`), under which freed
  large buffers go straight back to the system, so it counts only the data kept alive.

The goal (issue: real models) is a peak below twice the quantized size plus the model's
float buffers, which are inside the checkpoint file here (norm scales), so the bound is
2x the file. Linux only. Run with `python -m benchmarks memory`.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._machine import cpu_model
from lowbit.models import has_smollm2

RECIPES = ("int4w_g32_asym", "int4w_g64", "int8w")
MIB = 2**20

_LOADER = """
import json, sys
import jax
import numpy as np
from lowbit.io import load_checkpoint
from lowbit.qarray import QArray

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

jax.device_put(np.ones(2**20, np.uint8)).block_until_ready()
peak0, anon0 = status("VmHWM"), status("RssAnon")
params = load_checkpoint(sys.argv[1], kernel_layouts=sys.argv[2] == "1")
jax.block_until_ready(params)
leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QArray))
print(json.dumps({
    "peak": status("VmHWM") - peak0,
    "kept": status("RssAnon") - anon0,
    "layouts": sum(q.kernel_nbytes for q in leaves if isinstance(q, QArray)),
}))
"""


def _load(directory: Path, layouts: bool, fixed_threshold: bool) -> dict[str, int]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if fixed_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    out = subprocess.run(
        [sys.executable, "-c", _LOADER, str(directory), str(int(layouts))],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _quantize(recipe: str, directory: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from lowbit.cli import main; sys.exit(main())",
            "quantize",
            "smollm2",
            "--recipe",
            recipe,
            "--out",
            str(directory),
        ],
        capture_output=True,
        text=True,
        check=True,
    )


def _mib(n: int) -> str:
    return f"{n / MIB:.1f}"


def run() -> str:
    if not has_smollm2() or not os.path.exists("/proc/self/status"):
        return "## Load memory\n\nSkipped: needs the SmolLM2 package and Linux `/proc`.\n"
    lines = [
        "## Load memory (`benchmarks/memory.py`)",
        "",
        f"- Date: {datetime.date.today().isoformat()}; {cpu_model()}, {os.cpu_count()} cores",
        "- SmolLM2-135M checkpoints from `lowbit quantize smollm2 --recipe R`, loaded by "
        "`load_checkpoint` in a fresh process; MiB. Bound to meet: peak < 2 x file.",
        "",
        "| recipe | file | stored layouts | layouts | peak | peak / file | kept | "
        "kept (fixed mmap threshold) |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    ratios: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in RECIPES:
            directory = Path(tmp) / recipe
            _quantize(recipe, directory)
            size = (directory / "model.safetensors").stat().st_size
            for layouts in (False, True):
                default = _load(directory, layouts, fixed_threshold=False)
                fixed = _load(directory, layouts, fixed_threshold=True)
                ratios[layouts].append(default["peak"] / size)
                lines.append(
                    f"| {recipe} | {_mib(size)} | {'yes' if layouts else 'no'} | "
                    f"{_mib(default['layouts'])} | {_mib(default['peak'])} | "
                    f"{default['peak'] / size:.2f} | {_mib(default['kept'])} | "
                    f"{_mib(fixed['kept'])} |"
                )

    def verdict(values: list[float]) -> str:
        met = max(values) < 2.0
        return f"{'met' if met else '**NOT met**'} (peak / file up to {max(values):.2f})"

    lines += [
        "",
        f"- Peak < 2 x file without stored layouts: {verdict(ratios[False])}.",
        f"- With stored layouts (the default of `load_checkpoint`): {verdict(ratios[True])}. "
        "The layouts are a second, kernel-ordered copy of the weights kept beside the logical "
        "QArray (which other backends and the engine's layout rules read); "
        "`load_checkpoint(..., kernel_layouts=False)` stays under the bound, and the kernels "
        "then repack each weight inside every call, which is many times slower.",
        "",
        "Stored layouts are the CPU kernels' packed copy of each weight a kernel runs, built at "
        "load time (a second copy in memory, never in the file); the tied embedding gets one "
        "too (it is also the output projection). Without a fixed mmap threshold glibc keeps "
        "some freed read buffers and compiler scratch in its heap, which is the difference "
        "between the two kept columns.",
    ]
    return "\n".join(lines) + "\n"
