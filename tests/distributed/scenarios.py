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
        # lowbit's own format too: each process writes its own pieces into one checkpoint.
        lowbit.io.save_checkpoint(f"{out_dir}/lowbit", q)
    return {"out": np.asarray(out.addressable_data(0))}


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


# A Gram matrix as `capture` sums one over rows split across processes: SmolLM2's widest input
# (its MLP's 1536), 9.4 MB. XLA:CPU's gloo reduce-scatter returns wrong values for chunks of
# 4 MiB (jax-ml/jax#40830); the sum must be an all-reduce, and right at this size.
GRAM_INPUTS = 1536


def gram_rows() -> np.ndarray:
    return np.random.default_rng(2).normal(size=(64, GRAM_INPUTS)).astype(np.float32)


def calibrate(out_dir: str) -> dict[str, np.ndarray]:
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    with jax.set_mesh(mesh):
        out = calibrated(mesh)
        rows = global_array(gram_rows(), NamedSharding(mesh, P("x", None)))
        gram = jax.jit(
            lambda r: jnp.dot(
                r.T, r, precision=jax.lax.Precision.HIGHEST, out_sharding=NamedSharding(mesh, P())
            )
        )
        out["collective/gram"] = np.asarray(gram(rows).addressable_data(0))
        out["collective/hlo"] = np.asarray(gram.lower(rows).compile().as_text())
    return out


def four_processes(out_dir: str) -> dict[str, np.ndarray]:
    """`quantize_run` and symmetric GPTQ calibrated on rows split over the processes, its
    solves spread over them (`gptq_scenarios.quantized`, on `jax.make_mesh`'s default axes),
    in one start of the processes: each start costs every process a JAX start-up."""
    import gptq_scenarios

    out = {f"run/{k}": v for k, v in quantize_run(out_dir).items()}
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    with jax.set_mesh(mesh):
        gptq = gptq_scenarios.quantized(mesh, gptq_scenarios.SYMMETRIC)
    out.update({f"gptq/{k}": v for k, v in gptq.items()})
    return out


# --- lowbit checkpoints written and read by several processes --------------------------------


def checkpoint_tree(mesh) -> dict:
    """What the checkpoint tests save: the quantized MLP split over `mesh` (up by columns,
    down by rows), a float leaf split over it, a replicated one and a Python scalar."""
    host = weights()
    params = {
        "up": {"kernel": global_array(host["up"], NamedSharding(mesh, COLUMNS))},
        "down": {"kernel": global_array(host["down"], NamedSharding(mesh, ROWS))},
    }
    tree = dict(lowbit.quantize(params, RECIPE))
    norm = np.arange(32, dtype=np.float32) / 7
    tree["norm"] = global_array(norm, NamedSharding(mesh, P("x")))
    tree["bias"] = global_array(norm[:8] - 1, NamedSharding(mesh, P()))
    tree["step"] = 3
    return tree


def flat_mesh(kind: str = "Auto"):
    axis_type = getattr(jax.sharding.AxisType, kind)
    return jax.make_mesh((jax.device_count(),), ("x",), axis_types=(axis_type,))


