"""Rules and recipes: matching, first match wins, reports, JSON, error messages."""

import json

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lowbit.qarray import (
    MSE,
    RMS,
    AbsMax,
    Fixed,
    MinMax,
    PerBlock,
    Percentile,
    PerChannel,
    PerGroup,
    PerTensor,
    PerToken,
    QuantConfig,
)
from lowbit.recipes import (
    Recipe,
    Rule,
    parse_granularity,
    path_string,
    preset,
    preset_names,
    stack_granularity,
)

INT8 = QuantConfig(format="int8", granularity=PerChannel(axes=(-1,)))
INT4 = QuantConfig(format="int4", granularity=PerGroup(16, axis=0))


def _params():
    return {
        "embed": {"embedding": jnp.ones((32, 16))},
        "layers": [
            {"mlp": {"up": {"kernel": jnp.ones((16, 32)), "bias": jnp.ones(32)}}},
            {"mlp": {"up": {"kernel": jnp.ones((16, 32)), "bias": jnp.ones(32)}}},
        ],
        "norm": {"scale": jnp.ones(16)},
        "step": jnp.zeros((), jnp.int32),
    }


def test_path_string_joins_keys_and_drops_nnx_value():
    flat, _ = jax.tree_util.tree_flatten_with_path(_params())
    paths = {path_string(keys) for keys, _ in flat}
    assert "layers/1/mlp/up/kernel" in paths
    assert "embed/embedding" in paths
    from flax import nnx

    state = nnx.split(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))[1]
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    assert {path_string(keys) for keys, _ in flat} == {"kernel", "bias"}


def test_first_match_wins_and_exclude():
    recipe = Recipe(
        rules=(
            Rule(path="layers/0/.*"),
            Rule(path=".*kernel", weight=INT8),
            Rule(path=".*kernel", weight=INT4),
        )
    )
    assert recipe.match_index("layers/0/mlp/up/kernel") == 0
    assert recipe.match_index("layers/1/mlp/up/kernel") == 1
    assert recipe.match("norm/scale") is None
    excluded = Rule(path=".*kernel", exclude=".*/1/.*", weight=INT8)
    assert excluded.matches("layers/0/mlp/up/kernel")
    assert not excluded.matches("layers/1/mlp/up/kernel")
    # fullmatch, not search: a prefix of the path does not match.
    assert not Rule(path="layers", weight=INT8).matches("layers/0/mlp/up/kernel")


def test_report_lists_float_reasons_and_unused_rules():
    recipe = Recipe(
        rules=(
            Rule(path="layers/0/.*"),
            Rule(path=".*(kernel|bias)", weight=INT8),
            Rule(path=".*attention.*", weight=INT8),
        )
    )
    report = recipe.report(_params())
    assert report.unused_rules == (2,)
    assert report["layers/1/mlp/up/kernel"].quantized
    assert "weight=None" in report["layers/0/mlp/up/kernel"].reason
    assert "min_ndim" in report["layers/1/mlp/up/bias"].reason
    assert report["norm/scale"].reason == "no rule matches"
    assert [d.path for d in report.quantized] == ["layers/1/mlp/up/kernel"]
    text = str(report)
    assert "rule 2 (path='.*attention.*') matched nothing" in text
    assert "1 quantized" in text


def test_report_non_float_and_shape_errors():
    recipe = Recipe(
        rules=(
            Rule(path=".*", weight=QuantConfig(format="int4", granularity=PerGroup(5)), min_ndim=0),
        )
    )
    report = recipe.report({"step": jnp.zeros((3,), jnp.int32), "w": jnp.ones((8, 4))})
    assert "not a floating-point array" in report["step"].reason
    assert report["w"].error and "does not divide" in report["w"].reason


def test_min_size_and_ops_filter():
    rule = Rule(path=".*", weight=INT8, min_size=1000)
    assert "min_size" in Recipe(rules=(rule,)).report({"w": jnp.ones((8, 4))})["w"].reason
    gated = Recipe(rules=(Rule(path=".*embedding", weight=INT8, ops=("dot_general",)),))
    params = {"embedding": jnp.ones((8, 4))}
    with pytest.raises(ValueError, match="uses="):
        gated.report(params)
    kept = gated.report(params, uses={"embedding": frozenset({"gather"})})["embedding"]
    assert not kept.quantized and "feeds only gather" in kept.reason
    assert gated.report(params, uses={"embedding": frozenset({"gather", "einsum"})}).quantized


