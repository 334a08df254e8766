"""The TPU (Mosaic) body of `weight_only_matmul` against the dequantized float math.

Off a TPU the body runs in the Pallas TPU interpreter with race detection and uninitialized
memory read as NaN (a tile that misses a step or reads an unwritten accumulator shows up), and
it is lowered for TPU from this host (Pallas's Mosaic lowering, short of the TPU compiler).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from lowbit.kernels import pallas
from lowbit.kernels._pallas_tpu import TpuBlocks
from lowbit.qarray import PerChannel, PerGroup, quantize

ON_TPU = jax.default_backend() == "tpu"
INTERPRET = False if ON_TPU else pltpu.InterpretParams(detect_races=True)
TOLERANCE = {jnp.bfloat16: 2e-2, jnp.float32: 1e-5}


def weight(fmt, k, n, granularity, pack_axis=None, seed=0):
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32)
    return quantize(jnp.asarray(w), fmt, granularity=granularity, pack_axis=pack_axis)


def activations(m, k, dtype, seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((m, k)), dtype)


def assert_matches_dequantized(x, q, y, dtype):
    want = np.asarray(x, np.float64) @ np.asarray(q.dequantize(jnp.float32), np.float64)
    tol = TOLERANCE[dtype] * float(np.max(np.abs(want)))
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=0, atol=tol)


# (format, granularity, pack_axis (None: N), K, N, M, activation dtype): one K step and many,
# one N block and many, a step within one group and a step of several groups, M padded.
CASES = [
    ("int4", PerGroup(32, 0), None, 1024, 512, 3, jnp.float32),
    ("int4", PerChannel((1,)), 0, 256, 128, 1, jnp.bfloat16),
    ("uint4", PerGroup(64, 0), None, 512, 256, 17, jnp.bfloat16),
    ("uint4", PerGroup(256, 0), 0, 2048, 256, 2, jnp.float32),
    ("nf4", PerGroup(64, 0), None, 256, 512, 2, jnp.bfloat16),
    ("nf4", PerChannel((1,)), 0, 64, 64, 8, jnp.float32),
    ("int8", PerChannel((1,)), None, 256, 128, 1, jnp.bfloat16),
    ("int8", PerGroup(128, 0), None, 1024, 384, 9, jnp.float32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{c[3]}x{c[4]}")
def test_tpu_body_matches_dequantized_product(case):
    fmt, granularity, pack_axis, k, n, m, dtype = case
    q = weight(fmt, k, n, granularity, pack_axis)
    x = activations(m, k, dtype)
    y = pallas.weight_only_matmul(x, q, out_dtype=jnp.float32, interpret=INTERPRET, platform="tpu")
    assert y.shape == (m, n)
    assert_matches_dequantized(x, q, y, dtype)


def test_blocks_follow_the_tpu_tiling():
    q = weight("int4", 4096, 4096, PerGroup(128, 0))
    assert pallas.blocks_for(q, 1, platform="tpu") == TpuBlocks(16, 1024, 512)
    assert pallas.blocks_for(q, 1, platform="tpu", x_dtype=jnp.float32) == TpuBlocks(8, 1024, 512)
    assert pallas.blocks_for(q, 1000, platform="tpu").m == 256
    # A group of 32 rows: steps hold several groups (a multiple of the 8-row sublane tile).
    small_groups = weight("uint4", 512, 256, PerGroup(32, 0), pack_axis=0)
    assert pallas.blocks_for(small_groups, 4, platform="tpu").k == 512
    # Odd sizes take whole axes.
    odd = weight("int8", 96, 80, PerChannel((1,)))
    assert pallas.blocks_for(odd, 4, platform="tpu") == TpuBlocks(16, 80, 96)


def test_explicit_tpu_blocks():
    q = weight("int4", 1024, 512, PerGroup(128, 0))
    x = activations(40, 1024, jnp.bfloat16)
    y = pallas.weight_only_matmul(
        x, q, out_dtype=jnp.float32, interpret=INTERPRET, platform="tpu",
        block_m=16, block_n=256, block_k=128,
    )  # fmt: skip
    assert_matches_dequantized(x, q, y, jnp.bfloat16)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"split_k": 2}, "split_k, num_warps and num_stages are Triton's"),
        ({"block_m": 12}, "block_m=12 must be a multiple of 16"),
        ({"block_n": 64}, "block_n=64"),
        ({"block_k": 64}, "no K step fits"),
    ],
)
def test_bad_tpu_blocks_raise(kwargs, match):
    q = weight("int4", 512, 512, PerGroup(128, 0))
    with pytest.raises(ValueError, match=match):
        pallas.weight_only_matmul(
            activations(2, 512, jnp.bfloat16), q, interpret=INTERPRET, platform="tpu", **kwargs
        )


def test_groups_no_tpu_step_fits_are_refused():
    # Groups of 8 rows packed along K: 4 code rows a group, under the 8-row sublane tile a
    # reshaped group needs. `supports` says no, so the engine keeps XLA's path.
    q = weight("int4", 4096, 256, PerGroup(8, 0), pack_axis=0)
    assert pallas.supports(q, 1, jnp.bfloat16, "tpu") is None
    with pytest.raises(ValueError, match="group of 128 or more"):
        pallas.weight_only_matmul(activations(1, 4096, jnp.bfloat16), q, platform="tpu")


def test_unknown_platform_raises():
    q = weight("int8", 256, 128, PerChannel((1,)))
    with pytest.raises(ValueError, match="platform='rocm'"):
        pallas.weight_only_matmul(activations(1, 256, jnp.float32), q, platform="rocm")


def test_gradient_with_respect_to_x_on_the_tpu_body():
    q = weight("nf4", 256, 256, PerGroup(64, 0))
    x = activations(3, 256, jnp.float32)
    fn = lambda x: pallas.weight_only_matmul(x, q, interpret=INTERPRET, platform="tpu").sum()
    got = jax.jit(jax.grad(fn))(x)
    want = np.broadcast_to(np.asarray(q.dequantize(jnp.float32)).sum(axis=1), x.shape)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pack_axis", [None, 0])
def test_tpu_body_lowers_for_tpu_from_this_host(pack_axis):
    q = weight("int4", 1024, 512, PerGroup(32, 0), pack_axis)
    x = activations(4, 1024, jnp.bfloat16)
    fn = lambda x, q: pallas.weight_only_matmul(x, q, platform="tpu")
    text = jax.jit(fn).trace(x, q).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text
    assert "lowbit_int4_matmul_tpu" in text
