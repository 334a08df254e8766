"""Presets and MaxText's mixed-precision JSON."""

import json

import jax.numpy as jnp
import pytest

from lowbit.formats import get_format
from lowbit.qarray import AbsMax, MinMax, PerChannel, PerGroup, PerToken
from lowbit.recipes import (
    GPTQ,
    Recipe,
    activation_config,
    int4_weight_only,
    preset,
    preset_from_maxtext_json,
    preset_names,
)

PARAMS = {
    "embed": {"embedding": jnp.ones((64, 128))},
    "mlp": {"up": {"kernel": jnp.ones((128, 256)), "bias": jnp.ones(256)}},
    "hf": {"weight": jnp.ones((256, 128))},
    "norm": {"scale": jnp.ones(128)},
}

EXPECTED = {
    # name: (weight format, activation format or None, gradient format or None)
    "int8": ("int8", "int8", None),
    "int8w": ("int8", None, None),
    "int4w": ("int4", None, None),
    "int4": ("int4", "int4", None),
    "fp8": ("fp8_e4m3fn", "fp8_e4m3fn", None),
    "fp8_full": ("fp8_e4m3fn", "fp8_e4m3fn", "fp8_e5m2"),
    "fp4": ("fp4_e2m1", None, None),
    "int8_weight_only": ("int8", None, None),
    "int4_weight_only": ("uint4", None, None),
    "int8_dynamic_activation_int8_weight": ("int8", "int8", None),
    "int8_dynamic_activation_int4_weight": ("int4", "int8", None),
    "float8_weight_only": ("fp8_e4m3fn", None, None),
    "float8_dynamic_activation_float8_weight": ("fp8_e4m3fn", "fp8_e4m3fn", None),
    "nf4": ("nf4", None, None),
    "mxfp4": ("mxfp4", None, None),
    "nvfp4": ("nvfp4", None, None),
    "int4w_g32_asym": ("uint4", None, None),
    "int4w_g64": ("int4", None, None),
    "nf4_g64": ("nf4", None, None),
    "int4w_g64_asym": ("uint4", None, None),
    "int3w_g64": ("int3", None, None),
    "int4w_g64_gptq": ("int4", None, None),
    "int4w_g64_asym_gptq": ("uint4", None, None),
    "nf4_g64_gptq": ("nf4", None, None),
    "int3w_g64_gptq": ("int3", None, None),
    "int4w_g64_hqq": ("uint4", None, None),
    "int4w_g64_awq": ("uint4", None, None),
    "int4w_g64_sym_awq": ("int4", None, None),
    "int4w_g32_asym_gptq": ("uint4", None, None),
    "int8_smoothquant": ("int8", "int8", None),
    "w4a8_g32": ("int4", "int8", None),
    "w4a8_g32_gptq": ("int4", "int8", None),
    "int4w_g64_rot_gptq": ("int4", None, None),
    "int3w_g64_rot_gptq": ("int3", None, None),
    "w4a8_g32_rot_gptq": ("int4", "int8", None),
}
# w4a4: int4 activations on the linear layers, int8 on the embedding as the logits projection.
W4A4 = ("w4a4_g32_gptq", "w4a4_g32_rot_gptq")

# The 4-bit demo recipes keep embeddings at int8 per row.
EMBEDDING_FORMAT = {
    name: "int8" for name in EXPECTED if name.startswith(("int4w_g", "nf4_g", "int3w_g", "w4a8_g"))
}


def test_every_preset_has_a_description():
    names = preset_names()
    assert set(EXPECTED) | {"float", "intmp", *W4A4} == set(names)
    assert all(isinstance(d, str) and d and "\n" not in d for d in names.values())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_formats_and_layouts(name):
    recipe = preset(name)
    weight, activation, gradient = EXPECTED[name]
    report = recipe.report(PARAMS)
    assert not report.errors
    assert {d.path for d in report.quantized} == {"embed/embedding", "mlp/up/kernel", "hf/weight"}
    for d in report.quantized:
        rule = recipe.rules[d.rule_index]
        expected = EMBEDDING_FORMAT.get(name, weight) if d.path == "embed/embedding" else weight
        assert get_format(d.config.format).name == expected
        assert (rule.activation and get_format(rule.activation.format).name) == (activation or None)
        assert (rule.gradient and get_format(rule.gradient.format).name) == (gradient or None)
    # Contraction axis of each layout: groups run along it, per-channel scales keep the other.
    kernel = report["mlp/up/kernel"].config.granularity
    embedding = report["embed/embedding"].config.granularity
    if name in EMBEDDING_FORMAT:
        assert isinstance(embedding, PerChannel) and embedding.axes == (0,)  # one scale per row
    elif isinstance(kernel, PerGroup):
        assert kernel.axis == -2 and embedding.axis == -1
    elif isinstance(kernel, PerChannel):
        assert kernel.axes == (-1,) and embedding.axes == (0,)


def test_float_preset_keeps_everything():
    assert not preset("float").report(PARAMS).quantized


def test_callable_forms_and_errors():
    assert preset("int4_weight_only", group_size=32) == int4_weight_only(32)
    config = int4_weight_only(32).rules[1].weight
    assert config.granularity == PerGroup(32, axis=-2)
    assert not config.symmetric and config.calibration == MinMax()
    assert preset("int4_weight_only").rules[1].weight.granularity.size == 128
    with pytest.raises(ValueError, match="preset 'int9' is unknown; accepted: int8"):
        preset("int9")
    with pytest.raises(ValueError, match="does not take options"):
        preset("int8", group_size=3)
    with pytest.raises(ValueError, match="preset_from_maxtext_json"):
        preset("intmp")


