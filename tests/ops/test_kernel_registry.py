"""Kernels register by (weight format, platform); a product's plan chooses among them, and a
new kernel is one handler and one entry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ops_helpers import iter_eqns

from lowbit.kernels import by_platform_p
from lowbit.ops import _cpu_kernels, _registry, dot_general, plan_dot_general
from lowbit.ops._registry import Kernel, register, registered
from lowbit.qarray import PerGroup, quantize

DIMS = (((1,), (0,)), ((), ()))


def _weight(fmt="int4", k=512, n=256):
    w = np.random.default_rng(0).standard_normal((k, n)).astype(np.float32) / np.sqrt(k)
    return quantize(jnp.asarray(w), fmt, granularity=PerGroup(64))


def test_the_shipped_kernels_are_registered_by_format_and_platform():
    assert _cpu_kernels.CPU_KERNEL in registered("int4", "cpu")
    assert _cpu_kernels.CPU_KERNEL in registered("q4_k", "cpu")
    assert [k.name for k in registered("nf4", "cuda")] == ["pallas"]
    assert [k.name for k in registered("int8", "cuda")] == ["pallas", "k_major"]
    assert [k.name for k in registered("fp8_e4m3fn", "cuda")] == ["k_major"]
    assert registered("int4", "rocm") == ()


def test_a_new_kernel_is_one_handler_and_one_entry(monkeypatch):
    monkeypatch.setattr(_registry, "_KERNELS", dict(_registry._KERNELS))
    seen = []

    def applies(lhs, rhs, dims):
        seen.append(rhs.shape)
        return "tiles-of-8"  # the kernel's static configuration

    def run(lhs, rhs, config, call):
        assert config == "tiles-of-8"
        return call.portable(lhs, rhs, call.dimension_numbers) * 2  # a marker of this branch

    register(Kernel("doubling", "rocm", ("int4",), applies, run))
    q, x = _weight(), jnp.ones((2, 512), jnp.float32)
    plan = plan_dot_general(x, q, DIMS)
    assert [(c.platform, c.kernel.name) for c in plan.kernels][-1] == ("rocm", "doubling")
    assert seen == [(512, 256)]  # asked once, at planning
    jaxpr = jax.make_jaxpr(lambda x, q: dot_general(x, q, DIMS, plan=plan))(x, q)
    eqn = next(e for e in iter_eqns(jaxpr) if e.primitive is by_platform_p)
    rocm = eqn.params["branches"][eqn.params["platforms"].index("rocm")]
    (got,) = jax.core.eval_jaxpr(rocm.jaxpr, rocm.consts, *jax.tree.leaves((x, q)))
    # This host's own lowering is unchanged; the ROCm branch is the new kernel's.
    want = jax.jit(lambda x, q: dot_general(x, q, DIMS))(x, q)
    np.testing.assert_allclose(np.asarray(got), 2 * np.asarray(want), rtol=1e-5, atol=1e-5)


def test_an_output_sharding_keeps_every_platform_portable():
    q, x = _weight(), jnp.ones((2, 512), jnp.float32)
    assert plan_dot_general(x, q, DIMS).kernels
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    assert plan_dot_general(x, q, DIMS, out_sharding=sharding).kernels == ()


def test_a_kernel_for_an_unknown_platform_is_refused():
    with pytest.raises(ValueError, match="names platform 'gpu'"):
        register(Kernel("k", "gpu", ("int4",), lambda *a: None, lambda *a: None))
