"""Sharded generation in each of several processes (see worker.py); the same
function gives the one-process reference."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from lowbit.api import quantize_params
from lowbit.models import Decoder, DecoderConfig, generate_tokens, shard_for_generation
from lowbit.ops import PreparedPieces

# Whole kv heads on each of 4 devices; o_proj / down_proj rows in whole groups of 32. Each
# device's piece of gate/up/down (256 x 256 and up) is large enough for the CPU kernels, so
# those run as pieces laid out on each process (`PreparedPieces`).
CONFIG = DecoderConfig(
    vocab_size=64,
    dim=256,
    n_layers=2,
    n_heads=8,
    n_kv_heads=4,
    head_dim=32,
    ffn_dim=1024,
    context_length=128,
)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11], [3, 3, 60, 2]]
NEW = 24
RECIPE = "int4w_g32_asym"
# (name, (data, model) mesh shape, axis type) by the number of devices of all processes
# together. Each shape runs with one axis type, alternating, so that both kinds of axes meet
# both kinds of mesh over the two counts without running every pair.
MESHES = {
    4: (("tp4", (1, 4), "Auto"), ("dp2xtp2", (2, 2), "Explicit")),
    8: (("dp2xtp4", (2, 4), "Explicit"), ("dp4xtp2", (4, 2), "Auto")),
}


def generate(mesh=None) -> np.ndarray:
    """Greedy tokens ``[rows, NEW]`` of the tiny model, int4 weights and an int8 KV cache.

    Every process builds the same model and quantizes it the same way (same seed), so each
    holds identical host copies; `shard_for_generation` keeps only its pieces on its devices.
    """
    model = Decoder(CONFIG, rngs=nnx.Rngs(0))
    params = quantize_params(nnx.state(model, nnx.Param), RECIPE)
    out = generate_tokens(
        model, PROMPTS, params=params, max_new_tokens=NEW, kv_cache="int8", mesh=mesh
    )
    return np.asarray(out.tokens, np.int32)


def tp_generate(out_dir: str) -> dict[str, np.ndarray]:
    """Generation on meshes of every process's devices (`MESHES`: tensor parallel across
    processes, data parallel across them with tensor parallel within), automatic and explicit
    axes."""
    results = {}
    for name, shape, kind in MESHES[jax.device_count()]:
        axis_type = getattr(jax.sharding.AxisType, kind)
        mesh = jax.make_mesh(shape, ("data", "model"), axis_types=(axis_type, axis_type))
        results[f"{name}_{kind}"] = generate(mesh)
    results["pieces"] = np.int32(_count_pieces(mesh))
    return results


def _count_pieces(mesh) -> int:
    """How many weights `shard_for_generation` places on `mesh` as laid-out pieces."""
    model = Decoder(CONFIG, rngs=nnx.Rngs(0))
    params = quantize_params(nnx.state(model, nnx.Param), RECIPE)
    placed, _ = shard_for_generation(params, mesh, CONFIG)
    leaves = jax.tree.leaves(placed, is_leaf=lambda x: isinstance(x, PreparedPieces))
    return sum(isinstance(leaf, PreparedPieces) for leaf in leaves)
