"""Recipes with algorithms: quantize_params / quantize_model, presets and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from algorithm_support import quantize_with_report as _quantize
from flax import nnx

import lowbit
from lowbit import quantize_model
from lowbit.algorithms import AlgorithmReport, CalibrationError, capture
from lowbit.qarray import MinMax, PerGroup, QuantConfig
from lowbit.recipes import GPTQ, HQQ, Recipe, Rule, preset

D_IN, D_OUT = 32, 16
INT4 = QuantConfig(format="int4", granularity=PerGroup(8, axis=0))


def _fn(p, x):
    return jnp.tanh(x @ p["a"]) @ p["b"]


def _setup():
    k = jax.random.split(jax.random.key(0), 3)
    params = {
        "a": jax.random.normal(k[0], (D_IN, D_IN)),
        "b": jax.random.normal(k[1], (D_IN, D_OUT)),
    }
    basis = jax.random.normal(k[2], (8, D_IN))
    batches = [
        jax.random.normal(jax.random.key(i), (64, 8)) @ basis for i in range(1, 4)
    ]  # correlated inputs
    return params, batches


def test_gptq_recipe_beats_rtn_and_reports_every_weight():
    params, batches = _setup()
    recipe = Recipe(rules=(Rule(weight=INT4, algorithm=GPTQ()),), name="g")
    q, report = _quantize(params, recipe, fn=_fn, calibration=batches)
    rtn = lowbit.quantize_params(params, Recipe(rules=(Rule(weight=INT4),)))
    x = batches[0]
    err = lambda qp: float(jnp.mean((lowbit.run(_fn)(qp, x) - _fn(params, x)) ** 2))
    assert err(q) < err(rtn)
    assert sorted(report.applied) == ["a", "b"]
    assert all(v.startswith("gptq") for v in report.applied.values())


def test_data_algorithm_without_data_names_the_rule():
    params, _ = _setup()
    recipe = Recipe(rules=(Rule(path="a", weight=INT4, algorithm=GPTQ()),), name="r")
    with pytest.raises(ValueError, match=r"rule 0 \(path='a'\).*'gptq'.*calibration="):
        lowbit.quantize_params(params, recipe)
    with pytest.raises(ValueError, match=r"rule 0 \(path='a'\).*'gptq'.*calibration="):
        lowbit.quantize(params, recipe)


def test_lowbit_quantize_runs_the_algorithm_and_lays_weights_out():
    params, batches = _setup()
    recipe = Recipe(rules=(Rule(weight=INT4, algorithm=GPTQ()),), name="g")
    report = AlgorithmReport()
    q = lowbit.quantize(params, recipe, fn=_fn, calibration=batches, report=report)
    logical = lowbit.quantize_params(params, recipe, fn=_fn, calibration=batches)
    assert sorted(report.applied) == ["a", "b"]
    x = batches[0]
    np.testing.assert_allclose(
        lowbit.run(_fn)(q, x), lowbit.run(_fn)(logical, x), rtol=1e-4, atol=1e-4
    )


def test_too_few_tokens_says_how_many():
    params, batches = _setup()
    recipe = Recipe(rules=(Rule(weight=INT4, algorithm=GPTQ()),))
    with pytest.raises(CalibrationError, match="at least 32"):
        _quantize(params, recipe, fn=_fn, calibration=[batches[0][:4]])


def test_hqq_is_data_free_and_refuses_symmetric_formats():
    params, _ = _setup()
    asym = QuantConfig(
        format="uint4", granularity=PerGroup(8, axis=0), symmetric=False, calibration=MinMax()
    )
    q, report = _quantize(params, Recipe(rules=(Rule(weight=asym, algorithm=HQQ()),)))
    assert isinstance(q["a"], lowbit.QArray) and report.applied["a"].startswith("hqq")
    with pytest.raises(ValueError, match="'hqq'.*symmetric"):
        _quantize(params, Recipe(rules=(Rule(weight=INT4, algorithm=HQQ()),)))


def test_quantize_model_takes_calibration_batches():
    model = nnx.Linear(D_IN, D_OUT, rngs=nnx.Rngs(0))
    _, batches = _setup()
    recipe = Recipe(rules=(Rule(path=".*kernel", weight=INT4, algorithm=GPTQ()),))
    report = AlgorithmReport()
    qmodel = quantize_model(model, recipe, calibration=batches, report=report)
    assert qmodel(batches[0]).shape == (64, D_OUT)
    assert report.applied["kernel"].startswith("gptq")
    kernel = nnx.state(qmodel.module)["kernel"].get_value()
    assert isinstance(kernel, lowbit.QArray) or lowbit.ops.is_prepared(kernel)
    with pytest.raises(ValueError, match=r"rule 0 \(path='.\*kernel'\).*calibration="):
        quantize_model(model, recipe)


def test_quantize_model_with_calibration_keeps_example_args():
    # Example inputs find a weight no rule names by path (`w`) by its use, with GPTQ too.
    class Plain(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jax.random.normal(jax.random.key(0), (D_IN, D_OUT)))

        def __call__(self, x):
            return x @ self.w

    _, batches = _setup()
    recipe = Recipe(rules=(Rule(path=".*kernel", weight=INT4, algorithm=GPTQ()),))
    report = AlgorithmReport()
    qmodel = quantize_model(
        Plain(), recipe, calibration=batches, example_args=(batches[0],), report=report
    )
    assert report.applied["w"].startswith("gptq")
    assert qmodel(batches[0]).shape == (64, D_OUT)


@pytest.mark.parametrize(
    "name",
    [
        "int4w_g64_gptq",
        "nf4_g64_gptq",
        "int3w_g64_gptq",
        "int4w_g64_hqq",
        "int4w_g64_awq",
        "int4w_g64_sym_awq",
        "int8_smoothquant",
    ],
)
def test_algorithm_presets_round_trip_json(name):
    recipe = preset(name)
    assert Recipe.from_json(recipe.to_json()) == recipe
    assert any(r.algorithm is not None for r in recipe.rules)


def test_rule_algorithm_errors_name_field_and_accepted_values():
    with pytest.raises(ValueError, match=r"Rule.algorithm.*accepted.*gptq"):
        Rule(weight=INT4, algorithm="bogus")
    with pytest.raises(ValueError, match=r"GPTQ.damp"):
        GPTQ(damp=-1.0)
    with pytest.raises(ValueError, match="weight=None"):
        Rule(algorithm=GPTQ())


def test_calibration_speeches_are_disjoint_from_evaluation_speeches():
    from lowbit.eval._corpus import CALIBRATION_SPEECHES, SOTU_SPEECHES

    assert not set(CALIBRATION_SPEECHES) & set(SOTU_SPEECHES)
    np.testing.assert_equal(len(CALIBRATION_SPEECHES), 11)


def test_sequential_gptq_recalibrates_later_weights_on_quantized_earlier_ones():
    params, batches = _setup()
    recipe = Recipe(rules=(Rule(weight=INT4, algorithm=GPTQ()),), name="g")
    one, _ = _quantize(params, recipe, fn=_fn, calibration=batches)
    two, report = _quantize(params, recipe, fn=_fn, calibration=batches, sequential=2)
    assert report.applied["a"].endswith("pass 1/2") and report.applied["b"].endswith("pass 2/2")
    # The first weight is the same; the second saw the quantized first layer's outputs.
    np.testing.assert_array_equal(one["a"].codes, two["a"].codes)
    assert not np.array_equal(one["b"].codes, two["b"].codes)
    with pytest.raises(ValueError, match="sequential"):
        _quantize(params, recipe, statistics=report.statistics, sequential=2)


def test_sequential_passes_calibrate_on_the_model_being_quantized(monkeypatch):
    # With folded scales (GPTQ(scale=True)), the model a later pass calibrates on must be the
    # quantized model's float twin: folded norms once, earlier weights at their codes' values.
    from lowbit.api import _algorithms
    from lowbit.recipes import map_params

    class Block(nnx.Module):
        def __init__(self):
            self.norm = nnx.RMSNorm(D_IN, rngs=nnx.Rngs(0))
            self.up = nnx.Linear(D_IN, 2 * D_IN, use_bias=False, rngs=nnx.Rngs(1))
            self.down = nnx.Linear(2 * D_IN, D_IN, use_bias=False, rngs=nnx.Rngs(2))

        def __call__(self, x):
            return self.down(jax.nn.gelu(self.up(self.norm(x))))

    block = Block()
    block.norm.scale.set_value(jnp.linspace(0.5, 2.0, D_IN))
    graphdef, state = nnx.split(block)
    fn = lambda s, x: nnx.merge(graphdef, s)(x)
    params = nnx.to_pure_dict(state)
    boost = jnp.ones(D_IN).at[3].set(20.0)
    batches = [jax.random.normal(jax.random.key(i), (64, D_IN)) * boost for i in range(2)]
    seen = []
    monkeypatch.setattr(
        _algorithms, "capture", lambda fn, p, *a, **k: seen.append(p) or capture(fn, p, *a, **k)
    )
    rule = Rule(path=".*kernel", weight=INT4, algorithm=GPTQ(scale=True))
    two, report = _quantize(params, Recipe(rules=(rule,)), fn=fn, calibration=batches, sequential=2)
    assert "awq" in report.applied["up/kernel"] and report.applied["down/kernel"].endswith("2/2")
    second = seen[-1]  # the pass calibrating `down`, with `up` already quantized
    twin = map_params(
        lambda p, leaf: two["down"]["kernel"].dequantize() if p == "down/kernel" else leaf, second
    )
    x = batches[0]
    np.testing.assert_allclose(fn(twin, x), lowbit.run(fn)(two, x), rtol=1e-4, atol=1e-4)


def test_row_mask_reaches_the_statistics():
    # (x, mask) batches: the mask says which rows count; GPTQ's statistics see only those.
    params, batches = _setup()
    mask = (jnp.arange(64) % 4 != 0).astype(jnp.int32)  # 48 of 64 rows
    recipe = Recipe(rules=(Rule(path="a", weight=INT4, algorithm=GPTQ()),))
    _, report = _quantize(
        params,
        recipe,
        fn=lambda p, x, m: _fn(p, x),
        calibration=[(x, mask) for x in batches],
        row_mask=lambda x, m: m,
    )
    assert report.statistics.for_path("a")[0].count == 48 * len(batches)
