"""Benchmark section: memory of loading a quantized SmolLM2 checkpoint.

For each recipe, `lowbit quantize smollm2 --recipe R` writes a checkpoint, and a fresh Python
process (JAX runtime warmed up first) loads it with `lowbit.io.load_checkpoint`, as logical
QArrays and laid out for the CPU kernels (`kernel_axes=` from the model's traced forward: each
weight's layout replaces its codes as it loads). Reported from `/proc/self/status`:

- peak: growth of the peak resident set (VmHWM) during the load, glibc's default settings;
- kept: growth of anonymous resident memory (RssAnon) after it, once with glibc's defaults
  and once with a fixed mmap threshold (`MALLOC_MMAP_THRESHOLD_=65536`), under which freed
  large buffers go straight back to the system, so it counts only the data kept alive.

The bound (issue 13) is a peak of 1.3x the file for int4 checkpoints, and resident quantized
weights within 1.1x their `nbytes`. A second table measures the resident size of the 4-layer
MLP anchor (d 1024, ffn 4096) quantized int8 weight-only and int4 g128 and prepared for the
kernels. Linux only. Run with `python -m benchmarks memory`.
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
import jax.numpy as jnp
from flax import nnx
from lowbit.api import kernel_axes_of
from lowbit.io import load_checkpoint
from lowbit.gguf import read_gguf
from lowbit.models import Decoder, decoder_config_from_gguf, smollm2_gguf_path
from lowbit.ops import PreparedQArray
from lowbit.qarray import QArray

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

config = decoder_config_from_gguf(read_gguf(smollm2_gguf_path()))
graphdef = nnx.graphdef(Llama.abstract(config))
forward = lambda p, t: nnx.merge(graphdef, p)(t)
tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
axes = lambda p: kernel_axes_of(forward, p, tokens)
jax.device_put(np.ones(2**20, np.uint8)).block_until_ready()
peak0, anon0 = status("VmHWM"), status("RssAnon")
params = load_checkpoint(sys.argv[1], kernel_axes=axes if sys.argv[2] == "1" else None)
jax.block_until_ready(params)
is_q = lambda x: isinstance(x, QArray | PreparedQArray)
leaves = [q for q in jax.tree.leaves(params, is_leaf=is_q) if is_q(q)]
print(json.dumps({
    "peak": status("VmHWM") - peak0,
    "kept": status("RssAnon") - anon0,
    "prepared": sum(isinstance(q, PreparedQArray) for q in leaves),
    "resident": sum(getattr(q, "resident_nbytes", q.nbytes) for q in leaves),
    "nbytes": sum(q.nbytes for q in leaves),
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
            "import sys; from lowbit.cli import console; console()",
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


_ANCHOR = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
import lowbit
from lowbit.ops import PreparedQArray
from lowbit.qarray import QArray

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

D, FFN, LAYERS = 1024, 4096, 4
recipe = sys.argv[1]
jax.device_put(np.ones(2**20, np.uint8)).block_until_ready()
anon0 = status("RssAnon")

def mlp(p, x):
    for layer in p:
        x = jax.nn.gelu(x @ layer["up"]["kernel"]) @ layer["down"]["kernel"]
    return x

params = []
for i in range(LAYERS):  # one float weight alive at a time
    layer = {}
    for name, shape in (("up", (D, FFN)), ("down", (FFN, D))):
        w = jax.random.normal(jax.random.key(2 * i + (name == "down")), shape) / 32
        layer[name] = lowbit.quantize({"kernel": w}, recipe)
        del w
    params.append(layer)
x = jnp.ones((1, D))
params = lowbit.prepare(params, mlp, x)
jax.block_until_ready(params)
is_q = lambda x: isinstance(x, QArray | PreparedQArray)
leaves = [q for q in jax.tree.leaves(params, is_leaf=is_q) if is_q(q)]
print(json.dumps({
    "kept": status("RssAnon") - anon0,
    "prepared": sum(isinstance(q, PreparedQArray) for q in leaves),
    "resident": sum(getattr(q, "resident_nbytes", q.nbytes) for q in leaves),
    "nbytes": sum(q.nbytes for q in leaves),
}))
"""

