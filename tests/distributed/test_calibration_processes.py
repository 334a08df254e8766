"""GPTQ across local JAX processes (CPU devices, gloo collectives): each process calibrates on
its own rows, the Hessian solves are spread over the processes, and every process ends with
the one-process result; processes that disagree on the recipe, and a coordinator nobody
answers, fail with an error instead of hanging."""

import socket
import subprocess
import sys
import textwrap

import gptq_scenarios
import harness
import jax
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    not hasattr(jax, "set_mesh") or not hasattr(jax.sharding, "AxisType"),
    reason="explicit mesh axes need a newer JAX",
)
PROCESSES = 2
WEIGHTS = [f"{name}/kernel" for name in gptq_scenarios.SHAPES]


PER_PROCESS = ("solved_here", "solved_by", "placed")


# Explicit axes are covered by test_multiprocess.py's calibration test (jax.make_mesh's default
# axes, GPTQ spread by default); this one adds automatic axes and the per-process counts.
@pytest.mark.parametrize("kind", ["Auto"])
def test_gptq_solves_spread_over_processes_equal_every_process_solving(tmp_path, kind):
    """Spread solves give every process the tree each would have solved itself, bit for bit
    (codes, scales, zero points, report lines). Against one process on the union of the
    batches the summed Gram matrices differ in the last bits (the order of float sums), so
    codes may differ in a few elements; on symmetric int4 they do not."""
    results = harness.run_processes("gptq_scenarios.spread_gptq", PROCESSES, tmp_path, args=(kind,))
    # Largest first to the least loaded: b (256 x 384²) to process 0; a (384 x 256²), c and
    # d to process 1.
    owners = {"a/kernel": 1, "b/kernel": 0, "c/kernel": 1, "d/kernel": 1}
    one = gptq_scenarios.quantized(recipe=gptq_scenarios.SYMMETRIC)
    assert one["solved_here"].tolist() == WEIGHTS  # one process solves them all
    solved = []
    for pid, result in enumerate(results):
        spread = {
            k.removeprefix("spread/"): v for k, v in result.items() if k.startswith("spread/")
        }
        every = {k.removeprefix("all/"): v for k, v in result.items() if k.startswith("all/")}
        sym = {k.removeprefix("sym/"): v for k, v in result.items() if k.startswith("sym/")}
        assert set(spread) == set(every)
        for name, value in every.items():
            if name not in PER_PROCESS:
                np.testing.assert_array_equal(spread[name], value, err_msg=f"{pid}: {name}")
        for name, value in one.items():
            if name not in PER_PROCESS:
                np.testing.assert_array_equal(sym[name], value, err_msg=f"{pid}: sym {name}")
        # Without spreading, every process solved every weight.
        assert every["solved_here"].tolist() == WEIGHTS
        assert every["solved_by"].tolist() == [-1] * 4
        for result in (spread, sym):
            # Every process got every weight, replicated on all devices of the mesh ...
            assert result["placed"].tolist() == [[1, PROCESSES * harness.LOCAL_DEVICES]] * 4
            assert result["solved_by"].tolist() == [owners[w] for w in WEIGHTS]
            # ... and solved only its own share.
            mine = sorted(w for w, owner in owners.items() if owner == pid)
            assert result["solved_here"].tolist() == mine
        solved += spread["solved_here"].tolist()
    assert sorted(solved) == WEIGHTS  # each weight solved once, over all processes


def test_processes_that_disagree_on_the_recipe_raise_naming_them(tmp_path):
    results = harness.run_processes(
        "gptq_scenarios.disagreeing_recipes", PROCESSES, tmp_path, timeout=120
    )
    for result in results:
        error = str(result["error"])
        assert "disagree on the recipe" in error
        assert "process 0 has recipe 'int4w_g64_asym_gptq'" in error
        assert "process 1 has recipe 'int4w_g64_gptq'" in error


def test_unreachable_coordinator_fails_after_the_initialization_timeout():
    """The recipe of docs/sharding.md starts with `jax.distributed.initialize`; a coordinator
    that never answers ends the process after `initialization_timeout` seconds with JAX's
    DEADLINE_EXCEEDED on registering with it (no hang)."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = textwrap.dedent(f"""
        import jax
        jax.distributed.initialize("127.0.0.1:{port}", num_processes=2, process_id=1,
                                   initialization_timeout=3)
        print("initialized")
    """)
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    log = done.stdout + done.stderr
    assert done.returncode != 0, log
    assert "initialized" not in done.stdout
    assert "DEADLINE_EXCEEDED" in log and "RegisterTask" in log, log[-2000:]
