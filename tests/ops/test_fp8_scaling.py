"""fp8 delayed scaling: scales follow the amax history (NumPy reference), state threading."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from lowbit.ops import Fp8Scaling, Fp8Weight, fp8_dot_general
from lowbit.ops._fp8_scaling import init_state

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
DIMS = (((1,), (0,)), ((), ()))


def np_scale(history, current, mode, margin, fmax):
    past = history.max(axis=0)
    amax = current if mode == "dynamic" else np.where(past > 0, past, current)
    return np.where(amax > 0, amax * 2.0**margin / fmax, 1.0)


def np_round(x, scale, dtype):
    fmax = float(ml_dtypes.finfo(dtype).max)
    return np.clip(x / scale, -fmax, fmax).astype(dtype).astype(np.float32) * scale


def np_push(history, current, mode):
    rolled = np.concatenate([np.asarray(current, np.float32)[None], history[:-1]])
    return history if mode == "static" and history.max() > 0 else rolled


@pytest.mark.parametrize(
    "scaling",
    [
        Fp8Scaling(history_length=3, margin=1),
        Fp8Scaling(history_length=2, weight_axes="channel"),
        Fp8Scaling(
            history_length=1,
            weight_mode="static",
            activation_mode="static",
            gradient_mode="dynamic",
            weight_axes="channel",
        ),
    ],
    ids=["delayed", "delayed-channel", "deepseek"],
)
def test_scales_follow_the_history(scaling):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(16, 8)).astype(np.float32)
    state = init_state(w.shape, scaling)
    ref = {k: np.asarray(v) for k, v in state.items()}

    def loss(x, value, state, g):
        return jnp.sum(fp8_dot_general(x, Fp8Weight(value, state, scaling), DIMS) * g)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 2)))
    channel = scaling.weight_axes == "channel"
    margin = scaling.margin
    f4, f5 = float(ml_dtypes.finfo(E4M3).max), float(ml_dtypes.finfo(E5M2).max)
    for step in range(5):
        # Growing and shrinking magnitudes, so the history max differs from the current amax.
        x = (rng.normal(size=(4, 16)) * [1, 8, 0.5, 3, 2][step]).astype(np.float32)
        g = (rng.normal(size=(4, 8)) * [1, 0.1, 4, 2, 1][step]).astype(np.float32)
        value, (dx, state) = grad(x, w, state, g)
        ax, ag = np.abs(x).max(), np.abs(g).max()
        aw = np.abs(w).max(axis=0) if channel else np.abs(w).max()
        sx = np_scale(ref["activation"], ax, scaling.activation_mode, margin, f4)
        sw = np_scale(ref["weight"], aw, scaling.weight_mode, margin, f4)
        sg = np_scale(ref["gradient"], ag, scaling.gradient_mode, margin, f5)
        xq, wq = np_round(x, sx, E4M3), np_round(w, sw, E4M3)
        np.testing.assert_allclose(value, np.sum((xq @ wq) * g), rtol=1e-4)
        np.testing.assert_allclose(dx, np_round(g, sg, E5M2) @ wq.T, rtol=1e-4, atol=1e-6)
        ref = {
            "weight": np_push(ref["weight"], aw, scaling.weight_mode),
            "activation": np_push(ref["activation"], ax, scaling.activation_mode),
            "gradient": np_push(ref["gradient"], ag, scaling.gradient_mode),
        }
        for k in ref:
            np.testing.assert_allclose(state[k], ref[k], rtol=1e-6)


def test_zero_and_nonfinite_inputs_give_finite_scales():
    scaling = Fp8Scaling(history_length=2)
    w = jnp.zeros((8, 4))
    state = init_state(w.shape, scaling)
    # Infinite inputs saturate at the format's largest value; their amax is ignored.
    for x in (jnp.zeros((1, 8)), jnp.full((1, 8), jnp.inf)):
        fn = lambda s, x=x: fp8_dot_general(x, Fp8Weight(w, s, scaling), DIMS)
        out, vjp = jax.vjp(fn, state)
        assert np.all(np.isfinite(out))
        (new,) = vjp(jnp.ones_like(out))
        for k in ("weight", "activation", "gradient"):
            assert np.all(np.isfinite(new[k])), k


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"history_length": 0}, "history_length: 0; accepted: an int >= 1"),
        ({"weight_mode": "lazy"}, "weight_mode: 'lazy'; accepted"),
        ({"forward_format": "float8_e4m3"}, "forward_format"),
        ({"weight_axes": "row"}, "weight_axes"),
    ],
)
def test_bad_scaling_fields(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        Fp8Scaling(**kwargs)


def test_state_is_a_plain_dict():
    state = init_state((3, 16, 8), Fp8Scaling(history_length=4, weight_axes="channel"), 1)
    assert set(state) == {"weight", "activation", "gradient"}
    assert state["weight"].shape == (3, 4, 8) and state["activation"].shape == (3, 4)
