"""GPTQ calibrated data-parallel in each of several processes (see worker.py), with the
Hessian solves spread over them; the same functions give the one-process reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lowbit
from lowbit.algorithms import AlgorithmReport, _rounding
from lowbit.api import AlgorithmOptions

# Four weights of different sizes: the balanced assignment gives each process a share.
SHAPES = {"a": (256, 384), "b": (384, 256), "c": (256, 128), "d": (128, 256)}
RECIPE = "int4w_g64_asym_gptq"  # codes, scales and zero points
SYMMETRIC = "int4w_g64_gptq"


def weights() -> dict[str, np.ndarray]:
    """Host copies every process builds identically."""
    rng = np.random.default_rng(0)
    return {k: rng.normal(size=s).astype(np.float32) / 16 for k, s in SHAPES.items()}


def chain(params, x):
    for name in SHAPES:
        x = jnp.tanh(x @ params[name]["kernel"])
    return x


def global_array(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def batches(mesh=None) -> list:
    """Four batches of 160 rows; on a mesh each is split over its rows (each process feeds
    only its own rows)."""
    rng = np.random.default_rng(1)
    host = [rng.normal(size=(160, 256)).astype(np.float32) for _ in range(4)]
    if mesh is None:
        return [(b,) for b in host]
    return [(global_array(b, NamedSharding(mesh, P("x", None))),) for b in host]


def quantized(mesh=None, recipe: str = RECIPE, spread: bool = True) -> dict[str, np.ndarray]:
    """GPTQ of the chain's replicated weights (rows of the batches split over `mesh`): codes,
    scales and zero points of each weight, the report's lines and which process solved each
    weight (by the report, and by counting this process's GPTQ solves)."""
    params = {k: {"kernel": v} for k, v in weights().items()}
    if mesh is not None:
        params = jax.tree.map(lambda a: global_array(a, NamedSharding(mesh, P())), params)
    solved = []
    solve = _rounding.gptq_qarray

    def counting(w, q, stats, *args, **kwargs):
        solved.append(stats[0].path)
        return solve(w, q, stats, *args, **kwargs)

    report = AlgorithmReport()
    _rounding.gptq_qarray = counting
    try:
        q = lowbit.quantize(
            params,
            recipe,
            fn=chain,
            calibration=batches(mesh),
            kernel_layouts=False,
            report=report,
            algorithm_options=AlgorithmOptions(spread=spread),
        )
    finally:
        _rounding.gptq_qarray = solve
    out = {}
    for name in SHAPES:
        for field in ("codes", "scale", "zero_point"):
            leaf = getattr(q[name]["kernel"], field)
            if leaf is not None:
                out[f"{name}/{field}"] = np.asarray(leaf.addressable_data(0))
    codes = [q[name]["kernel"].codes for name in SHAPES]
    # Where each weight's codes live: replicated over how many devices.
    out["placed"] = np.asarray(
        [(c.sharding.is_fully_replicated, len(c.sharding.device_set)) for c in codes]
    )
    out["lines"] = np.asarray(report.lines())
    out["solved_here"] = np.asarray(sorted(solved))
    out["solved_by"] = np.asarray([report.solved_by.get(f"{n}/kernel", -1) for n in SHAPES])
    return out


def spread_gptq(out_dir: str, kind: str = "Explicit") -> dict[str, np.ndarray]:
    """On a mesh with `kind` axes: `RECIPE` with the solves spread ("spread/...") and solved by
    every process ("all/..."), and symmetric int4 GPTQ spread ("sym/...")."""
    axis_type = getattr(jax.sharding.AxisType, kind)
    mesh = jax.make_mesh((jax.device_count(),), ("x",), axis_types=(axis_type,))
    out = {}
    with jax.set_mesh(mesh):
        for prefix, recipe, spread in (
            ("spread", RECIPE, True),
            ("all", RECIPE, False),
            ("sym", SYMMETRIC, True),
        ):
            for key, value in quantized(mesh, recipe, spread).items():
                out[f"{prefix}/{key}"] = value
    return out


def disagreeing_recipes(out_dir: str) -> dict[str, np.ndarray]:
    """Process 1 asks for symmetric int4 where the others ask for asymmetric: each reports
    its error."""
    recipe = SYMMETRIC if jax.process_index() == 1 else RECIPE
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    try:
        with jax.set_mesh(mesh):
            quantized(mesh, recipe=recipe)
        error = ""
    except ValueError as err:
        error = str(err)
    return {"error": np.asarray(error)}