ANCHOR_RECIPES = ("int8_weight_only", "int4_weight_only")


def _anchor(recipe: str) -> dict[str, int]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(
        [sys.executable, "-c", _ANCHOR, recipe], capture_output=True, text=True, check=True, env=env
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run() -> str:
    if not has_smollm2() or not os.path.exists("/proc/self/status"):
        return "## Load memory\n\nSkipped: needs the SmolLM2 package and Linux `/proc`.\n"
    lines = [
        "## Load memory (`benchmarks/memory.py`)",
        "",
        f"- Date: {datetime.date.today().isoformat()}; {cpu_model()}, {os.cpu_count()} cores",
        "- SmolLM2-135M checkpoints from `lowbit quantize smollm2 --recipe R`, loaded by "
        "`load_checkpoint` in a fresh process; MiB. Bounds: peak <= 1.3 x file (int4), "
        "resident quantized weights <= 1.1 x their `nbytes`.",
        "",
        "| recipe | file | kernel layouts | weights nbytes | resident | resident / nbytes | "
        "peak | peak / file | kept | kept (fixed mmap threshold) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ratios: dict[bool, list[float]] = {False: [], True: []}
    resident: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in RECIPES:
            directory = Path(tmp) / recipe
            _quantize(recipe, directory)
            size = (directory / "model.safetensors").stat().st_size
            for layouts in (False, True):
                default = _load(directory, layouts, fixed_threshold=False)
                fixed = _load(directory, layouts, fixed_threshold=True)
                if recipe.startswith("int4"):
                    ratios[layouts].append(default["peak"] / size)
                resident.append(default["resident"] / default["nbytes"])
                lines.append(
                    f"| {recipe} | {_mib(size)} | "
                    f"{'yes (' + str(default['prepared']) + ')' if layouts else 'no'} | "
                    f"{_mib(default['nbytes'])} | {_mib(default['resident'])} | "
                    f"{default['resident'] / default['nbytes']:.3f} | {_mib(default['peak'])} | "
                    f"{default['peak'] / size:.2f} | {_mib(default['kept'])} | "
                    f"{_mib(fixed['kept'])} |"
                )
    lines += [
        "",
        "4-layer MLP anchor (d 1024, ffn 4096), quantized one float weight at a time and "
        "prepared with `lowbit.prepare`; kept = growth of RssAnon (fixed mmap "
        "threshold), MiB:",
        "",
        "| recipe | weights nbytes | resident | resident / nbytes | kept |",
        "|---|---:|---:|---:|---:|",
    ]
    for recipe in ANCHOR_RECIPES:
        r = _anchor(recipe)
        resident.append(r["resident"] / r["nbytes"])
        lines.append(
            f"| {recipe} | {_mib(r['nbytes'])} | {_mib(r['resident'])} | "
            f"{r['resident'] / r['nbytes']:.3f} | {_mib(r['kept'])} |"
        )

    def verdict(values: list[float], bound: float, what: str) -> str:
        met = max(values) <= bound
        return f"{'met' if met else '**NOT met**'} ({what} up to {max(values):.2f})"

    lines += [
        "",
        f"- int4 peak <= 1.3 x file, logical load: {verdict(ratios[False], 1.3, 'peak / file')}.",
        f"- int4 peak <= 1.3 x file, kernel layouts: {verdict(ratios[True], 1.3, 'peak / file')}.",
        f"- Resident <= 1.1 x nbytes: {verdict(resident, 1.1, 'resident / nbytes')}.",
        "",
        "Kernel layouts replace the codes (`lowbit.ops.PreparedQArray`): each weight is "
        "resident once, in the layout the kernels read, and the logical QArray is recovered "
        "from it for saving or any other use. The layout stores a float32 scale and zero point "
        "per 16 columns and group, so small groups with half-precision scales cost more than "
        "their logical form (int4 g32 with fp16 scales: 1.33x). Without a fixed mmap threshold "
        "glibc keeps some freed read buffers and compiler scratch in its heap, which is the "
        "difference between the two kept columns.",
    ]
    return "\n".join(lines) + "\n"