INTMP = {
    "__default__": {"w_bits": 8, "a_bits": 8},
    "decoder/layers_0/.*": {"w_bits": 4, "tile_size": 32, "w_scale": 0.9, "a_bits": None},
    "decoder/layers_0/mlp/wo": {"w_bits": None},
}


def test_maxtext_intmp_json(tmp_path):
    path = tmp_path / "mp.json"
    path.write_text(json.dumps(INTMP))
    recipe = preset_from_maxtext_json(path)
    assert recipe == preset_from_maxtext_json(INTMP) == preset_from_maxtext_json(json.dumps(INTMP))
    params = {
        "decoder": {
            "layers_0": {
                "mlp": {"wi": {"kernel": jnp.ones((64, 32))}, "wo": {"kernel": jnp.ones((32, 64))}}
            },
            "layers_1": {"mlp": {"wi": {"kernel": jnp.ones((64, 32))}}},
        }
    }
    report = recipe.report(params)
    wi0 = report["decoder/layers_0/mlp/wi/kernel"]
    rule = recipe.rules[wi0.rule_index]
    assert wi0.config.format == "int4" and wi0.config.granularity == PerGroup(32, axis=-2)
    assert wi0.config.calibration == AbsMax(0.9)
    assert rule.activation is None  # a_bits: null overrides the default
    # MaxText lets the last matching regex win: wo stays float.
    assert not report["decoder/layers_0/mlp/wo/kernel"].quantized
    wi1 = report["decoder/layers_1/mlp/wi/kernel"]
    assert wi1.config.format == "int8" and wi1.config.granularity == PerChannel(axes=(-1,))
    act = recipe.rules[wi1.rule_index].activation
    assert act.format == "int8" and act.granularity == PerToken()
    assert Recipe.from_json(recipe.to_json()) == recipe


@pytest.mark.parametrize(
    "data, match",
    [
        ({"x": {"w_bits": 9}}, r"intmp\['x'\].w_bits: 9; accepted: null or an int 1..8"),
        ({"x": {"w_bitz": 4}}, r"intmp\['x'\]: unknown keys \['w_bitz'\]"),
        ({"x": {"w_bits": 4, "tile_size": 0}}, r"tile_size: 0; accepted: -1 or a positive"),
        ({"x": {"a_bits": 8}}, r"a_bits=8 with w_bits=null"),
        ({"x": {"w_bits": 4, "w_scale": 2}}, r"w_scale: 2; accepted: a number in \(0, 1\]"),
    ],
)
def test_maxtext_json_errors(data, match):
    with pytest.raises(ValueError, match=match):
        preset_from_maxtext_json(data)


def test_stacked_axes_option_applies_to_every_rule():
    recipe = preset("int8", stacked_axes=1)
    assert all(rule.stacked_axes == 1 for rule in recipe.rules)
    report = recipe.report({"layers": {"kernel": jnp.ones((4, 16, 32)), "bias": jnp.ones((4, 32))}})
    kernel = report["layers/kernel"]
    assert kernel.config.granularity.tile((4, 16, 32)) == (1, 16, 1)  # per layer and channel
    assert not report["layers/bias"].quantized
    assert Recipe.from_json(recipe.to_json()) == recipe


def test_gptq_presets_search_their_group_scales():
    # GPTQ keeps the grid it is given: the presets choose it by AWQ's scales and clip search
    # on the calibration data; the embedding rule stays round-to-nearest absmax.
    names = ("int4w_g64_gptq", "int4w_g64_asym_gptq", "nf4_g64_gptq", "int3w_g64_gptq")
    for name in (*names, "w4a8_g32_gptq"):
        embedding, *rules = preset(name).rules
        assert isinstance(embedding.weight.calibration, AbsMax) and embedding.algorithm is None
        full = name == "int3w_g64_gptq"
        expected = GPTQ(clip=True, scale=True, refine=1, full_range=full)
        assert all(r.algorithm == expected for r in rules), name


@pytest.mark.parametrize("name", W4A4)
def test_w4a4_presets(name):
    recipe = preset(name)
    report = recipe.report(PARAMS)
    kernel = recipe.rules[report["mlp/up/kernel"].rule_index]
    assert kernel.weight.format == "int4" and kernel.activation.format == "int4"
    # One scale per 32 features of a token, clipped (QuaRot's activation clipping).
    assert kernel.activation.granularity == PerGroup(32, axis=-1)
    assert kernel.activation.calibration == AbsMax(clip=0.9)
    assert report["embed/embedding"].config.format == "int8"
    assert recipe.kv_cache.format == "int4"
    assert (recipe.rotate is not None) == name.endswith("_rot_gptq")


def test_activation_config_granularities():
    assert activation_config("int8").granularity == PerToken()
    assert activation_config("int4", group_size=32).granularity == PerGroup(32, axis=-1)
    with pytest.raises(ValueError, match="two granularities"):
        activation_config("int4", per_tensor=True, group_size=32)


def test_rotated_presets_keep_the_untied_head_at_int8():
    recipe = preset("int4w_g64_rot_gptq")
    head = recipe.report({"lm_head": {"kernel": jnp.ones((128, 64))}})["lm_head/kernel"]
    assert head.config.format == "int8" and recipe.rotate.online == ("down_proj",)
    # w4a4's untied head keeps the tied table's int8 activations, not the layers' int4 ones.
    recipe = preset("w4a4_g32_rot_gptq")
    head = recipe.report({"lm_head": {"kernel": jnp.ones((128, 64))}})["lm_head/kernel"]
    assert head.config.format == "int8"
    assert recipe.rules[head.rule_index].activation.format == "int8"
