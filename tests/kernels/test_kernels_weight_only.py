"""Weight-only kernels against the pure-JAX reference, on every ISA path this CPU runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit import kernels
from lowbit.kernels import _reference

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.status())


def on_each_isa(fn):
    """fn() evaluated on every ISA path this CPU supports (as numpy), the best path restored."""
    names = kernels.supported_isas()
    outs = {}
    try:
        for name in names:
            assert kernels.set_isa(name) == name
            outs[name] = jax.tree.map(np.asarray, fn())
    finally:
        kernels.set_isa(names[-1])
    return outs


def make_weight(kind, k, n, group_size, seed=0):
    rng = np.random.default_rng(seed)
    groups = 1 if group_size is None else -(-k // group_size)
    if kind == "int8":
        codes = jnp.asarray(rng.integers(-128, 128, (k, n)), jnp.int8)
    elif kind == "fp8":
        codes = jnp.asarray(rng.standard_normal((k, n)) * 20, jnp.float8_e4m3fn)
    else:
        codes = jnp.asarray(rng.integers(0, 16, (k, n)), jnp.uint8)
    scale = jnp.asarray(rng.uniform(0.01, 0.1, (groups, n)), jnp.float32)
    zp = jnp.asarray(rng.uniform(0, 15, (groups, n)), jnp.float32) if kind == "uint4" else None
    return codes, scale, zp


CASES = [
    # kind, K, N, group_size
    ("int8", 131, 37, None),
    ("int8", 128, 40, 32),  # GGUF Q8_0 blocks
    ("fp8", 192, 20, 64),
    ("fp8", 97, 33, None),
    ("int4", 128, 48, 32),
    ("int4", 131, 17, None),
    ("int4", 576, 20, None),  # per-channel storage chunk 192 (a divisor of K)
    ("int4", 200, 24, 64),  # ragged last group
    ("uint4", 256, 40, 128),
    ("uint4", 67, 5, None),
    ("nf4", 192, 31, 64),
    ("nf4", 512, 16, 256),
    ("fp4", 128, 40, 32),
    ("fp4", 100, 17, None),
]


@pytest.mark.parametrize(("kind", "k", "n", "group_size"), CASES)
def test_matches_reference(kind, k, n, group_size):
    codes, scale, zp = make_weight(kind, k, n, group_size)
    w = kernels.pack(kind, codes, scale, zp, group_size)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((7, k)), jnp.float32)
    bias = jnp.linspace(-1.0, 1.0, n, dtype=jnp.float32)
    ref = np.asarray(_reference.weight_only_linear(x, kind, codes, scale, zp, group_size, bias))
    outs = on_each_isa(
        lambda: (kernels.weight_only_linear(x, w, bias), kernels.weight_only_linear(x[:1], w, bias))
    )
    for y, y1 in outs.values():
        assert y.shape == (7, n) and y.dtype == np.float32
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(y1, ref[:1], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["int8", "int4", "nf4", "fp8"])
def test_bf16_in_and_out(kind):
    group_size = 32 if kind in ("int4", "nf4") else None
    codes, scale, zp = make_weight(kind, 96, 40, group_size, seed=3)
    w = kernels.pack(kind, codes, scale, zp, group_size)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((5, 96)), jnp.bfloat16)
    ref = _reference.weight_only_linear(x, kind, codes, scale, zp, group_size, None, jnp.float32)
    ref = np.asarray(ref)
    outs = on_each_isa(
        lambda: (
            kernels.weight_only_linear(x, w),
            kernels.weight_only_linear(x, w, out_dtype=jnp.float32),
        )
    )
    for y16, y32 in outs.values():
        assert y16.dtype == jnp.bfloat16
        np.testing.assert_allclose(y16.astype(np.float32), ref, rtol=1e-2, atol=1e-2)
        np.testing.assert_allclose(y32, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m, dtype", [(70, jnp.float32), (197, jnp.float32), (197, jnp.bfloat16)])
def test_large_batch_uses_blocked_path(m, dtype):
    # M above the small-batch threshold and K above one K-block exercise the blocked loops;
    # 70 rows end in a partial GEMM tile on AVX2 and AVX-512; 197 rows are a full row block (192)
    # and a 5-row one, which takes the blocked path too (it reads only the k-major copy of
    # the activations), from bfloat16 activations as well. N = 70 leaves an odd panel.
    codes, scale, zp = make_weight("uint4", 1100, 70, 50)
    w = kernels.pack("uint4", codes, scale, zp, 50)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((m, 1100)), dtype)
    ref = np.asarray(
        _reference.weight_only_linear(x.astype(jnp.float32), "uint4", codes, scale, zp, 50)
    )
    for y in on_each_isa(lambda: kernels.weight_only_linear(x, w, out_dtype=jnp.float32)).values():
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-3)


def test_empty_batch_and_leading_dims():
    codes, scale, zp = make_weight("int4", 64, 20, 32)
    w = kernels.pack("int4", codes, scale, zp, 32)
    assert kernels.weight_only_linear(jnp.zeros((0, 64)), w).shape == (0, 20)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 3, 64)), jnp.float32)
    y = kernels.weight_only_linear(x, w)
    ref = _reference.weight_only_linear(x.reshape(6, 64), "int4", codes, scale, zp, 32)
    np.testing.assert_allclose(np.asarray(y).reshape(6, 20), np.asarray(ref), rtol=1e-5, atol=1e-4)


def test_transposed_input_under_jit():
    codes, scale, zp = make_weight("nf4", 64, 24, 64)
    w = kernels.pack("nf4", codes, scale, zp, 64)
    xt = jnp.asarray(np.random.default_rng(6).standard_normal((64, 9)), jnp.float32)
    y = jax.jit(lambda a, ww: kernels.weight_only_linear(a.T, ww))(xt, w)
    ref = _reference.weight_only_linear(xt.T, "nf4", codes, scale, zp, 64)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-4)


def test_isa_paths_agree():
    codes, scale, zp = make_weight("uint4", 160, 50, 32)
    w = kernels.pack("uint4", codes, scale, zp, 32)
    # 13 rows: two register tiles of the small-batch path on the wider ISAs.
    x = jnp.asarray(np.random.default_rng(7).standard_normal((13, 160)), jnp.float32)
    ref = np.asarray(_reference.weight_only_linear(x, "uint4", codes, scale, zp, 32))
    outs = on_each_isa(lambda: kernels.weight_only_linear(x, w))
    assert "scalar" in outs
    for y in outs.values():
        np.testing.assert_allclose(y, outs["scalar"], rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-4)


def test_every_small_batch_on_each_isa():
    # 1 to 16 rows take the register tiles, their activations laid out once a call in tiles
    # whose height depends on the ISA and on M (full tiles, a short last one, one row).
    codes, scale, zp = make_weight("uint4", 96, 33, 32)
    w = kernels.pack("uint4", codes, scale, zp, 32)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((16, 96)), jnp.float32)
    ref = np.asarray(_reference.weight_only_linear(x, "uint4", codes, scale, zp, 32))
    outs = on_each_isa(lambda: [kernels.weight_only_linear(x[:m], w) for m in range(1, 17)])
    for name, ys in outs.items():
        for m, y in enumerate(ys, start=1):
            np.testing.assert_allclose(y, ref[:m], rtol=1e-5, atol=1e-4, err_msg=f"{name} M={m}")


@pytest.mark.parametrize(("kind", "k", "n", "group_size"), CASES)
def test_dequantize_weight_is_the_reference_exactly(kind, k, n, group_size):
    # The float weight a prefill-sized product multiplies must be the logical weight's own
    # values, bit for bit, on every ISA path (ragged groups and panels included).
    codes, scale, zp = make_weight(kind, k, n, group_size, seed=k + n)
    w = kernels.pack(kind, codes, scale, zp, group_size)
    ref = np.asarray(_reference.dequantize(kind, codes, scale, zp, group_size))
    for name, out in on_each_isa(lambda: _dequantize(w)).items():
        np.testing.assert_array_equal(out, ref, err_msg=name)


_dequantize = jax.jit(kernels.dequantize_weight)


@pytest.mark.parametrize("kind", ["uint4", "nf4"])
def test_dequantize_weight_of_a_large_weight_is_the_reference_exactly(kind):
    # Above 8 MB of float32 the kernel writes the weight row by row instead of panel by
    # panel: K = 1056 (33 groups), N = 2200 (a ragged last panel), 9.3 MB.
    codes, scale, zp = make_weight(kind, 1056, 2200, 32, seed=5)
    w = kernels.pack(kind, codes, scale, zp, 32)
    ref = np.asarray(_reference.dequantize(kind, codes, scale, zp, 32))
    for name, out in on_each_isa(lambda: _dequantize(w)).items():
        np.testing.assert_array_equal(out, ref, err_msg=name)


def _per_group_int8_reference(x, w_float, gs):
    """x [M, K] with each row's groups of `gs` rounded to int8 (absmax / 127, half to even;
    zero groups stay zero), times the float weight, in float64."""
    m, k = x.shape
    kp = -(-k // gs) * gs
    groups = np.pad(np.asarray(x, np.float64), ((0, 0), (0, kp - k))).reshape(m, -1, gs)
    scale = (np.abs(groups).max(-1, keepdims=True).astype(np.float32) / np.float32(127)).astype(
        np.float64
    )
    codes = np.round(np.clip(groups / np.where(scale > 0, scale, 1), -127, 127))
    xq = (codes * scale).reshape(m, kp)[:, :k]
    return xq @ np.asarray(w_float, np.float64)


INT8_ACTIVATION_CASES = [
    # kind, K, N, group_size
    ("uint4", 128, 40, 32),  # GGUF Q4_1 blocks
    ("uint4", 200, 33, 40),  # ragged last group, odd panel
    ("int4", 96, 20, 32),
    ("int4", 576, 24, None),  # per channel: storage chunks of 192
    ("int8", 128, 40, 32),  # GGUF Q8_0 blocks
    ("int8", 132, 17, None),
]


@pytest.mark.parametrize(("kind", "k", "n", "group_size"), INT8_ACTIVATION_CASES)
def test_int8_activations_match_a_per_group_reference(kind, k, n, group_size):
    codes, scale, zp = make_weight(kind, k, n, group_size, seed=11)
    w = kernels.pack(kind, codes, scale, zp, group_size)
    w_float = np.asarray(_reference.dequantize(kind, codes, scale, zp, group_size))
    rng = np.random.default_rng(12)
    x = rng.standard_normal((40, k)).astype(np.float32)
    x[3, : w.storage_group] = 0.0  # an all-zero group: codes 0, no NaN scale
    q8_ref = _per_group_int8_reference(x, w_float, w.storage_group)
    float_ref = x.astype(np.float64) @ w_float
    served = []  # per ISA path, in the order `on_each_isa` runs them
    # One decode row, decode batches, and more rows than the small-M tiles take (prefill).
    rows = (1, 2, 5, 8, 16, 17, 40)

    def run():
        served.append(kernels.int8_activations_supported(kind))
        return [
            kernels.weight_only_linear(jnp.asarray(x[:m]), w, int8_activations=True) for m in rows
        ]

    outs = on_each_isa(run)
    magnitude = np.abs(x) @ np.abs(w_float)
    for (name, ys), integer in zip(outs.items(), served, strict=True):
        for y, m in zip(ys, rows, strict=True):
            want = q8_ref[:m] if integer else float_ref[:m]  # float where the ISA has no path
            np.testing.assert_array_less(
                np.abs(y - want), 1e-5 * magnitude[:m] + 1e-6, err_msg=f"{name} M={m}"
            )
    if kernels.int8_activations_supported(kind):
        # The activations' rounding is visible: not the float result.
        y = np.asarray(kernels.weight_only_linear(jnp.asarray(x[:8]), w, int8_activations=True))
        assert np.abs(y - float_ref[:8]).max() > 1e-4 * np.abs(float_ref[:8]).max()


def test_int8_activations_multiply_int8_codes_of_minus_128_exactly():
    # AVX2 takes |code| as the unsigned operand and the activation with the code's sign: -128
    # has no positive int8, so its magnitude must be read as the unsigned byte 128.
    rng = np.random.default_rng(15)
    codes = rng.integers(-128, 128, (64, 32)).astype(np.int8)
    codes[:, :4] = -128
    scale = np.ones((2, 32), np.float32)
    w = kernels.pack("int8", jnp.asarray(codes), jnp.asarray(scale), None, 32)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    served = []

    def run():
        served.append(kernels.int8_activations_supported("int8"))
        return kernels.weight_only_linear(jnp.asarray(x), w, int8_activations=True)

    q8_ref = _per_group_int8_reference(x, codes.astype(np.float64), 32)
    float_ref = x.astype(np.float64) @ codes.astype(np.float64)
    for (name, y), integer in zip(on_each_isa(run).items(), served, strict=True):
        want = q8_ref if integer else float_ref
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-3, err_msg=name)


def test_int8_activations_propagate_non_finite_inputs():
    codes, scale, zp = make_weight("uint4", 64, 32, 32, seed=13)
    w = kernels.pack("uint4", codes, scale, zp, 32)
    x = np.random.default_rng(14).standard_normal((4, 64)).astype(np.float32)
    x[1, 5], x[2, 40] = np.nan, np.inf
    y = np.asarray(kernels.weight_only_linear(jnp.asarray(x), w, int8_activations=True))
    assert np.isfinite(y[[0, 3]]).all()
    assert np.isnan(y[1]).all() and np.isnan(y[2]).all()
