"""GPTQ against round-to-nearest and an independent NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.algorithms import _grid
from lowbit.algorithms._gptq import gptq_matrix, inverse_hessian_factor, sweep
from lowbit.formats import get_format
from lowbit.qarray import MinMax, PerGroup, QuantConfig
from lowbit.qarray import quantize as quantize_array
from lowbit.recipes import GPTQ

F, K = 8, 32
CONFIGS = {
    "int4_g8": QuantConfig(format="int4", granularity=PerGroup(8, axis=-1)),
    "uint4_g8_asym": QuantConfig(
        format="uint4", granularity=PerGroup(8, axis=-1), symmetric=False, calibration=MinMax()
    ),
    "nf4_g8": QuantConfig(format="nf4", granularity=PerGroup(8, axis=-1)),
    "int3_g16": QuantConfig(format="int3", granularity=PerGroup(16, axis=-1)),
}


def _weight(seed=0):
    return jax.random.normal(jax.random.key(seed), (F, K), jnp.float32)


def _correlated_inputs(n=256, seed=1):
    rng = np.random.default_rng(seed)
    mix = rng.normal(size=(K // 4, K))  # rank K/4: strongly correlated inputs
    return (rng.normal(size=(n, K // 4)) @ mix + 0.05 * rng.normal(size=(n, K))).astype(np.float32)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_identity_hessian_gives_rtn_codes_exactly(name):
    w = _weight()
    q = quantize_array(w, CONFIGS[name])
    for refine in (0, 2):  # RTN is already optimal coordinate-wise when nothing correlates
        algorithm = GPTQ(block=16, refine=refine)
        result = gptq_matrix(w, jnp.eye(K), _grid.grid_of(q), q.fmt.name, algorithm)
        np.testing.assert_array_equal(np.asarray(result.codes), np.asarray(q.unpacked_codes()))


def _numpy_gptq(w, h, scale, zp, levels_fn, damp=0.01):
    """Plain column-by-column GPTQ (no lazy blocks) in float64."""
    w = np.array(w, np.float64)
    h = np.array(h, np.float64) + damp * np.mean(np.diag(h)) * np.eye(len(h))
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    q = np.zeros_like(w)
    for j in range(w.shape[1]):
        q[:, j] = levels_fn(w[:, j], scale[:, j], zp[:, j])
        err = (w[:, j] - q[:, j]) / u[j, j]
        w[:, j:] -= np.outer(err, u[j, j:])
    return q


def test_matches_numpy_reference_and_beats_rtn_on_correlated_inputs():
    config = CONFIGS["uint4_g8_asym"]
    w = _weight(2)
    x = _correlated_inputs()
    gram = x.T @ x
    q = quantize_array(w, config)
    grid = _grid.grid_of(q)
    s, z = np.asarray(grid.scale, np.float64), np.asarray(grid.zero_point, np.float64)

    def rtn_column(col, scale, zero):
        c = np.clip(np.round(col / scale + zero), 0, 15)
        return (c - zero) * scale

    result = gptq_matrix(w, jnp.asarray(gram), grid, "uint4", GPTQ(block=8, act_order=False))
    ours = np.asarray(_grid.decode(q.fmt, result.codes, grid.scale, grid.zero_point))
    ref = _numpy_gptq(np.asarray(w), gram, s, z, rtn_column)
    # Same algorithm up to float32 vs float64 rounding: nearly all codes agree.
    assert np.mean(np.isclose(ours, ref, atol=1e-5)) > 0.97
    err = lambda v: float(np.sum((x @ (np.asarray(w) - v).T) ** 2))
    rtn = np.asarray(q.dequantize())
    assert err(ours) < 0.7 * err(rtn)
    assert err(ours) == pytest.approx(err(ref), rel=0.05)


def test_act_order_and_padding_keep_layout_and_help():
    config = CONFIGS["int4_g8"]
    w = _weight(3)
    x = _correlated_inputs(seed=4) * np.linspace(0.1, 3, K, dtype=np.float32)
    q = quantize_array(w, config)
    grid = _grid.grid_of(q)
    result = gptq_matrix(w, jnp.asarray(x.T @ x), grid, "int4", GPTQ(block=12, act_order=True))
    assert result.codes.shape == (F, K) and result.damp == 0.01
    ours = _grid.decode(q.fmt, result.codes, grid.scale, grid.zero_point)
    err = lambda v: float(jnp.sum((x @ (w - v).T) ** 2))
    assert err(ours) < err(q.dequantize())


def test_inverse_hessian_factor_is_the_upper_cholesky_factor_of_the_inverse():
    x = _correlated_inputs(seed=5) * np.geomspace(1e-2, 1e2, K, dtype=np.float32)
    gram = x.T @ x
    upper, damp = inverse_hessian_factor(jnp.asarray(gram), 0.01)
    h = gram.astype(np.float64) + 0.01 * np.mean(np.diag(gram)) * np.eye(K)
    reference = np.linalg.cholesky(np.linalg.inv(h)).T  # the textbook route, in float64
    assert damp == 0.01
    np.testing.assert_array_equal(np.asarray(upper), np.triu(np.asarray(upper)))
    np.testing.assert_allclose(np.asarray(upper), reference, rtol=1e-5, atol=1e-6 * reference.max())


def test_an_indefinite_hessian_is_dampened_until_it_factorizes():
    gram = np.eye(K)
    gram[0, 1] = gram[1, 0] = 1.05  # eigenvalue -0.05: 1% of the mean diagonal is not enough
    upper, damp = inverse_hessian_factor(jnp.asarray(gram), 0.01)
    assert damp == pytest.approx(0.1)
    h = gram + 0.1 * np.eye(K)
    np.testing.assert_allclose(np.asarray(upper).T @ np.asarray(upper), np.linalg.inv(h), atol=1e-5)


@pytest.mark.parametrize("blocks", [(), (64, 16), (64, 16, 4)])
def test_sweep_sees_every_earlier_change_however_lazily_it_applies_them(blocks):
    rng = np.random.default_rng(7)
    f, b = 5, 64
    x = rng.normal(size=(f, b)).astype(np.float32)
    m = (rng.normal(size=(b, b)) / 8).astype(np.float32)
    offset = rng.normal(size=(f, b)).astype(np.float32)

    def column(x_i, m_ii, at):
        (o,) = at
        code = jnp.round(2 * x_i + o)  # a nonlinear choice: it needs the up-to-date column
        return (code / 2 - x_i) * m_ii, (code.astype(jnp.int32),)

    got_x, (codes,) = jax.jit(lambda x, m, o: sweep(x, m, (o,), column, (jnp.int32,), blocks))(
        x, m, offset
    )
    # Plain NumPy: apply every change to every column at once, one column at a time.
    want_x, want_codes = x.astype(np.float64), np.zeros((f, b), np.int64)
    for i in range(b):
        code = np.round(2 * want_x[:, i] + offset[:, i])
        want_codes[:, i] = code
        want_x += np.outer((code / 2 - want_x[:, i]) * m[i, i], m[i])
    np.testing.assert_array_equal(np.asarray(codes), want_codes)
    np.testing.assert_allclose(np.asarray(got_x), want_x, rtol=1e-4, atol=1e-4)


def test_singular_hessian_falls_back_to_rtn():
    w = _weight()
    q = quantize_array(w, CONFIGS["int4_g8"])
    gram = jnp.full((K, K), jnp.nan)
    result = gptq_matrix(w, gram, _grid.grid_of(q), "int4", GPTQ())
    assert result.damp is None
    np.testing.assert_array_equal(np.asarray(result.codes), np.asarray(q.unpacked_codes()))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_refinement_sweeps_never_raise_the_output_error(name):
    k = 64  # wider than the other tests: enough codes that some move
    w = jax.random.normal(jax.random.key(3), (32, k), jnp.float32)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(512, k // 4)) @ rng.normal(size=(k // 4, k))
    x = (x + 0.05 * rng.normal(size=(512, k))).astype(np.float32)
    q = quantize_array(w, CONFIGS[name])
    grid = _grid.grid_of(q)
    gram = jnp.asarray(x.T @ x)
    h = x.T @ x + 0.01 * np.mean(np.diag(x.T @ x)) * np.eye(k)  # the damped objective
    errors = []
    for refine in (0, 1, 2):
        codes = gptq_matrix(w, gram, grid, q.fmt.name, GPTQ(block=12, refine=refine)).codes
        e = np.asarray(w - _grid.decode(q.fmt, codes, grid.scale, grid.zero_point), np.float64)
        errors.append(float(np.einsum("fi,ij,fj->", e, h, e)))
        assert set(np.unique(np.asarray(codes))) <= set(np.asarray(q.fmt.codes()).tolist())
    assert errors[2] <= errors[1] * (1 + 1e-5) and errors[1] < errors[0]


def test_refine_must_be_a_count():
    with pytest.raises(ValueError, match=r"GPTQ.refine: -1; accepted: an int >= 0"):
        GPTQ(refine=-1)


def test_full_range_reaches_the_extra_negative_level_only_when_asked():
    w = jnp.asarray([[-1.0, -0.95, 0.5, 0.9]])
    grid = _grid.Grid(jnp.full((1, 4), 0.125), None, True)  # int4: -1.0 is -8 steps
    fmt = get_format("int4")
    plain = gptq_matrix(w, jnp.eye(4), grid, fmt.name, GPTQ(refine=1)).codes
    full = gptq_matrix(w, jnp.eye(4), grid, fmt.name, GPTQ(refine=1, full_range=True)).codes
    decode = lambda c: np.asarray(_grid.decode(fmt, c, grid.scale, None))
    np.testing.assert_array_equal(decode(plain), [[-0.875, -0.875, 0.5, 0.875]])
    np.testing.assert_array_equal(decode(full), [[-1.0, -1.0, 0.5, 0.875]])


def test_weights_reading_one_input_share_its_inverse_hessian_factor(monkeypatch):
    from lowbit.algorithms import _gptq

    calls = []
    factor = _gptq.inverse_hessian_factor
    monkeypatch.setattr(_gptq, "inverse_hessian_factor", lambda *a: calls.append(1) or factor(*a))
    x = _correlated_inputs()
    gram = jnp.asarray(x.T @ x)
    factors: dict = {}
    for seed in range(3):  # q, k, v: three weights, one input
        w = _weight(seed)
        q = quantize_array(w, CONFIGS["int4_g8"])
        shared = gptq_matrix(w, gram, _grid.grid_of(q), "int4", GPTQ(refine=1), factors)
        alone = gptq_matrix(w, gram, _grid.grid_of(q), "int4", GPTQ(refine=1))
        np.testing.assert_array_equal(np.asarray(shared.codes), np.asarray(alone.codes))
    assert len(calls) == 1 + 3  # one shared factorization, and three without the cache
    gptq_matrix(_weight(), 2 * gram, _grid.grid_of(q), "int4", GPTQ(), factors)
    assert len(calls) == 5  # another Gram matrix is factorized again
