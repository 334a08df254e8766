"""Static activation calibration."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.api import (
    QuantizedModel,
    activation_ranges,
    calibrate,
    quantize_params,
    run,
)
from lowbit.qarray import Fixed, PerTensor, QArray, QuantConfig
from lowbit.recipes import Recipe, preset


def static_int8(calibration=None):
    """w8a8 with per-tensor static activation bounds."""
    rules = []
    for rule in preset("int8").rules:
        activation = QuantConfig(format="int8", granularity=PerTensor())
        if calibration is not None:
            activation = dataclasses.replace(activation, calibration=calibration)
        rules.append(
            dataclasses.replace(rule, activation=activation, static_activation=calibration is None)
        )
    return Recipe(rules=tuple(rules), name="int8_static")


def fn(params, x):
    h = jax.nn.relu(x @ params["up"]["kernel"])
    return h @ params["down"]["kernel"]


PARAMS = {
    "up": {"kernel": jax.random.normal(jax.random.key(0), (32, 64)) / 6},
    "down": {"kernel": jax.random.normal(jax.random.key(1), (64, 16)) / 8},
}
BATCHES = [jax.random.normal(jax.random.key(10 + i), (8, 32)) * (1 + i) for i in range(4)]


def test_max_calibration_records_the_operand_range():
    recipe = static_int8()
    with pytest.raises(ValueError, match="asks for static activation bounds.*calibrate"):
        quantize_params(PARAMS, recipe)
    dynamic = quantize_params(PARAMS, recipe, uncalibrated=True)
    assert dynamic["up"]["kernel"].activation_bounds is None
    qparams = calibrate(fn, PARAMS, BATCHES, recipe)
    up, down = qparams["up"]["kernel"], qparams["down"]["kernel"]
    everything = jnp.concatenate(BATCHES)
    np.testing.assert_array_equal(up.activation_bounds, [everything.min(), everything.max()])
    hidden = jax.nn.relu(everything @ PARAMS["up"]["kernel"])
    np.testing.assert_allclose(down.activation_bounds, [0.0, hidden.max()], rtol=1e-6)
    # The codes are those of plain PTQ: calibration only adds the bounds.
    np.testing.assert_array_equal(up.codes, dynamic["up"]["kernel"].codes)


def test_static_matches_dynamic_within_quantization_error():
    recipe = static_int8()
    static = calibrate(fn, PARAMS, BATCHES, recipe)
    dynamic = quantize_params(PARAMS, recipe, uncalibrated=True)
    forward = jax.jit(run(fn))
    x = BATCHES[-1]  # inside the calibrated range
    ref = fn(PARAMS, x)
    y_static, y_dynamic = forward(static, x), forward(dynamic, x)
    assert not np.array_equal(y_static, y_dynamic)  # the bounds were used
    err = lambda y: float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
    # Per-tensor int8 over the calibrated range: step = range / 255, ~1% relative error.
    assert err(y_static) < 0.03 and err(y_dynamic) < 0.03


def test_methods_order_their_ranges():
    recipe = static_int8()
    ranges = {
        method: activation_ranges(fn, PARAMS, BATCHES, recipe, method=method, q=99.0)
        for method in ("max", "moving_average", "percentile")
    }
    for path in ("up/kernel", "down/kernel"):
        lo_max, hi_max = ranges["max"][path]
        for method in ("moving_average", "percentile"):
            lo, hi = ranges[method][path]
            assert lo_max <= lo <= hi <= hi_max
        # Later batches are wider; the moving average weights the first batch most.
        assert ranges["moving_average"][path][1] < hi_max
    with pytest.raises(ValueError, match="method='mean'; accepted"):
        activation_ranges(fn, PARAMS, BATCHES, recipe, method="mean")
    with pytest.raises(ValueError, match="batches is empty"):
        calibrate(fn, PARAMS, [], recipe)


def test_fixed_bounds_come_from_the_recipe():
    recipe = static_int8(calibration=Fixed(-6.0, 6.0))
    qparams = quantize_params(PARAMS, recipe)
    np.testing.assert_array_equal(qparams["up"]["kernel"].activation_bounds, [-6.0, 6.0])
    # calibrate leaves constant bounds alone.
    calibrated = calibrate(fn, PARAMS, BATCHES[:1], recipe)
    np.testing.assert_array_equal(calibrated["up"]["kernel"].activation_bounds, [-6.0, 6.0])


def test_calibrate_nnx_module_and_scan(mlp, mlp_input, mlp_output):
    qmodel = calibrate(mlp, None, [mlp_input], static_int8())
    assert isinstance(qmodel, QuantizedModel)
    kernel = qmodel.state["layers"][0]["kernel"].get_value()
    assert isinstance(kernel, QArray)
    np.testing.assert_array_equal(kernel.activation_bounds, [mlp_input.min(), mlp_input.max()])
    y = qmodel(mlp_input)
    ref = mlp_output
    assert float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)) < 0.03

    stacked = {"kernel": jax.random.normal(jax.random.key(2), (3, 16, 16)) / 4}

    def scanned(p, x):
        return jax.lax.scan(lambda h, w: (h @ w, None), x, p["kernel"])[0]

    x = jax.random.normal(jax.random.key(3), (2, 16))
    recipe = Recipe(
        rules=(dataclasses.replace(static_int8().rules[1], path="kernel", stacked_axes=1),)
    )
    bounds = calibrate(scanned, stacked, [x], recipe)["kernel"].activation_bounds
    # Every layer's input is pooled: the range covers the input of each of the three steps.
    inputs = [x, x @ stacked["kernel"][0], x @ stacked["kernel"][0] @ stacked["kernel"][1]]
    lo = min(float(a.min()) for a in inputs)
    hi = max(float(a.max()) for a in inputs)
    np.testing.assert_allclose(bounds, [lo, hi], rtol=1e-5)


def test_static_weight_never_reached_is_an_error():
    unused = {**PARAMS, "spare": {"kernel": jnp.ones((8, 8))}}
    with pytest.raises(ValueError, match=r"\['spare/kernel'\] ask for static activation bounds"):
        calibrate(fn, unused, BATCHES[:1], static_int8())


def test_row_mask_leaves_padded_positions_out_of_the_bounds():
    # (x, mask) batches whose padded rows are huge: with the mask they do not count, as in
    # `lowbit.algorithms.capture` (one walk for both).
    mask = (jnp.arange(8) < 6).astype(jnp.int32)
    padded = [x.at[6:].set(1e3) for x in BATCHES]
    batches = [(x, mask) for x in padded]
    recipe = static_int8()
    masked = calibrate(lambda p, x, m: fn(p, x), PARAMS, batches, recipe, row_mask=lambda x, m: m)
    unmasked = calibrate(lambda p, x, m: fn(p, x), PARAMS, batches, recipe)
    kept = jnp.concatenate([x[:6] for x in padded])
    np.testing.assert_array_equal(
        masked["up"]["kernel"].activation_bounds, [kept.min(), kept.max()]
    )
    assert float(unmasked["up"]["kernel"].activation_bounds[1]) == 1e3
