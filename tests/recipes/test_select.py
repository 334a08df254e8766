"""`Select`: one parameter selector behind quantization, LoRA, fp8 and sparsity rules."""

import dataclasses
import doctest

import jax
import jax.numpy as jnp
import pytest

import lowbit.recipes._select
from lowbit.api import (
    Fp8Recipe,
    LoraConfig,
    LoraRule,
    SparseRule,
    fp8_init,
    fp8_recipe,
    lora_init,
    nm_masks,
)
from lowbit.api._lora import lora_plan
from lowbit.qarray import QuantConfig
from lowbit.recipes import Recipe, Rule, Select, select_params
from lowbit.recipes._select import first_matches, no_match_error

INT8 = QuantConfig(format="int8")


def _params():
    layer = lambda: {
        "attn": {"kernel": jnp.ones((8, 8)), "bias": jnp.ones(8)},
        "mlp": {"kernel": jnp.ones((8, 16)), "bias": jnp.ones(16)},
    }
    return {"layers": [layer(), layer()], "norm": {"scale": jnp.ones(8)}}


def _selected_by_each_rule_type(path, exclude):
    """The paths Rule, LoraRule, Fp8Recipe and SparseRule select for one pattern."""
    params = _params()
    report = Recipe(rules=(Rule(path=path, exclude=exclude, weight=INT8),)).report(params)
    lora = LoraConfig(rules=(LoraRule(path=path, exclude=exclude, rank=2),))
    return {
        "Rule": {d.path for d in report.quantized},
        "LoraRule": set(lora_plan(params, lora)[0]),
        "LoraRule via lora_init": set(lora_init(params, lora, jax.random.key(0))),
        "Fp8Recipe": set(fp8_init(params, Fp8Recipe(path=path, exclude=exclude))),
        "SparseRule": set(nm_masks(params, SparseRule(path=path, exclude=exclude))),
    }


@pytest.mark.parametrize(
    "path, exclude, expected",
    [
        (r".*kernel", None, {f"layers/{i}/{m}/kernel" for i in (0, 1) for m in ("attn", "mlp")}),
        (r".*kernel", r"layers/0/.*", {"layers/1/attn/kernel", "layers/1/mlp/kernel"}),
        (r"layers/\d+/mlp/kernel", None, {"layers/0/mlp/kernel", "layers/1/mlp/kernel"}),
        (r".*attn.*", None, {"layers/0/attn/kernel", "layers/1/attn/kernel"}),
    ],
)
def test_every_rule_type_selects_the_same_paths_for_the_same_pattern(path, exclude, expected):
    selected = _selected_by_each_rule_type(path, exclude)
    assert selected == {name: expected for name in selected}


def test_every_rule_type_holds_a_select_built_from_its_arguments():
    common = dict(path=r".*kernel", exclude=r".*/0/.*")
    assert Rule(**common, weight=INT8, min_size=4).select == Select(
        **common, min_ndim=2, min_size=4
    )
    assert LoraRule(**common, ops="dot_general").select == Select(
        **common, ops=("dot_general",), min_ndim=2
    )
    fp8 = Fp8Recipe(**common, stacked_axes=1)
    assert fp8.select == Select(**common, min_ndim=2, stacked_axes=1)
    assert SparseRule(**common).select == Select(**common, min_ndim=2)
    # The selector is derived: not an argument, not in equality, JSON or repr.
    assert "select" not in repr(Rule(path="x"))
    assert "select" not in LoraRule().to_dict()
    assert "select" not in Recipe(rules=(Rule(weight=INT8),)).to_json()
    assert Recipe.from_json(Recipe(rules=(Rule(ops="conv", weight=INT8),)).to_json()).rules[
        0
    ].select == Select(ops=("conv",), min_ndim=2)
    with pytest.raises(TypeError):
        Rule(select=Select())
    with pytest.raises(ValueError, match="unknown fields"):
        fp8_recipe("fp8_delayed", select=Select())


def test_replace_rebuilds_the_select():
    rule = dataclasses.replace(Rule(path=r".*kernel", weight=INT8), path=r".*bias")
    assert rule.select.path == r".*bias" and rule.matches("dense/bias")
    recipe = fp8_recipe("fp8_delayed", path=r"dense/.*", min_ndim=1)
    assert recipe.select == Select(path=r"dense/.*", min_ndim=1)


def test_matches_path_shape_size_and_stacked_axes():
    select = Select(path=r".*kernel", exclude=r".*/0/.*", min_ndim=2, min_size=16)
    assert select.matches("layers/1/kernel", jnp.ones((4, 4)))
    assert not select.matches("layers/0/kernel", jnp.ones((4, 4)))  # excluded
    assert not select.matches("layers/1/bias", jnp.ones((4, 4)))  # path
    assert select.rejects("k", jnp.ones(16)) == "1 axes (0 stacked not counted) < min_ndim 2"
    assert select.rejects("k", jnp.ones((2, 4))) == "size 8 < min_size 16"
    assert select.rejects("k", "text") == "not an array (str)"
    stacked = Select(min_ndim=2, stacked_axes=1)
    assert not stacked.matches("w", jnp.ones((3, 4)))
    assert stacked.matches("w", jax.ShapeDtypeStruct((3, 4, 4), jnp.float32))


