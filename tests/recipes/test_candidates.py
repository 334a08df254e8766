"""Candidates of a budgeted plan: text forms, configs, stored bytes, targets, plan recipes."""

import jax.numpy as jnp
import pytest

from lowbit.qarray import PerChannel, PerGroup
from lowbit.recipes import (
    GPTQ,
    Recipe,
    default_candidates,
    parse_candidate,
    parse_candidates,
    plan_recipe,
    storable,
)


def test_text_forms():
    c = parse_candidate("int4:g64:asym")
    assert (c.format, c.group, c.symmetric, c.algorithm, c.gguf_type) == (
        "uint4",
        64,
        False,
        None,
        None,
    )
    assert parse_candidate("int3:g64:gptq").algorithm == GPTQ()
    q41 = parse_candidate("q4_1")
    assert (q41.format, q41.group, q41.symmetric, q41.gguf_type) == ("uint4", 32, False, "Q4_1")
    assert parse_candidate("q4_k").gguf_type == "Q4_K"
    assert parse_candidate("int8").config("dense/kernel", 2).granularity == PerChannel((-1,))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("int9", "is not a format"),
        ("int4:g64:fast", "unknown option 'fast'"),
        ("q4_k:g32", "takes no options"),
        ("q8_0:g64", "fixed"),
        ("int4:gptq", "need groups"),
    ],
)
def test_bad_text_names_the_problem(text, message):
    with pytest.raises(ValueError, match=message):
        parse_candidate(text, "--candidates")


def test_repeated_and_empty_lists():
    with pytest.raises(ValueError, match="more than once"):
        parse_candidates("q4_0,q4_0")
    with pytest.raises(ValueError, match="names no candidate"):
        parse_candidates(" , ")


def test_configs_follow_the_layout():
    q4k = parse_candidate("q4_k")
    assert q4k.config("layers/0/up/kernel", 2).granularity == PerGroup(256, -2)
    assert q4k.config("embed/embedding", 2).granularity == PerGroup(256, -1)
    assert q4k.config("norm/scale", 1) is None
    assert q4k.fits("layers/0/up/kernel", (512, 64))
    assert not q4k.fits("layers/0/up/kernel", (576, 64))  # rows of 576 are not whole blocks
    assert parse_candidate("q8_0").config("x/kernel", 2).scale_dtype == jnp.float16


def test_gguf_bytes():
    assert parse_candidate("q4_k").gguf_nbytes((512, 64)) == 512 * 64 // 256 * 144
    assert parse_candidate("q8_0").gguf_nbytes((64, 64)) == 64 * 64 // 32 * 34
    with pytest.raises(ValueError, match="no GGUF type"):
        parse_candidate("nf4:g64").gguf_nbytes((64, 64))


def test_targets():
    assert all(c.gguf_type for c in default_candidates("gguf"))
    mixed = parse_candidates("q4_k,nf4:g64")
    assert storable(mixed, "lowbit") == mixed
    with pytest.raises(ValueError, match="stores candidates nf4:g64"):
        storable(mixed, "gguf")
    with pytest.raises(ValueError, match="stores none of the candidates int4:g64"):
        storable(parse_candidates("int4:g64"), "gguf")
    with pytest.raises(ValueError, match="accepted: lowbit, gguf"):
        default_candidates("onnx")


def test_plan_recipe_round_trips_and_refuses_another_model():
    cands = parse_candidates("q4_k,int3:g64:gptq")
    plan = plan_recipe(
        {"layers/0/up/kernel": (cands[0], (512, 64)), "embed/embedding": (cands[1], (100, 64))}
    )
    again = Recipe.from_json(plan.to_json())
    assert again == plan and again.shapes == plan.shapes
    params = {
        "layers": {"0": {"up": {"kernel": jnp.zeros((512, 64))}}},
        "embed": {"embedding": jnp.zeros((100, 64))},
        "norm": {"scale": jnp.ones(64)},
    }
    report = plan.report(params)
    assert report["layers/0/up/kernel"].config.format == "q4_k"
    assert report["embed/embedding"].config.format == "int3"
    assert not report["norm/scale"].quantized
    plan.check_shapes(params)
    params["layers"]["0"]["up"]["kernel"] = jnp.zeros((256, 64))
    with pytest.raises(ValueError, match=r"'layers/0/up/kernel' has shape \(256, 64\) here"):
        plan.check_shapes(params)
    params["layers"]["0"]["up"]["kernel"] = jnp.zeros((512, 64))
    del params["embed"]
    with pytest.raises(ValueError, match="'embed/embedding'.*does not have"):
        plan.check_shapes(params)
    with pytest.raises(ValueError, match="Recipe.shapes"):
        Recipe.from_json({"rules": [], "shapes": {"a": "512x64"}})


def test_contraction_axis_follows_the_matmul_layouts():
    from lowbit.recipes import contraction_axis

    assert contraction_axis("layers/0/mlp/up/kernel", 2) == 0  # Flax [K, N]
    assert contraction_axis("layers/0/mlp/up/kernel", 3) == 1  # stacked [L, K, N]
    assert contraction_axis("model/fc.weight", 2) == 1  # PyTorch [N, K]
    assert contraction_axis("embed/embedding", 2) == 1  # [V, D] as the output head
    assert contraction_axis("layers/0/norm/scale", 1) is None