def test_stacked_axes_give_per_layer_scales():
    assert stack_granularity(PerTensor(), 1) == PerChannel(axes=(0,))
    assert stack_granularity(PerChannel(axes=(-1,)), 1) == PerChannel(axes=(0, -1))
    assert stack_granularity(PerChannel(axes=(1,)), 2) == PerChannel(axes=(0, 1, 3))
    assert stack_granularity(PerGroup(16, axis=0), 1) == PerGroup(16, axis=1)
    assert stack_granularity(PerGroup(16, axis=-2), 1) == PerGroup(16, axis=-2)
    rule = Rule(path=".*", weight=QuantConfig(format="int8"), stacked_axes=1)
    config = rule.weight_config(3)
    # One scale per layer: tile covers a whole [in, out] slice.
    assert config.granularity.tile((4, 16, 32)) == (1, 16, 32)
    report = Recipe(rules=(rule,)).report({"w": jnp.ones((4, 16, 32)), "b": jnp.ones((4, 32))})
    assert report["w"].quantized and not report["b"].quantized


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(path="(", weight=INT8), r"Rule.path: '\(' is not a valid regex"),
        (dict(ops=("matmul",), weight=INT8), r"Rule.ops: .*'matmul'.*accepted"),
        (dict(weight="int8"), r"Rule.weight must be a lowbit.qarray.QuantConfig"),
        (dict(activation=INT8), r"weight=None"),
        (dict(weight=INT8, static_activation=True), r"activation=None"),
        (dict(weight=INT8, min_ndim=-1), r"Rule.min_ndim: -1; accepted"),
    ],
)
def test_rule_errors_name_field_value_and_accepted(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        Rule(**kwargs)


def test_rules_and_recipes_are_hashable():
    recipe = preset("int8")
    assert hash(recipe) == hash(preset("int8")) and recipe == preset("int8")
    assert len({recipe, preset("int8"), preset("int8w")}) == 2


@pytest.mark.parametrize("name", [n for n in preset_names() if n != "intmp"])
def test_json_round_trip_presets(name):
    recipe = preset(name)
    again = Recipe.from_json(recipe.to_json())
    assert again == recipe
    assert again.to_json() == recipe.to_json()


_granularities = st.one_of(
    st.just(PerTensor()),
    st.just(PerToken()),
    st.lists(st.integers(-3, 2), min_size=1, max_size=3, unique=True).map(
        lambda a: PerChannel(axes=tuple(a))
    ),
    st.builds(PerGroup, st.integers(1, 256), st.integers(-2, 2)),
    st.lists(st.integers(1, 256), min_size=1, max_size=2).map(lambda b: PerBlock(tuple(b))),
)
_finite = st.floats(0.01, 100, allow_nan=False)
_calibrations = st.one_of(
    st.builds(AbsMax, st.floats(0.01, 1.0)),
    st.just(MinMax()),
    st.builds(Percentile, st.floats(50, 100)),
    st.builds(RMS, _finite),
    _finite.map(lambda hi: Fixed(-hi, hi)),
    st.just(MSE()),
    st.lists(st.floats(0.5, 1.0), min_size=1, max_size=4).map(lambda g: MSE(tuple(g))),
)


@given(
    fmt=st.sampled_from(["int8", "int4", "uint4", "fp8_e4m3fn", "nf4"]),
    granularity=_granularities,
    calibration=_calibrations,
    path=st.sampled_from([".*", ".*kernel", "layers/[0-9]+/.*", "a|b"]),
    stacked=st.integers(0, 2),
    activation=st.booleans(),
)
def test_json_round_trip_random_rules(fmt, granularity, calibration, path, stacked, activation):
    # Unsigned formats are asymmetric (symmetric ones refuse a Fixed calibration with lo < 0).
    symmetric = not fmt.startswith("uint")
    weight = QuantConfig(
        format=fmt,
        granularity=granularity,
        calibration=calibration,
        symmetric=symmetric,
        scale_dtype=jnp.bfloat16,
    )
    act = QuantConfig(format="int8", granularity=PerToken()) if activation else None
    recipe = Recipe(
        rules=(
            Rule(
                path=path,
                weight=weight,
                activation=act,
                stacked_axes=stacked,
                ops=("dot_general", "gather"),
                static_activation=activation,
            ),
            Rule(path=".*"),
        ),
        name="random",
    )
    assert Recipe.from_json(recipe.to_json()) == recipe


def _rule_json(**weight):
    return json.dumps({"name": "x", "rules": [{"path": ".*", "weight": weight}]})


@pytest.mark.parametrize(
    "text, match",
    [
        (
            _rule_json(format="int5x"),
            r"Rule.weight.format: 'int5x' is not a format; accepted: .*int8",
        ),
        (
            _rule_json(format="int8", granularity="per_row"),
            r"Rule.weight.granularity: 'per_row' is not a granularity; accepted: per_tensor",
        ),
        (
            _rule_json(format="int8", calibration="absmax,x"),
            r"Rule.weight.calibration: calibration 'absmax,x' does not parse; accepted",
        ),
        (
            _rule_json(format="int8", calibration="mse,"),
            r"Rule.weight.calibration: 'mse,' has an empty ratio; accepted: 'mse' \(the default "
            r"grid\) or 'mse,' followed by comma-separated positive clip ratios",
        ),
        (
            _rule_json(format="int8", calibration="mse,1.0,x"),
            r"Rule.weight.calibration: 'mse,1.0,x' has ratio 'x', not a number; accepted",
        ),
        (
            _rule_json(format="int8", scale_dtype="float64"),
            r"Rule.weight.scale_dtype: 'float64'; accepted",
        ),
        (_rule_json(format="int8", bits=8), r"Rule.weight: unknown keys \['bits'\]"),
        (json.dumps({"rules": [{"path": ".*", "op": ["x"]}]}), r"unknown keys \['op'\]"),
        (
            json.dumps({"rules": [{"path": ".*", "ops": ["mm"], "weight": "int8"}]}),
            r"Recipe.rules\[0\]: Rule.ops",
        ),
        (json.dumps({"rules": {}}), r"must be an object"),
        ("{", r"recipe JSON is not valid JSON"),
    ],
)
def test_from_json_errors(text, match):
    with pytest.raises(ValueError, match=match):
        Recipe.from_json(text)


def test_from_json_accepts_short_forms():
    recipe = Recipe.from_json(
        {
            "rules": [
                {
                    "path": ".*kernel",
                    "weight": {
                        "format": "int4",
                        "granularity": "per_group:32:-2",
                        "calibration": "absmax,0.9",
                    },
                    "activation": "int8",
                }
            ]
        }
    )
    rule = recipe.rules[0]
    assert rule.weight.granularity == PerGroup(32, axis=-2)
    assert rule.weight.calibration == AbsMax(0.9)
    assert rule.activation == QuantConfig(format="int8")
    assert parse_granularity("per_block:128x64") == PerBlock((128, 64))