def test_ops_filter():
    select = Select(ops="dot_general", owner="LoraRule")
    assert select.ops == ("dot_general",)
    w = jnp.ones((4, 4))
    assert select.matches("w", w, {"w": {"einsum"}})  # einsum lowers to dot_general
    assert not select.matches("w", w, {"w": {"gather"}})
    assert select.rejects("w", w, {}) == "feeds only no op; the rule has ops=('dot_general',)"
    with pytest.raises(ValueError, match=r"LoraRule\(path='\.\*'\) filters on ops.*pass uses="):
        select.matches("w", w)
    with pytest.raises(ValueError, match=r"LoraRule\(path='\.\*'\) filters on ops"):
        lora_init({"w": w}, LoraRule(ops="dot_general", rank=1), jax.random.key(0))
    with pytest.raises(ValueError, match=r"Rule\(path='\.\*'\) filters on ops"):
        Recipe(rules=(Rule(ops="dot_general", weight=INT8),)).report({"w": w})
    assert LoraRule(ops="conv").matches("w", {"w": frozenset({"conv"})})


RULE_TYPES = [
    ("Rule", lambda **kw: Rule(weight=INT8, **kw)),
    ("LoraRule", LoraRule),
    ("Fp8Recipe", Fp8Recipe),
    ("SparseRule", SparseRule),
    ("Select", Select),
]


@pytest.mark.parametrize("name, make", RULE_TYPES, ids=[n for n, _ in RULE_TYPES])
@pytest.mark.parametrize("field", ["path", "exclude"])
def test_bad_patterns_name_the_rule_the_field_and_the_fix(name, make, field):
    with pytest.raises(ValueError, match=rf"^{name}\.{field}: '\(' is not a valid regex .*escape"):
        make(**{field: "("})
    with pytest.raises(TypeError, match=rf"^{name}\.{field} must be a regex string, got int"):
        make(**{field: 3})
    with pytest.raises(ValueError, match=r"for a glob write the regex '\.\*/kernel'"):
        make(**{field: "*/kernel"})


@pytest.mark.parametrize("name, make", RULE_TYPES, ids=[n for n, _ in RULE_TYPES])
def test_bad_filters_name_the_rule_and_the_accepted_values(name, make):
    with pytest.raises(ValueError, match=rf"^{name}\.ops: .*'matmul'.*accepted"):
        Select(ops=("matmul",), owner=name)
    with pytest.raises(ValueError, match=rf"^{name}\.min_ndim: -1; accepted: an int >= 0"):
        Select(min_ndim=-1, owner=name)
    if name in ("Rule", "LoraRule"):
        with pytest.raises(ValueError, match=rf"^{name}\.ops: .*'matmul'"):
            make(ops=("matmul",))
    if name != "Select":
        with pytest.raises(ValueError, match=rf"^{name}\.min_ndim: -1; accepted"):
            make(min_ndim=-1)


def test_lora_train_pattern_is_checked_and_selects_float_params():
    with pytest.raises(ValueError, match=r"^LoraConfig\.train: '\[' is not a valid regex"):
        LoraConfig(rules=(LoraRule(),), train="[")
    config = LoraConfig(rules=(LoraRule(path=r".*kernel", rank=2),), train=r".*bias")
    plans, full = lora_plan(_params(), config)
    assert full == [f"layers/{i}/{m}/bias" for i in (0, 1) for m in ("attn", "mlp")]


def test_selecting_nothing_says_why():
    params = {"dense": {"kernel": jnp.ones((8, 8)), "bias": jnp.ones(8)}}
    with pytest.raises(
        ValueError,
        match=r"^SparseRule\(path='nothing'\) selects no parameter: its path matches no parameter "
        r"path; accepted: .*'dense/kernel'",
    ):
        nm_masks(params, SparseRule(path="nothing"))
    with pytest.raises(
        ValueError,
        match=r"^Fp8Recipe\(path='\.\*bias'\) selects no parameter: its path matches 1 "
        r"parameter\(s\), all left out, e.g. 'dense/bias': 1 axes .* < min_ndim 2; fix: loosen",
    ):
        fp8_init(params, Fp8Recipe(path=r".*bias"))
    shadowed = LoraConfig(rules=(LoraRule(rank=2), LoraRule(path=r".*kernel", rank=2)))
    with pytest.raises(
        ValueError,
        match=r"^LoraRule\(path='\.\*kernel'\) \(rule 1\) selects no parameter: .*'dense/kernel': "
        r"an earlier rule selects it \(the first match wins\); fix: reorder the rules",
    ):
        lora_plan({"dense": {"kernel": jnp.ones((8, 8))}}, shadowed)


def test_walks():
    params = _params()
    assert list(select_params(params, Select(path=r"layers/1/.*", min_ndim=2))) == [
        "layers/1/attn/kernel",
        "layers/1/mlp/kernel",
    ]
    leaves = [("a/kernel", jnp.ones((2, 2))), ("a/bias", jnp.ones(2)), ("b", jnp.ones((2, 2)))]
    selects = [Select(path=r".*kernel"), Select(path=r"a/.*"), Select(path="none")]
    assert first_matches(leaves, selects) == [0, 1, None]
    assert "'a/kernel', 'a/bias', 'b'" in str(no_match_error(selects[2], leaves))


def test_docstring_examples():
    result = doctest.testmod(lowbit.recipes._select, verbose=False)
    assert result.attempted > 0 and result.failed == 0
