"""Tensor- and data-parallel generation across local JAX processes (CPU devices, gloo
collectives) gives the one-process tokens."""

import generation_scenarios
import harness
import jax
import numpy as np
import pytest

from lowbit import kernels

pytestmark = pytest.mark.skipif(
    not hasattr(jax, "set_mesh") or not hasattr(jax.sharding, "AxisType"),
    reason="explicit mesh axes need a newer JAX",
)


@pytest.mark.parametrize("processes", [2, 4])
def test_sharded_generation_across_processes_equals_one_device(tmp_path, processes):
    meshes = generation_scenarios.MESHES[processes * harness.LOCAL_DEVICES]
    expected = generation_scenarios.generate()
    results = harness.run_processes("generation_scenarios.tp_generate", processes, tmp_path)
    for pid, result in enumerate(results):
        # gate/up/down of both layers run as pieces laid out on each process (CPU kernels).
        assert result.pop("pieces") == (6 if kernels.available() else 0), pid
        assert set(result) == {f"{name}_{kind}" for name, _, kind in meshes}
        for name, tokens in result.items():
            np.testing.assert_array_equal(tokens, expected, err_msg=f"process {pid}, {name}")
