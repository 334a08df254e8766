"""AWQ and SmoothQuant: scales folded into the preceding norm leave the float model unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from algorithm_support import quantize_with_report as _quantize
from flax import nnx

import lowbit
from lowbit.algorithms import capture
from lowbit.algorithms._smooth import apply_folds, plan_folds
from lowbit.qarray import PerGroup, PerToken, QuantConfig
from lowbit.recipes import AWQ, Recipe, Rule, SmoothQuant, param_leaves

D, F = 32, 16


class Block(nnx.Module):
    def __init__(self, residual_reads_norm: bool = False):
        self.norm = nnx.RMSNorm(D, rngs=nnx.Rngs(0))
        self.up = nnx.Linear(D, F, use_bias=False, rngs=nnx.Rngs(1))
        self.gate = nnx.Linear(D, F, use_bias=False, rngs=nnx.Rngs(2))
        self.down = nnx.Linear(F, D, use_bias=False, rngs=nnx.Rngs(3))
        self.residual_reads_norm = residual_reads_norm

    def __call__(self, x):
        h = self.norm(x)
        out = self.down(jax.nn.silu(self.gate(h)) * self.up(h))
        return out + (h if self.residual_reads_norm else x)


def _setup(residual_reads_norm=False):
    model = Block(residual_reads_norm)
    model.norm.scale.set_value(jnp.linspace(0.5, 2.0, D))
    graphdef, state = nnx.split(model)
    fn = lambda s, x: nnx.merge(graphdef, s)(x)
    # Activations with a few outlier channels, as in real transformers.
    boost = jnp.ones(D).at[jnp.array([3, 17])].set(30.0)
    batches = [jax.random.normal(jax.random.key(i), (64, D)) * boost for i in range(2)]
    return fn, nnx.to_pure_dict(state), batches


def _w4a8_rule(path, algorithm):
    int4 = QuantConfig(format="int4", granularity=PerGroup(8, axis=0))
    act = QuantConfig(format="int8", granularity=PerToken())
    return Rule(path=path, weight=int4, algorithm=algorithm, activation=act)


def _weights(recipe_rule):
    return Recipe(rules=(Rule(path="(up|gate)/kernel", **recipe_rule),), name="t")


@pytest.mark.parametrize("algorithm", [SmoothQuant(alpha=0.5), AWQ(grid=5)])
def test_folding_alone_leaves_the_float_model_unchanged(algorithm):
    fn, params, batches = _setup()
    recipe = Recipe(rules=(_w4a8_rule("(up|gate)/kernel", algorithm),))
    stats = capture(fn, params, batches, sample_rows=64)
    wanted = lowbit.api.algorithm_weights(recipe, params)
    folds, skipped = plan_folds(dict(param_leaves(params)), wanted, stats)
    assert [f.target for f in folds] == ["norm/scale"]
    assert sorted(folds[0].weights) == ["gate/kernel", "up/kernel"]
    assert not np.allclose(folds[0].scale, 1.0)
    folded = apply_folds(params, folds, {"up/kernel": 0, "gate/kernel": 0})
    x = batches[0]
    np.testing.assert_allclose(fn(folded, x), fn(params, x), rtol=2e-5, atol=2e-5)


def _w8a8(residual_reads_norm=False, algorithm=None):
    """(float params, RTN w8a8 params, SmoothQuant params, report, output error of params)."""
    fn, params, batches = _setup(residual_reads_norm)
    act = QuantConfig(format="int8", granularity=PerToken())
    w8 = QuantConfig(format="int8", granularity=lowbit.PerChannel((-1,)))
    base = dict(path="(up|gate)/kernel", weight=w8, activation=act)
    rtn = lowbit.quantize_params(params, Recipe(rules=(Rule(**base),)))
    sq, report = _quantize(
        params,
        Recipe(rules=(Rule(**base, algorithm=algorithm or SmoothQuant()),)),
        fn=fn,
        calibration=batches,
    )
    x = batches[1]
    err = lambda q: float(jnp.mean((lowbit.run(fn)(q, x) - fn(params, x)) ** 2))
    return params, rtn, sq, report, err


def test_smoothquant_lowers_w8a8_error_on_outlier_channels():
    _, rtn, sq, report, err = _w8a8()
    assert err(sq) < err(rtn)
    assert report.applied["up/kernel"].startswith("smoothquant")


def test_awq_is_no_worse_than_rtn_and_a_norm_read_elsewhere_is_not_folded():
    fn, params, batches = _setup()
    int4 = QuantConfig(format="int4", granularity=PerGroup(8, axis=0))
    rtn = lowbit.quantize_params(params, _weights(dict(weight=int4)))
    awq, report = _quantize(
        params, _weights(dict(weight=int4, algorithm=AWQ(grid=10))), fn=fn, calibration=batches
    )
    x = jnp.concatenate(batches)
    err = lambda q: float(jnp.mean((lowbit.run(fn)(q, x) - fn(params, x)) ** 2))
    assert err(awq) <= err(rtn) * 1.0001
    assert report.applied["gate/kernel"].startswith("awq")

    fn2, params2, _ = _setup(residual_reads_norm=True)
    _, report2 = _quantize(
        params2, _weights(dict(weight=int4, algorithm=AWQ(grid=2))), fn=fn2, calibration=batches
    )
    assert "read outside the matmuls" in report2.applied["up/kernel"]


def test_smoothquant_on_weight_only_rule_names_both():
    _, params, _ = _setup()
    int4 = QuantConfig(format="int4", granularity=PerGroup(8, axis=0))
    with pytest.raises(ValueError, match="'smoothquant'.*'int4'.*activation=None"):
        _quantize(params, _weights(dict(weight=int4, algorithm=SmoothQuant())))


@pytest.mark.parametrize("algorithm", [SmoothQuant(alpha=0.5), AWQ(grid=5)])
def test_down_projection_scale_folds_into_the_up_projection(algorithm):
    # down reads silu(gate(h)) * up(h): the factor can go into up's output columns (gate's
    # output also passes through the sigmoid, so not into gate).
    fn, params, batches = _setup()
    rule = _w4a8_rule("(up|gate|down)/kernel", algorithm)
    stats = capture(fn, params, batches)
    assert stats.for_path("down/kernel")[0].activation_scale == frozenset(
        {("gate/kernel", 1), ("up/kernel", 1)}
    )
    wanted = lowbit.api.algorithm_weights(Recipe(rules=(rule,)), params)
    folds, skipped = plan_folds(dict(param_leaves(params)), wanted, stats)
    assert skipped == {}
    assert {(f.target, f.axis, f.weights) for f in folds} == {
        ("norm/scale", 0, ("gate/kernel", "up/kernel")),
        ("up/kernel", 1, ("down/kernel",)),
    }
    axes = {"up/kernel": 0, "gate/kernel": 0, "down/kernel": 0}
    folded = apply_folds(params, folds, axes)
    assert not np.allclose(folded["up"]["kernel"], params["up"]["kernel"])
    x = batches[0]
    np.testing.assert_allclose(fn(folded, x), fn(params, x), rtol=2e-5, atol=2e-5)


def test_awq_search_error_is_the_output_error_on_the_rows():
    from lowbit.algorithms._smooth import _scaled_error, fake_quant

    x = np.random.default_rng(0).normal(size=(40, 16)).astype(np.float32)
    w = np.random.default_rng(1).normal(size=(16, 6)).astype(np.float32)
    s = np.linspace(0.5, 2.0, 16).astype(np.float32)
    int4 = QuantConfig(format="int4", granularity=PerGroup(8, axis=0))
    q = np.asarray(fake_quant(jnp.asarray(w * s[:, None]), int4))
    direct = np.sum((x @ w - (x / s) @ q) ** 2)
    gram = _scaled_error(jnp.asarray(x.T @ x), jnp.asarray(w), jnp.asarray(s), 0, int4)
    np.testing.assert_allclose(float(gram), direct, rtol=1e-4)


def test_smoothquant_alpha_search_is_no_worse_than_its_default_on_the_sample():
    fn, params, batches = _setup()
    act = QuantConfig(format="int8", granularity=PerToken())
    w4 = QuantConfig(format="int4", granularity=PerGroup(8, axis=0))
    base = dict(path="(up|gate|down)/kernel", weight=w4, activation=act)
    x = jnp.concatenate(batches)
    err = lambda q: float(jnp.mean((lowbit.run(fn)(q, x) - fn(params, x)) ** 2))
    errors = {}
    for grid in (0, 8):
        recipe = Recipe(rules=(Rule(**base, algorithm=SmoothQuant(grid=grid)),))
        q, report = _quantize(params, recipe, fn=fn, calibration=batches)
        errors[grid] = err(q)
        assert ("searched on 8" in report.applied["up/kernel"]) == (grid == 8)
    assert errors[8] <= errors[0] * 1.05
    with pytest.raises(ValueError, match=r"SmoothQuant.grid: -1; accepted: an int >= 0"):
        SmoothQuant(grid=-1)


def test_gptq_with_awq_scales_and_clip_search_beats_rtn_and_says_what_it_did():
    from lowbit.recipes import GPTQ

    fn, params, batches = _setup()
    int4 = QuantConfig(format="int4", granularity=PerGroup(8, axis=0))
    base = dict(path="(up|gate|down)/kernel", weight=int4)
    rtn = lowbit.quantize_params(params, Recipe(rules=(Rule(**base),)))
    recipe = Recipe(rules=(Rule(**base, algorithm=GPTQ(clip=True, scale=True)),))
    q, report = _quantize(params, recipe, fn=fn, calibration=batches * 4)
    x = jnp.concatenate(batches)
    err = lambda q: float(jnp.mean((lowbit.run(fn)(q, x) - fn(params, x)) ** 2))
    assert err(q) < err(rtn)
    down = report.applied["down/kernel"]
    assert down.startswith("gptq (") and "folded into up/kernel's output" in down
    assert "clipped (mean range ratio" in down


def test_smoothquant_applies_its_scale_inside_the_op_where_no_layer_absorbs_it():
    # The norm's output also feeds the residual: nothing can absorb the scale, so the weights
    # keep it (`QArray.input_scale`) and the op divides their input by it before quantizing.
    params, rtn, sq, report, err = _w8a8(residual_reads_norm=True)
    assert "inside the op" in report.applied["up/kernel"]
    assert "read outside the matmuls" in report.applied["up/kernel"]
    np.testing.assert_array_equal(sq["norm"]["scale"], params["norm"]["scale"])
    q = sq["up"]["kernel"]
    assert q.input_scale.shape == (D, 1)
    # The QArray still stands for the float weight (dequantize folds the scale back in).
    w = params["up"]["kernel"]
    assert float(jnp.max(jnp.abs(q.dequantize() - w))) < 0.05 * float(jnp.max(jnp.abs(w)))
    assert err(sq) < 0.5 * err(rtn)

    report_off = _w8a8(residual_reads_norm=True, algorithm=SmoothQuant(in_op=False))[3]
    assert report_off.applied["up/kernel"].endswith("rtn")