def grid_mesh(rows: int, kind: str = "Auto"):
    axis_type = getattr(jax.sharding.AxisType, kind)
    shape = (rows, jax.device_count() // rows)
    return jax.make_mesh(shape, ("a", "b"), axis_types=(axis_type,) * 2)


def grid_sharding(mesh):
    """`load_checkpoint`'s sharding= for a 2-D mesh ("a", "b"): 2-D tensors split over both
    axes where they divide, 1-D ones over both together, the rest replicated."""
    a, b = mesh.shape["a"], mesh.shape["b"]

    def sharding(path, role, shape):
        if len(shape) == 2 and shape[0] % a == 0 and shape[1] % b == 0:
            return NamedSharding(mesh, P("a", "b"))
        if len(shape) == 1 and shape[0] % (a * b) == 0:
            return NamedSharding(mesh, P(("a", "b")))
        return NamedSharding(mesh, P())

    return sharding


def local_pieces(tree, prefix: str) -> dict[str, np.ndarray]:
    """This process's pieces of every array leaf: ``prefix|leaf|box`` -> its values."""
    from lowbit.io._shard_index import box_of

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            box = box_of(shard.index, leaf.shape)
            out[f"{prefix}|{jax.tree_util.keystr(path)}|{box}"] = np.asarray(shard.data)
    return out


def _loaded(path: str, sharding, prefix: str) -> dict[str, np.ndarray]:
    """Loads `path` onto `sharding`; its pieces, and which shard files this process read."""
    from lowbit.io import _checkpoint_pieces

    reads = []
    read = _checkpoint_pieces._read

    def recording(stored, dtype, file):
        reads.append(f"{stored.shard.file}|{stored.shard.key}")
        return read(stored, dtype, file)

    _checkpoint_pieces._read = recording
    try:
        tree = lowbit.io.load_checkpoint(path, sharding=sharding)
    finally:
        _checkpoint_pieces._read = read
    return {**local_pieces(tree, prefix), f"{prefix}|reads": np.asarray(sorted(set(reads)))}


def checkpoint_save(out_dir: str, path: str, kind: str = "Auto") -> dict[str, np.ndarray]:
    """Every process saves its pieces of `checkpoint_tree` to `path` (lowbit's format), on a
    mesh with `kind` ("Auto" or "Explicit") axes."""
    mesh = flat_mesh(kind)
    with jax.set_mesh(mesh):
        lowbit.io.save_checkpoint(path, checkpoint_tree(mesh), metadata={"step": 3})
    return {"saved": np.asarray(jax.process_index())}


def checkpoint_load(out_dir: str, path: str, rows: str, kind: str = "Auto") -> dict:
    """Loads `path` onto a (rows, devices / rows) mesh with `kind` axes: this process's
    pieces."""
    return _loaded(path, grid_sharding(grid_mesh(int(rows), kind)), "grid")


def checkpoint_round_trip(out_dir: str, path: str, one_process: str) -> dict[str, np.ndarray]:
    """Saves to `path`, loads it back onto another mesh shape (2 x devices / 2, automatic
    and explicit axes) and onto the mesh it was saved from, and loads `one_process` (saved by
    one process) onto the mesh."""
    out = checkpoint_save(out_dir, path)
    out.update(_loaded(path, grid_sharding(grid_mesh(2)), "grid"))
    out.update(_loaded(path, grid_sharding(grid_mesh(2, "Explicit")), "explicit"))
    flat = flat_mesh()
    out.update(_loaded(path, lambda p, r, s: _same_as_saved(flat, p, s), "same"))
    out.update(_loaded(one_process, lambda p, r, s: _same_as_saved(flat, p, s), "one"))
    return out


def _same_as_saved(mesh, path, shape):
    """The sharding `checkpoint_tree` saved the tensor at leaf `path` with."""
    if path[0] == "up" and shape[1] % mesh.size == 0:
        return NamedSharding(mesh, COLUMNS)
    if path[0] in ("down", "norm") and shape[0] % mesh.size == 0:
        return NamedSharding(mesh, ROWS if path[0] == "down" else P("x"))
    return NamedSharding(mesh, P())


def checkpoint_dies(out_dir: str, path: str, how: str) -> dict[str, np.ndarray]:
    """Process 1 exits (`how` "exit") or raises ("raise") in the middle of a save over `path`;
    each process reports the error it saw."""
    import os

    mesh = flat_mesh()
    with jax.set_mesh(mesh):
        tree = checkpoint_tree(mesh)
    try:
        with lowbit.io.CheckpointWriter(path, timeout=10) as writer:
            writer.add("up", tree["up"])
            if jax.process_index() == 1 and how == "exit":
                os._exit(17)  # killed mid-save: no cleanup, no message
            if jax.process_index() == 1:
                raise OSError("disk full")
            writer.add("down", tree["down"])
        error = ""
    except Exception as err:  # noqa: BLE001 - reported to the test
        error = f"{type(err).__name__}: {err}"
    if how == "raise":
        return {"error": np.asarray(error)}
    np.savez(f"{out_dir}/result{jax.process_index()}.npz", error=np.asarray(error))
    os._exit(0)  # the other process is gone: no orderly shutdown of the runtime
