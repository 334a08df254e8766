"""lowbit in several JAX processes on this machine (CPU devices, gloo collectives): quantized
weights sharded across processes give the one-process values, and no process holds more than
its own pieces."""

import gptq_scenarios
import jax
import numpy as np
import pytest
import scenarios
from harness import LOCAL_DEVICES, run_processes

pytestmark = pytest.mark.skipif(
    not hasattr(jax, "set_mesh") or not hasattr(jax.sharding, "AxisType"),
    reason="explicit mesh axes need a newer JAX",
)
PROCESSES = 2


def one_process_run(processes: int) -> np.ndarray:
    """The same program in this one process, on as many devices as the workers have in all."""
    devices = processes * LOCAL_DEVICES
    mesh = jax.make_mesh((devices,), ("x",), devices=jax.devices()[:devices])
    with jax.set_mesh(mesh):
        _, out = scenarios.quantize_and_run(mesh)
    return np.asarray(out)


@pytest.fixture(scope="module")
def reference():
    return one_process_run(PROCESSES)


def check_run(result: dict, reference: np.ndarray, processes: int) -> None:
    """`scenarios.quantize_run`'s results: the one-process output, each process holding only
    its pieces."""
    devices = processes * LOCAL_DEVICES
    for kind in ("Auto", "Explicit"):
        np.testing.assert_allclose(result[f"out_{kind}"], reference, rtol=1e-5, atol=1e-5)
        # Each process holds only its pieces: up's columns, down's rows (int4 packs pairs of
        # columns into bytes).
        up, down = result[f"pieces_{kind}"]
        assert tuple(up) == (256, 512 // devices // 2)
        assert tuple(down) == (512 // devices, 256 // 2)


def check_calibrated(result: dict, reference: dict) -> None:
    """`scenarios.calibrate`'s results against one process's: GPTQ and AWQ bit for bit;
    SmoothQuant's scales differ in the last bits (the order of the float sums), its codes do
    not."""
    assert set(result) == set(reference)
    for name, expected in reference.items():
        if name.startswith("int8_smoothquant") and name.endswith("scale"):
            np.testing.assert_allclose(result[name], expected, rtol=1e-6)
        else:
            np.testing.assert_array_equal(result[name], expected, err_msg=name)


def test_quantize_and_run_across_processes(tmp_path, reference):
    for result in run_processes("quantize_run", PROCESSES, tmp_path):
        check_run(result, reference, PROCESSES)


def test_orbax_async_save_across_processes_restores_in_one(tmp_path, reference):
    ocp = pytest.importorskip("orbax.checkpoint")
    results = run_processes("orbax_save", PROCESSES, tmp_path)
    np.testing.assert_allclose(results[0]["out"], reference, rtol=1e-5, atol=1e-5)
    # Restore in this one process, onto another mesh (8 devices, replicated).
    mesh = jax.make_mesh((8,), ("x",))
    with jax.set_mesh(mesh):
        q, _ = scenarios.quantize_and_run(mesh)
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(
            a.shape,
            a.dtype,
            sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
        ),
        q,
    )
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "orbax", abstract)
    out = jax.jit(scenarios.lowbit.run(scenarios.mlp))(restored, scenarios.weights()["x"])
    np.testing.assert_allclose(np.asarray(out), reference, rtol=1e-5, atol=1e-5)
    # The same tree in lowbit's format, written by both processes, holds the same bits.
    ours = scenarios.lowbit.io.load_checkpoint(tmp_path / "lowbit")
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(restored), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_calibration_on_rows_split_over_processes_matches_one_process(tmp_path):
    """Each process feeds its own calibration rows; statistics are summed across processes."""
    reference = scenarios.calibrated()
    rows = scenarios.gram_rows().astype(np.float64)
    for result in run_processes("calibrate", PROCESSES, tmp_path):
        collective = _part(result, "collective/")
        rest = {k: v for k, v in result.items() if not k.startswith("collective/")}
        check_calibrated(rest, reference)
        # The statistics' cross-process sum at a Gram matrix's real size: an all-reduce (no
        # reduce-scatter, which gloo gets wrong for chunks of 4 MiB), and the right sums.
        hlo = str(collective["hlo"])
        assert "all-reduce" in hlo and "reduce-scatter" not in hlo
        np.testing.assert_allclose(collective["gram"], rows.T @ rows, rtol=1e-5, atol=1e-4)


def _part(result: dict, prefix: str) -> dict:
    return {k.removeprefix(prefix): v for k, v in result.items() if k.startswith(prefix)}


def test_four_processes_quantize_run_and_gptq(tmp_path):
    """quantize + run, and GPTQ calibrated on rows split over the processes with its solves
    spread over them, on 4 processes (one start, `scenarios.four_processes`): the one-process
    values, and each weight's Hessian solved by one process. (AWQ and SmoothQuant share the
    statistics' cross-process sums with GPTQ; they run on 2 processes above.)"""
    processes = 4
    run = one_process_run(processes)
    gptq = gptq_scenarios.quantized(recipe=gptq_scenarios.SYMMETRIC)
    solved = []
    for result in run_processes("four_processes", processes, tmp_path):
        check_run(_part(result, "run/"), run, processes)
        spread = _part(result, "gptq/")
        for name in gptq_scenarios.SHAPES:
            for field in ("codes", "scale"):
                key = f"{name}/{field}"
                np.testing.assert_array_equal(spread[key], gptq[key], err_msg=key)
        solved += spread["solved_here"].tolist()
    assert sorted(solved) == sorted(f"{name}/kernel" for name in gptq_scenarios.SHAPES)
