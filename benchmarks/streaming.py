"""Benchmark section: converting a model larger than memory, one tensor at a time.

Writes a Llama-3-8B-shaped model (hidden 4096, 32 layers, 32 heads, 8 key/value heads, MLP
14336, vocabulary 128256, untied output) with random bfloat16 weights as Hugging Face
safetensors shards (about 5 GB each, with ``model.safetensors.index.json`` and
``config.json``: 16 GB, 32 GB as float32, beyond this machine's memory) into a temporary
directory, then, each in a fresh child process:

- ``convert_checkpoint`` to an ``int4w_g32_asym`` lowbit checkpoint;
- ``export_gguf`` of the shards (read lazily through ``SourceParams``) to a Q4_0 GGUF file.

Reported: the child's peak resident set (``VmHWM``, JAX's runtime included), the input
and output sizes, the bound (1.25x the larger of input and output, plus 1 GiB) and the time.
The temporary directory (about 30 GB at its largest) is removed afterwards. Names and shapes
come from `config.json` (`decoder_config_from_hf`, `hf_param_map`). ``LOWBIT_STREAMING_LAYERS`` runs
fewer layers (a quick check). Run with ``python -m benchmarks streaming``.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from benchmarks._machine import cpu_model

GIB = 2**30
SHARD_BYTES = 5 * 10**9
LLAMA3_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "torch_dtype": "bfloat16",
}
RECIPE = "int4w_g32_asym"
GGUF_TYPE = "Q4_0"

# Shared by both children: the model's config and name map, read from its config.json.
_COMMON = """
import json, os, sys, time
from lowbit.models import decoder_config_from_hf, hf_param_map

def config_of(directory):
    with open(os.path.join(directory, "config.json")) as f:
        return decoder_config_from_hf(json.load(f))


def hf_map(directory):
    return hf_param_map(config_of(directory)).get

def done(seconds, nbytes):
    # VmHWM: this process's own peak. ru_maxrss would also count the parent's peak, which
    # Linux carries into a child through fork and exec (a long `python -m benchmarks` run
    # reported its own 20 GiB for both children).
    status = open("/proc/self/status").read()
    peak = int(status.split("VmHWM:")[1].split()[0]) * 1024
    print(json.dumps({"seconds": seconds, "peak": peak, "nbytes": nbytes}))
"""

_CONVERT = (
    _COMMON
    + """
from lowbit.io import convert_checkpoint
start = time.perf_counter()
report = convert_checkpoint(sys.argv[1], sys.argv[2], sys.argv[3], name_map=hf_map(sys.argv[1]))
done(time.perf_counter() - start, report.nbytes)
"""
)

_EXPORT = (
    _COMMON
    + """
from lowbit.io import SourceParams, export_gguf
start = time.perf_counter()
with SourceParams(sys.argv[1], hf_map(sys.argv[1])) as params:
    report = export_gguf(params, sys.argv[2], config=config_of(sys.argv[1]), type=sys.argv[3],
                         log=None)
done(time.perf_counter() - start, report.nbytes)
"""
)


def _hf_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face Llama tensor names -> shapes ([out, in] for linear weights)."""
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = d // config["num_attention_heads"] * config["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (v, d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (d,),
            f"{p}.self_attn.q_proj.weight": (d, d),
            f"{p}.self_attn.k_proj.weight": (kv, d),
            f"{p}.self_attn.v_proj.weight": (kv, d),
            f"{p}.self_attn.o_proj.weight": (d, d),
            f"{p}.post_attention_layernorm.weight": (d,),
            f"{p}.mlp.gate_proj.weight": (f, d),
            f"{p}.mlp.up_proj.weight": (f, d),
            f"{p}.mlp.down_proj.weight": (d, f),
        }
    return shapes | {"model.norm.weight": (d,), "lm_head.weight": (v, d)}


def _random_bf16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random bfloat16 weights of magnitude 2**-7 .. 2**-3, from random bits (fast)."""
    if len(shape) == 1:
        return np.ones(shape, ml_dtypes.bfloat16)
    bits = rng.integers(0, 2**16, size=shape, dtype=np.uint16)
    # Keep the sign, the two low exponent bits and the mantissa; exponent 120..123.
    return ((bits & 0x81FF) | 0x3C00).view(ml_dtypes.bfloat16)


def write_model(directory: Path, config: dict) -> int:
    """Writes the shards, index and config.json; returns the bytes written."""
    import safetensors.numpy

    rng = np.random.default_rng(0)
    shapes = _hf_shapes(config)
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * 2
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map, total = {}, 0
    for k, names in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _random_bf16(rng, shapes[name]) for name in names}
        safetensors.numpy.save_file(tensors, directory / file, metadata={"format": "pt"})
        del tensors
        weight_map |= dict.fromkeys(names, file)
        total += (directory / file).stat().st_size
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return total


def _child(script: str, *args: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env
    )
    if out.returncode != 0:
        raise RuntimeError(f"streaming child failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.iterdir())


def run() -> str:
    config = dict(LLAMA3_8B)
    layers = os.environ.get("LOWBIT_STREAMING_LAYERS")
    if layers:
        config["num_hidden_layers"] = int(layers)
    rows = []
    with tempfile.TemporaryDirectory(prefix="lowbit-streaming-") as tmp:
        model = Path(tmp, "model")
        model.mkdir()
        start = time.perf_counter()
        source = write_model(model, config)
        generated = time.perf_counter() - start
        jobs = [
            (f"checkpoint {RECIPE}", _CONVERT, Path(tmp, "ckpt"), RECIPE),
            (f"GGUF {GGUF_TYPE}", _EXPORT, Path(tmp, "model.gguf"), GGUF_TYPE),
        ]
        for label, script, out, how in jobs:
            result = _child(script, str(model), str(out), how)
            written = _size(out)
            bound = 1.25 * max(source, written) + GIB
            rows.append((label, source, written, result["peak"], bound, result["seconds"]))
            shutil.rmtree(out) if out.is_dir() else out.unlink()
    n_layers = config["num_hidden_layers"]
    lines = [
        "## Streaming conversion of a Llama-3-8B-shaped model",
        "",
        f"{datetime.date.today().isoformat()}, {cpu_model()}, {os.cpu_count()} CPUs, "
        f"{_memory_gib():.0f} GiB memory. Random bfloat16 weights, Llama-3-8B shapes "
        f"({n_layers} layers), as Hugging Face safetensors shards of at most 5 GB "
        f"(written in {generated:.0f} s); each conversion runs in a fresh process; peak = "
        "its VmHWM (JAX runtime included); bound = 1.25 x max(input, output) + 1 GiB.",
        "",
        "| output | input GB | output GB | peak RSS GiB | bound GiB | peak / bound | time s |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, source, written, peak, bound, seconds in rows:
        lines.append(
            f"| {label} | {source / 1e9:.2f} | {written / 1e9:.2f} | {peak / GIB:.2f} | "
            f"{bound / GIB:.1f} | {peak / bound:.3f} | {seconds:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError):
        return float("nan")


if __name__ == "__main__":
    print(run())
