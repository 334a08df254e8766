"""Kernel layouts stored on QArrays at quantize / load time: used by the kernel route, equal to
the per-call layout, carried by transposes, dropped by every other layout change."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ops_helpers import EPS32, iter_eqns, jit_quantize, normal

from lowbit import kernels
from lowbit.ops import attach_kernel_layout, dot_general, dot_general_path, dot_general_reference
from lowbit.qarray import MinMax, PerChannel, PerGroup, PerToken, QArray, QuantConfig

pytestmark = pytest.mark.skipif(
    not kernels.available() or jax.default_backend() != "cpu",
    reason="CPU kernels unavailable: " + kernels.status(),
)

K, N = 256, 264
DIMS = (((1,), (0,)), ((), ()))
DIMS_T = (((1,), (1,)), ((), ()))
CONFIGS = {
    "int8": (QuantConfig(format="int8", granularity=PerChannel((1,))), None),
    "int4_group_asym": (
        QuantConfig(
            format="int4", granularity=PerGroup(32, 0), symmetric=False, calibration=MinMax()
        ),
        None,
    ),
    "nf4_group": (QuantConfig(format="nf4", granularity=PerGroup(64, 0)), None),
    "fp8": (QuantConfig(format="fp8_e4m3fn", granularity=PerChannel((1,))), None),
    "w8a8": (
        QuantConfig(format="int8", granularity=PerChannel((1,))),
        QuantConfig(format="int8", granularity=PerToken()),
    ),
}


def _weight(name: str) -> QArray:
    config, activation = CONFIGS[name]
    q = jit_quantize(normal(1, (K, N)), config)
    return dataclasses.replace(q, activation=activation)


@jax.jit
def _dot(x, q):
    return dot_general(x, q, DIMS)


def _primitive_names(fn, *args) -> set[str]:
    return {eqn.primitive.name for eqn in iter_eqns(jax.make_jaxpr(fn)(*args).jaxpr)}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_stored_layout_gives_the_per_call_result_without_the_repack(name):
    q = _weight(name)
    stored = attach_kernel_layout(q)
    assert q.kernel is None
    assert isinstance(stored.kernel, kernels.PreparedWeight) and stored.kernel_axis == 0
    assert stored.kernel_nbytes > 0 and stored.nbytes == q.nbytes
    x = normal(2, (5, K))
    assert dot_general_path(x, stored, DIMS) == dot_general_path(x, q, DIMS)
    np.testing.assert_array_equal(np.asarray(_dot(x, stored)), np.asarray(_dot(x, q)))
    # The per-call route repacks (padding to whole panels); the stored one calls the kernel.
    assert "pad" in _primitive_names(_dot, x, q)
    assert "pad" not in _primitive_names(_dot, x, stored)
    # Attaching twice is a no-op.
    assert attach_kernel_layout(stored) is stored


def test_row_scaled_weight_is_laid_out_for_x_at_w_transposed():
    # A tied embedding [vocab, dim] with one scale per row, used as the output projection.
    table = jit_quantize(
        normal(3, (N, K)), QuantConfig(format="int8", granularity=PerChannel((0,)))
    )
    stored = attach_kernel_layout(table)
    assert stored.kernel_axis == 1
    x = normal(4, (3, K))
    assert dot_general_path(x, stored, DIMS_T) == "cpu_kernel_int8"
    out = jax.jit(lambda x, q: dot_general(x, q, DIMS_T))
    got = np.asarray(out(x, stored))
    np.testing.assert_array_equal(got, np.asarray(out(x, table)))
    ref = np.asarray(dot_general_reference(x, table, DIMS_T))
    magnitude = np.abs(np.asarray(x)) @ np.abs(np.asarray(table.dequantize())).T
    np.testing.assert_array_less(np.abs(got - ref), (2 * K + 8) * EPS32 * magnitude + 1e-30)
    # Asked for the other axis, it is laid out for x @ table instead (a [N, K] -> [K, N] use
    # with the scale along K is not a kernel layout, so nothing is attached).
    assert attach_kernel_layout(table, axis=0).kernel is None


def test_transpose_and_astype_carry_the_layout_other_changes_drop_it():
    stored = attach_kernel_layout(_weight("int8"))
    assert stored.T.kernel is stored.kernel and stored.T.kernel_axis == 1
    assert stored.T.T.kernel_axis == 0
    assert stored.astype(jnp.bfloat16).kernel is stored.kernel
    assert dataclasses.replace(stored, codes=stored.codes).kernel is None
    assert dataclasses.replace(stored, activation=None).kernel is None
    with pytest.raises(ValueError, match="kernel axis"):
        stored.with_kernel(stored.kernel, 2)


def test_layout_survives_jit_and_tree_maps():
    stored = attach_kernel_layout(_weight("int4_group_asym"))
    same = jax.jit(lambda q: q)(stored)
    assert isinstance(same.kernel, kernels.PreparedWeight) and same.kernel_axis == 0
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(stored)[0]]
    assert any(p.startswith(".kernel") for p in paths) and ".codes" in paths
    doubled = jax.tree.map(lambda a: a, stored)
    assert doubled.kernel is not None and doubled.kernel_axis == 0


def test_non_kernel_values_are_returned_unchanged():
    small = jit_quantize(normal(6, (16, 16)), QuantConfig(format="int8"))
    assert attach_kernel_layout(small) is small
    array = jnp.ones((K, N))
    assert attach_kernel_layout(array) is array
    stacked = jit_quantize(normal(7, (2, K, N)), QuantConfig(format="int8"))
    assert attach_kernel_layout(stacked) is stacked
    with pytest.raises(ValueError, match="axis"):
        attach_kernel_layout(_weight("int8"), axis=2)
