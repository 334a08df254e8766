"""What each process runs (see worker.py); the same functions give the one-process reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lowbit
import lowbit.io

RECIPE = "int4w_g32_asym"
COLUMNS, ROWS = P(None, "x"), P("x", None)


def weights() -> dict[str, np.ndarray]:
    """Host copies every process builds identically (no process reads another's)."""
    rng = np.random.default_rng(0)
    return {
        "up": rng.normal(size=(256, 512)).astype(np.float32) / 16,
        "down": rng.normal(size=(512, 256)).astype(np.float32) / 16,
        "x": rng.normal(size=(4, 256)).astype(np.float32),
    }


def mlp(params, x):
    return jnp.tanh(x @ params["up"]["kernel"]) @ params["down"]["kernel"]


def global_array(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """The global array whose pieces each process builds from its own copy (no transfer)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def quantize_and_run(mesh) -> tuple[dict, jax.Array]:
    """Megatron-style: `up` split over columns, `down` over rows; quantized where they lie."""
    host = weights()
    params = {
        "up": {"kernel": global_array(host["up"], NamedSharding(mesh, COLUMNS))},
        "down": {"kernel": global_array(host["down"], NamedSharding(mesh, ROWS))},
    }
    x = global_array(host["x"], NamedSharding(mesh, P()))
    q = lowbit.quantize(params, RECIPE)
    out = jax.jit(lowbit.run(mlp), out_shardings=NamedSharding(mesh, P()))(q, x)
    return q, out


def _local_pieces(q) -> np.ndarray:
    """Per quantized leaf, the rows x columns of this process's first piece of its codes."""
    leaves = [q["up"]["kernel"].codes, q["down"]["kernel"].codes]
    return np.asarray([leaf.addressable_shards[0].data.shape for leaf in leaves])


def quantize_run(out_dir: str) -> dict[str, np.ndarray]:
    """quantize + run on meshes of every process's devices, automatic and explicit axes."""
    results = {}
    for kind in ("Auto", "Explicit"):
        axis_type = getattr(jax.sharding.AxisType, kind)
        mesh = jax.make_mesh((jax.device_count(),), ("x",), axis_types=(axis_type,))
        with jax.set_mesh(mesh):
            q, out = quantize_and_run(mesh)
        results[f"out_{kind}"] = np.asarray(out.addressable_data(0))
        results[f"pieces_{kind}"] = _local_pieces(q)
    return results


def orbax_save(out_dir: str) -> dict[str, np.ndarray]:
    """Every process saves its pieces of a sharded QArray tree with Orbax (async)."""
    import orbax.checkpoint as ocp

    mesh = jax.make_mesh(
        (jax.device_count(),), ("x",), axis_types=(jax.sharding.AxisType.Explicit,)
    )
    with jax.set_mesh(mesh):
        q, out = quantize_and_run(mesh)
        checkpointer = ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler())
        checkpointer.save(f"{out_dir}/orbax", args=ocp.args.StandardSave(q))
        checkpointer.wait_until_finished()
        checkpointer.close()
        # lowbit's own format is written by one process holding every piece: it says so.
        try:
            lowbit.io.save_checkpoint(f"{out_dir}/lowbit{jax.process_index()}", q)
            refused = ""
        except ValueError as err:
            refused = str(err)
    return {"out": np.asarray(out.addressable_data(0)), "refused": np.asarray(refused)}


def calibration_batches(mesh=None) -> list:
    """Four batches of 160 rows; on a mesh each is one global array split over its rows, so
    every process feeds only its own rows (data-parallel calibration)."""
    rng = np.random.default_rng(1)
    batches = [rng.normal(size=(160, 256)).astype(np.float32) for _ in range(4)]
    if mesh is None:
        return [(b,) for b in batches]
    return [(global_array(b, NamedSharding(mesh, P("x", None))),) for b in batches]


CALIBRATED = ("int4w_g64_gptq", "int4w_g64_awq", "int8_smoothquant")


def calibrated(mesh=None) -> dict[str, np.ndarray]:
    """GPTQ, AWQ and SmoothQuant of replicated weights, with the calibration rows split over
    the mesh: per recipe and weight, this process's codes and scales."""
    host = weights()
    params = {"up": {"kernel": host["up"]}, "down": {"kernel": host["down"]}}
    if mesh is not None:
        params = jax.tree.map(lambda a: global_array(a, NamedSharding(mesh, P())), params)
    out = {}
    for recipe in CALIBRATED:
        q = lowbit.quantize(
            params, recipe, fn=mlp, calibration=calibration_batches(mesh), kernel_layouts=False
        )
        for name in q:
            for field in ("codes", "scale"):
                leaf = getattr(q[name]["kernel"], field)
                out[f"{recipe}/{name}/{field}"] = np.asarray(leaf.addressable_data(0))
    return out


def calibrate(out_dir: str) -> dict[str, np.ndarray]:
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    with jax.set_mesh(mesh):
        return calibrated(mesh)
