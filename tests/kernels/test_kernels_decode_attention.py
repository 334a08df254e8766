"""Decode attention over a KV cache (float32, 16-bit float or quantized): the kernel against a
NumPy (float64) reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit import kernels
from lowbit.kernels import _reference

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.status())


def numpy_attention(q, keys, values, start, slot, softcap=None):
    """q [B,H,G,D], keys/values [B,H,L,D]: softmax over slots start[b] .. slot, in float64
    (scores soft-capped as ``c * tanh(s / c)`` with `softcap` c)."""
    q, keys, values = (np.asarray(a, np.float64) for a in (q, keys, values))
    out = np.zeros(q.shape)
    for b in range(q.shape[0]):
        lo, hi = int(start[b]), min(int(slot), keys.shape[2] - 1)
        if lo > hi:
            continue
        s = np.einsum("hgd,hld->hgl", q[b], keys[b, :, lo : hi + 1])
        if softcap:
            s = softcap * np.tanh(s / softcap)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[b] = np.einsum("hgl,hld->hgd", p / p.sum(-1, keepdims=True), values[b, :, lo : hi + 1])
    return out


def make(b, h, g, d, length, seed=0):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((b, h, g, d)) / np.sqrt(d) * 3).astype(np.float32)
    keys = rng.standard_normal((b, h, length, d)).astype(np.float32)
    values = rng.standard_normal((b, h, length, d)).astype(np.float32)
    return q, keys, values


_kernel = jax.jit(kernels.decode_attention)
_jax_reference = jax.jit(_reference.decode_attention)


# Head sizes: the vector paths (32, 64, 128) and the scalar one (24); slots on both sides of
# the kernel's 128-slot chunks, and one past the cache's end (clamped to the last slot).
@pytest.mark.parametrize("d", [24, 32, 64, 128])
@pytest.mark.parametrize("slot", [0, 5, 127, 128, 300, 383, 500])
def test_matches_numpy(d, slot):
    q, keys, values = make(2, 3, 3, d, 384, seed=d + slot)
    start = np.array([0, 4], np.int32)
    out = np.asarray(_kernel(q, keys, values, start, jnp.int32(slot)))
    ref = numpy_attention(q, keys, values, start, slot)
    if slot < 4:
        ref[1] = 0.0  # row 1 starts at slot 4: nothing to attend to, zeros by contract
    # float32 sums over up to 500 slots against float64: a few 1e-6 of the O(1) outputs.
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=2e-5)
    # The pure-JAX path (no kernels) computes the same.
    jref = np.asarray(_jax_reference(q, keys, values, jnp.asarray(start), jnp.int32(slot)))
    np.testing.assert_allclose(jref, ref, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("d", [24, 64])
@pytest.mark.parametrize("fmt", [None, "int8"])
def test_soft_capped_scores_match_numpy(d, fmt):
    # Gemma 2's cap on (scaled) scores, on the vector and scalar paths, float and int8 caches:
    # scores near and far beyond the cap (q scaled up) are capped before the softmax.
    q, keys, values = make(2, 2, 2, d, 256, seed=d)
    q = q * np.float32(8)
    start, slot, cap = np.array([0, 7], np.int32), 200, 5.0
    key_scales = value_scales = None
    if fmt == "int8":
        k_scale = np.abs(keys).max(-1, keepdims=True) / 127
        v_scale = np.abs(values).max(-1, keepdims=True) / 127
        k_codes = np.round(keys / k_scale).astype(np.int8)
        v_codes = np.round(values / v_scale).astype(np.int8)
        key_scales, value_scales = k_scale.astype(np.float16), v_scale.astype(np.float16)
        keys = k_codes * key_scales.astype(np.float32)
        values = v_codes * value_scales.astype(np.float32)
        args = (k_codes, v_codes)
    else:
        args = (keys, values)
    out = kernels.decode_attention(
        q, *args, start, jnp.int32(slot), key_scales, value_scales, softcap=cap
    )
    ref = numpy_attention(q, keys, values, start, slot, softcap=cap)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=3e-5)
    uncapped = numpy_attention(q, keys, values, start, slot)
    assert np.abs(uncapped - ref).max() > 1e-2  # the cap changed the result
    jref = _reference.decode_attention(
        q, keys, values, jnp.asarray(start), jnp.int32(slot), softcap=cap
    )
    np.testing.assert_allclose(np.asarray(jref), ref, rtol=1e-4, atol=3e-5)


def test_large_score_range_stays_finite():
    # Scores spread over hundreds: exp underflows for most slots, never to NaN.
    q, keys, values = make(1, 2, 4, 64, 256, seed=3)
    q = q * np.float32(40)
    start = np.zeros(1, np.int32)
    out = np.asarray(_kernel(q, keys, values, start, jnp.int32(255)))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, numpy_attention(q, keys, values, start, 255), atol=1e-4)


def test_bad_shapes_and_dtypes_are_named():
    q, keys, values = make(1, 2, 2, 32, 64)
    start = np.zeros(1, np.int32)
    with pytest.raises(ValueError, match="keys have shape"):
        kernels.decode_attention(q, keys[:, :1], values, start, 3)
    with pytest.raises(ValueError, match="values have shape"):
        kernels.decode_attention(q, keys, values[:, :, :8], start, 3)
    with pytest.raises(TypeError, match="keys dtype bfloat16 / values dtype float32"):
        kernels.decode_attention(q, keys.astype(jnp.bfloat16), values, start, 3)
    with pytest.raises(ValueError, match="start must be"):
        kernels.decode_attention(q, keys, values, np.zeros(2, np.int32), 3)


def numpy_dequantize(codes, scales, fmt, d):
    """float64 [B, H, L, D] from cache codes and float16 [B, H, L, S] scales (NumPy only)."""
    if fmt == "int4":
        c = np.asarray(codes).astype(np.int16)
        lo = np.where(c & 15 >= 8, (c & 15) - 16, c & 15)
        hi = np.where(c >> 4 >= 8, (c >> 4) - 16, c >> 4)
        x = np.concatenate([lo, hi], axis=-1) + 0.5
    else:  # int8, and fp8 codes through ml_dtypes' float8_e4m3fn
        x = np.asarray(codes).astype(np.float64)
    s = np.asarray(scales).astype(np.float64)
    groups = s.shape[-1]
    x = x.reshape(*x.shape[:-1], groups, d // groups) * s[..., None]
    return x.reshape(*x.shape[:-2], d)


def make_codes(fmt, shape, rng):
    b, h, length, d = shape
    if fmt == "int8":
        return rng.integers(-127, 128, shape).astype(np.int8)
    if fmt == "int4":
        return rng.integers(0, 256, (b, h, length, d // 2)).astype(np.uint8)
    values = rng.standard_normal(shape) * 50
    return np.asarray(jnp.asarray(values, jnp.float32).astype(jnp.float8_e4m3fn))


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("d", [24, 64])
def test_quantized_caches_match_numpy(fmt, groups, d):
    rng = np.random.default_rng(groups * 10 + d)
    b, h, g, length = 2, 2, 3, 300
    q = (rng.standard_normal((b, h, g, d)) / np.sqrt(d)).astype(np.float32)
    keys = make_codes(fmt, (b, h, length, d), rng)
    values = make_codes(fmt, (b, h, length, d), rng)
    ks = rng.uniform(0.001, 0.05, (b, h, length, groups)).astype(np.float16)
    vs = rng.uniform(0.001, 0.05, (b, h, length, groups)).astype(np.float16)
    start, slot = np.array([0, 9], np.int32), 260
    out = np.asarray(_kernel(q, keys, values, start, jnp.int32(slot), ks, vs))
    ref = numpy_attention(
        q,
        numpy_dequantize(keys, ks, fmt, d),
        numpy_dequantize(values, vs, fmt, d),
        start,
        slot,
    )
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("d", [24, 64])
def test_16_bit_float_caches_match_numpy(dtype, d):
    # Read at half the bytes of float32 and widened a chunk at a time: exactly the float32
    # attention over the widened values.
    q, keys, values = make(2, 2, 3, d, 300, seed=d)
    keys, values = (np.asarray(jnp.asarray(a).astype(dtype)) for a in (keys, values))
    start, slot = np.array([0, 9], np.int32), 260
    out = np.asarray(_kernel(q, keys, values, start, jnp.int32(slot)))
    wide = [np.asarray(jnp.asarray(a).astype(jnp.float32)) for a in (keys, values)]
    np.testing.assert_allclose(out, numpy_attention(q, *wide, start, slot), rtol=1e-4, atol=2e-5)
    with pytest.raises(ValueError, match="takes no scales"):
        kernels.decode_attention(q, keys, values, start, 3, np.ones((2, 2, 300, 1), np.float16))


def test_quantized_cache_needs_its_scales():
    q, keys, values = make(1, 2, 2, 32, 64)
    codes = np.zeros((1, 2, 64, 32), np.int8)
    start = np.zeros(1, np.int32)
    with pytest.raises(ValueError, match="key_scales is None"):
        kernels.decode_attention(q, codes, codes, start, 3)
    with pytest.raises(ValueError, match="takes no scales"):
        kernels.decode_attention(q, keys, values, start, 3, np.zeros((1, 2, 64, 1), np.float16))
    with pytest.raises(TypeError, match="not a supported cache"):
        kernels.decode_attention(q, codes, values, start, 3)


@pytest.mark.parametrize("groups", [1, 4])
def test_integer_qk_matches_numpy(groups):
    # int8 keys read by exact integer products: each query quantized to int8 per scale group
    # (scale max(absmax / 127, 1e-30), round half to even, in float32).
    rng = np.random.default_rng(groups)
    b, h, g, d, length = 2, 2, 3, 64, 300
    q = (rng.standard_normal((b, h, g, d)) / 8).astype(np.float32)
    keys = make_codes("int8", (b, h, length, d), rng)
    values = make_codes("int8", (b, h, length, d), rng)
    ks = rng.uniform(0.001, 0.05, (b, h, length, groups)).astype(np.float16)
    vs = rng.uniform(0.001, 0.05, (b, h, length, groups)).astype(np.float16)
    start, slot = np.array([0, 9], np.int32), 260
    out = np.asarray(
        jax.jit(kernels.decode_attention, static_argnames="integer_qk")(
            q, keys, values, start, jnp.int32(slot), ks, vs, integer_qk=True
        )
    )
    qg = q.reshape(b, h, g, groups, d // groups)
    q_scale = np.maximum(np.abs(qg).max(-1) / np.float32(127), np.float32(1e-30))
    q_codes = np.round(qg / q_scale[..., None]).astype(np.int64)
    k_codes = keys.astype(np.int64).reshape(b, h, length, groups, d // groups)
    dots = np.einsum("bhgsd,bhlsd->bhgls", q_codes, k_codes).astype(np.float64)
    scores = (dots * q_scale[:, :, :, None] * ks.astype(np.float64)[:, :, None]).sum(-1)
    v = numpy_dequantize(values, vs, "int8", d)
    ref = np.zeros(out.shape)
    for r in range(b):
        lo = start[r]
        s = scores[r, :, :, lo : slot + 1]
        p = np.exp(s - s.max(-1, keepdims=True))
        ref[r] = np.einsum("hgl,hld->hgd", p / p.sum(-1, keepdims=True), v[r, :, lo : slot + 1])
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=2e-5)
    with pytest.raises(ValueError, match="integer_qk needs an int8 cache"):
        f32 = keys.astype(np.float32)
        kernels.decode_attention(q, f32, f32, start, 3, integer_qk=True)


@pytest.mark.parametrize("d", [32, 64, 128])
def test_every_isa_path_matches_numpy(d):
    # The vector code follows the matmul kernels' path (`kernels.set_isa`, LOWBIT_CPU_ISA), so a
    # forced AVX2 run attends with AVX2 on an AVX-512 CPU too: each path against the reference,
    # float keys, int8 keys read by integer products, and the caches widened a chunk at a time
    # (int4 with scale groups, fp8, bfloat16). Each head size takes its own unrolled copy (at
    # 128 the AVX2 values pass runs in two halves).
    rng = np.random.default_rng(7)
    q, keys, values = make(2, 2, 3, d, 300, seed=7)
    start, slot = np.array([0, 9], np.int32), 260
    codes = make_codes("int8", (2, 2, 300, d), rng)
    scales = rng.uniform(0.001, 0.05, (2, 2, 300, 4)).astype(np.float16)
    int4, fp8 = make_codes("int4", (2, 2, 300, d), rng), make_codes("fp8", (2, 2, 300, d), rng)
    bf16 = np.asarray(jnp.asarray(values).astype(jnp.bfloat16))
    widened = {
        "int4": (int4, scales, numpy_dequantize(int4, scales, "int4", d)),
        "fp8": (fp8, scales, numpy_dequantize(fp8, scales, "fp8", d)),
        "bf16": (bf16, None, np.asarray(jnp.asarray(bf16).astype(jnp.float32))),
    }
    integer = jax.jit(kernels.decode_attention, static_argnames="integer_qk")
    names = kernels.supported_isas()
    outs = {}
    try:
        for name in names:
            assert kernels.set_isa(name) == name
            outs[name] = (
                np.asarray(_kernel(q, keys, values, start, jnp.int32(slot))),
                np.asarray(
                    integer(
                        q, codes, codes, start, jnp.int32(slot), scales, scales, integer_qk=True
                    )
                ),
                {
                    fmt: np.asarray(_kernel(q, c, c, start, jnp.int32(slot), s, s))
                    for fmt, (c, s, _) in widened.items()
                },
            )
    finally:
        kernels.set_isa(names[-1])
    ref = numpy_attention(q, keys, values, start, slot)
    for name, (out, out_int, out_widened) in outs.items():
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=2e-5, err_msg=name)
        for fmt, (_, _, wide) in widened.items():
            np.testing.assert_allclose(
                out_widened[fmt],
                numpy_attention(q, wide, wide, start, slot),
                rtol=1e-4,
                atol=2e-5,
                err_msg=f"{name} {fmt}",
            )
        np.testing.assert_allclose(out_int, outs[names[-1]][1], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("fmt", [None, "int8"])
def test_rows_read_some_rows_of_a_larger_cache_in_place(fmt):
    # Query row i reads cache row rows[i] of a 4-row cache: the same as attending to those
    # rows copied out (each row's own keys: a wrong row gives other outputs).
    q, keys, values = make(2, 2, 2, 64, 256, seed=11)
    _, big_keys, big_values = make(4, 2, 2, 64, 256, seed=12)
    rows = np.array([3, 1], np.int32)
    big_keys[rows], big_values[rows] = keys, values
    start, slot = np.array([0, 9], np.int32), jnp.int32(200)
    scales = (None, None)
    if fmt == "int8":
        k_scale = np.abs(big_keys).max(-1, keepdims=True) / 127
        v_scale = np.abs(big_values).max(-1, keepdims=True) / 127
        big_keys = np.round(big_keys / k_scale).astype(np.int8)
        big_values = np.round(big_values / v_scale).astype(np.int8)
        scales = (k_scale.astype(np.float16), v_scale.astype(np.float16))
    out = kernels.decode_attention(q, big_keys, big_values, start, slot, *scales, rows=rows)
    copied = [None if s is None else s[rows] for s in scales]
    want = kernels.decode_attention(q, big_keys[rows], big_values[rows], start, slot, *copied)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    other = kernels.decode_attention(
        q,
        big_keys[:2],
        big_values[:2],
        start,
        slot,
        *[None if s is None else s[:2] for s in scales],
    )
    assert np.abs(np.asarray(other) - np.asarray(want)).max() > 1e-3
    with pytest.raises(ValueError, match="rows must be"):
        kernels.decode_attention(q, big_keys, big_values, start, slot, *scales, rows=rows[:1])
