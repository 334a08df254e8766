"""Tensor- and data-parallel generation on 8 simulated CPU devices: the same tokens as one
device (float, int8 and int4 weights, float and int8 KV caches, automatic and explicit mesh
axes), weights and cache placed by heads, and bad layouts refused by name."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lowbit
from lowbit import kernels
from lowbit.api import quantize_params
from lowbit.engine import interpret, trace_report
from lowbit.models import Decoder, DecoderConfig, Sampling
from lowbit.models._generate import _forward, _Sharded, generate_tokens
from lowbit.models._sharding import shard_for_generation
from lowbit.ops import PreparedPieces, PreparedQArray, logical_weights
from lowbit.qarray import PerTensor, QArray, quantize

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")

# 8 query heads over 4 kv heads, so a model axis of 2 or 4 gives whole kv heads per device;
# o_proj and down_proj have 128 rows: 32 per device at TP=4, whole groups of 32.
CONFIG = DecoderConfig(
    vocab_size=64,
    dim=64,
    n_layers=2,
    n_heads=8,
    n_kv_heads=4,
    head_dim=16,
    ffn_dim=128,
    context_length=128,
)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11], [3, 3, 60, 2]]
# 16 prompt slots + 40 new tokens: a 64-slot cache, decoded in blocks (the fused CPU step).
NEW = 40
CASES = {
    "float": (None, None),
    "int8w": ("int8w", None),
    "int4g32-kv8": ("int4w_g32_asym", "int8"),
}
SHAPES = {"tp2": (1, 2), "tp4": (1, 4), "dp2xtp2": (2, 2)}
# Logits of a sharded forward against one device: the partial sums over heads and MLP columns
# are added in another order (float32 sums of 64-128 terms of size ~1).
LOGIT_ATOL = 1e-4


def _mesh(shape, explicit: bool):
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    devices = jax.devices()[: shape[0] * shape[1]]
    return jax.make_mesh(shape, ("data", "model"), axis_types=(kind, kind), devices=devices)


@pytest.fixture(scope="module")
def model():
    return Decoder(CONFIG, rngs=nnx.Rngs(0))


@functools.cache
def _params(recipe):
    if recipe is None:
        return None
    return quantize_params(nnx.state(Decoder(CONFIG, rngs=nnx.Rngs(0)), nnx.Param), recipe)


@functools.cache
def _one_device(case):
    recipe, kv = CASES[case]
    model = Decoder(CONFIG, rngs=nnx.Rngs(0))
    return generate_tokens(
        model, PROMPTS, params=_params(recipe), max_new_tokens=NEW, kv_cache=kv
    ).tokens


# Every recipe on every mesh shape with automatic axes, and on the 2-D mesh with explicit ones
# (the other explicit combinations add compile time, not coverage: the same shard_map runs).
GREEDY = [(case, shape, False) for case in CASES for shape in SHAPES] + [
    (case, "dp2xtp2", True) for case in CASES
]


@pytest.mark.parametrize(
    "case, shape, explicit",
    GREEDY,
    ids=[f"{c}-{s}-{'explicit' if e else 'auto'}" for c, s, e in GREEDY],
)
def test_sharded_greedy_tokens_equal_one_device(model, case, shape, explicit):
    shape = SHAPES[shape]
    recipe, kv = CASES[case]
    out = generate_tokens(
        model,
        PROMPTS,
        params=_params(recipe),
        max_new_tokens=NEW,
        kv_cache=kv,
        mesh=_mesh(shape, explicit),
    )
    assert out.tokens == _one_device(case)


def _logits(model, params, mesh, kv):
    """Prefill logits ``[batch, 1, vocab]``, on one device (mesh None) or sharded."""
    graphdef, state = nnx.split(model)
    params = state if params is None else params
    width = 16
    tokens = np.zeros((len(PROMPTS), width), np.int32)
    pad = np.array([width - len(p) for p in PROMPTS], np.int32)
    for row, p in enumerate(PROMPTS):
        tokens[row, pad[row] :] = p
    cache = dataclasses.replace(model.init_cache(len(PROMPTS), 64, kv), start=jnp.asarray(pad))
    tokens = jnp.asarray(tokens)
    if mesh is not None:
        params, plan = shard_for_generation(params, mesh, CONFIG)
        graphdef = _Sharded(type(model), CONFIG, model.dtype, plan)
        cache = plan.place_cache(cache)
        tokens = jax.device_put(tokens, plan.rows(2))
    run = jax.jit(interpret(functools.partial(_forward, graphdef)))
    logits, new_cache = run(params, tokens, cache)
    return np.asarray(logits), new_cache


@pytest.mark.parametrize("shape", [(1, 4), (2, 2)], ids=["tp4", "dp2xtp2"])
@pytest.mark.parametrize("case", CASES)
def test_sharded_logits_match_one_device_within_float_sum_order(model, case, shape):
    recipe, kv = CASES[case]
    expected, _ = _logits(model, _params(recipe), None, kv)
    mesh = _mesh(shape, explicit=False)
    got, cache = _logits(model, _params(recipe), mesh, kv)
    np.testing.assert_allclose(got, expected, atol=LOGIT_ATOL, rtol=0)
    # The cache came back split by rows and kv heads.
    heads = NamedSharding(mesh, P("data", "model", None, None))
    assert cache.keys[0].sharding.is_equivalent_to(heads, 4)


def test_weights_and_cache_are_split_by_heads_and_columns():
    mesh = _mesh((2, 2), explicit=True)
    params, plan = shard_for_generation(_params("int4w_g32_asym"), mesh, CONFIG)
    attn = params["layers"][0]["attn"]
    q, o = attn["q_proj"]["kernel"].get_value(), attn["o_proj"]["kernel"].get_value()
    assert isinstance(q, QArray) and isinstance(o, QArray)
    assert q.codes.sharding.spec == P(None, "model")
    assert q.scale.sharding.spec == P(None, "model")
    assert o.codes.sharding.spec == P("model", None)
    assert o.scale.sharding.spec == P("model", None)  # 64 rows a device: two groups of 32
    down = params["layers"][1]["mlp"]["down_proj"]["kernel"].get_value()
    assert down.codes.sharding.spec == P("model", None)
    assert params["embed"]["embedding"].get_value().codes.sharding.spec == P()
    assert params["norm"]["scale"].get_value().sharding.spec == P()
    # Each device holds a quarter of q_proj's codes: a model axis of 2 halves the columns.
    piece = q.codes.addressable_shards[0].data.shape
    assert piece == (q.codes.shape[0], q.codes.shape[1] // 2)
    cache = plan.place_cache(Decoder(CONFIG, rngs=nnx.Rngs(0)).init_cache(4, 64, "int8"))
    assert cache.key_scales[1].sharding.spec == P("data", "model", None, None)
    assert cache.start.sharding.spec == P("data")
    assert cache.keys[0].addressable_shards[0].data.shape == (2, 2, 64, 16)


def test_per_channel_scales_over_split_rows_are_replicated():
    params, _ = shard_for_generation(_params("int8w"), _mesh((1, 4), False), CONFIG)
    o = params["layers"][0]["attn"]["o_proj"]["kernel"].get_value()
    assert o.codes.sharding.spec == P("model", None)
    assert o.scale.shape[0] == 1 and o.scale.sharding.is_fully_replicated


def _collectives(model, mesh):
    """Counts of all-reduce / all-gather ops in one compiled sharded decode step."""
    graphdef, state = nnx.split(model)
    params, plan = shard_for_generation(state, mesh, CONFIG)
    cache = plan.place_cache(model.init_cache(4, 64))
    tokens = jax.device_put(jnp.ones((4, 1), jnp.int32), plan.rows(2))
    sharded = _Sharded(type(model), CONFIG, model.dtype, plan)
    step = jax.jit(interpret(functools.partial(_forward, sharded)))
    text = step.lower(params, tokens, cache).compile().as_text()
    return {
        op: len(re.findall(rf"\b{op}(?:-start)?\(", text)) for op in ("all-reduce", "all-gather")
    }


def test_one_decode_step_sums_twice_per_layer_and_gathers_no_weight(model):
    counts = _collectives(model, _mesh((1, 4), explicit=False))
    # After o_proj and after down_proj in each layer; nothing else crosses devices.
    assert counts["all-reduce"] == 2 * CONFIG.n_layers
    assert counts["all-gather"] == 0


OTHER_ARCHITECTURES = {
    # q/k/v biases (split with their columns), per-head q/k norms, post-norms, sliding-window
    # layers, soft caps, a scaled embedding, GeGLU.
    "gemma-like": dataclasses.replace(
        CONFIG,
        qkv_bias=True,
        qk_norm=True,
        post_norms=True,
        sliding_window=8,
        global_every=2,
        attn_softcap=30.0,
        final_softcap=20.0,
        embed_scale=True,
        activation="gelu_tanh",
    ),
    # Experts and a shared expert: attention split, the MoE whole on every device.
    "moe": dataclasses.replace(
        CONFIG, n_experts=4, n_experts_used=2, expert_ffn_dim=32, shared_ffn_dim=48
    ),
}


@pytest.mark.parametrize("config", OTHER_ARCHITECTURES.values(), ids=OTHER_ARCHITECTURES.keys())
def test_other_architectures_equal_one_device(config):
    model = Decoder(config, rngs=nnx.Rngs(1))
    out = generate_tokens(model, PROMPTS, max_new_tokens=24, mesh=_mesh((2, 2), False))
    assert out.tokens == generate_tokens(model, PROMPTS, max_new_tokens=24).tokens


def test_rows_that_do_not_divide_the_data_axis_are_padded_and_dropped(model):
    out = generate_tokens(model, PROMPTS[:3], max_new_tokens=8, mesh=_mesh((2, 2), False))
    expected = generate_tokens(model, PROMPTS[:3], max_new_tokens=8)
    assert out.tokens == expected.tokens and len(out.tokens) == 3


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_sampled_tokens_equal_one_device(model, explicit):
    """Random bits depend on each element's index, not on how the logits are split."""
    sampling = Sampling(temperature=1.0, top_k=20, top_p=0.9)
    kw = dict(max_new_tokens=12, sampling=sampling, key=3, kv_cache="int8")
    out = generate_tokens(model, PROMPTS, mesh=_mesh((2, 2), explicit), **kw)
    assert out.tokens == generate_tokens(model, PROMPTS, **kw).tokens


def test_a_data_axis_alone_runs_rows_in_parallel(model):
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    out = generate_tokens(model, PROMPTS, max_new_tokens=8, mesh=mesh)
    assert out.tokens == generate_tokens(model, PROMPTS, max_new_tokens=8).tokens


# 3 kv heads (6 query heads): a model axis of 2 pads them to 4 (and 8 query heads).
THREE = dataclasses.replace(CONFIG, n_heads=6, n_kv_heads=3)


@pytest.mark.parametrize("recipe", [None, "int8w", "int4w_g32_asym"])
def test_kv_heads_that_do_not_divide_the_model_axis_are_padded_with_zero_heads(recipe):
    model = Decoder(THREE, rngs=nnx.Rngs(2))
    state = nnx.state(model, nnx.Param)
    params = state if recipe is None else quantize_params(state, recipe)
    kw = dict(params=params, max_new_tokens=16, kv_cache="int8")
    mesh = _mesh((2, 2), explicit=False)
    out = generate_tokens(model, PROMPTS, mesh=mesh, **kw)
    assert out.tokens == generate_tokens(model, PROMPTS, **kw).tokens
    placed, plan = shard_for_generation(params, mesh, THREE)
    assert plan.kv_heads == 4 and plan.fit(THREE).n_heads == 8
    attn = placed["layers"][0]["attn"]
    assert attn["v_proj"]["kernel"].get_value().shape == (64, 4 * 16)
    assert attn["o_proj"]["kernel"].get_value().shape == (8 * 16, 64)
    cache = plan.init_cache(model, 4, 64, "int8")
    assert cache.keys[0].shape[1] == 4 and cache.keys[0].addressable_shards[0].data.shape[1] == 2


def test_a_v_proj_with_one_scale_over_its_columns_cannot_be_padded():
    params = quantize_params(nnx.state(Decoder(THREE, rngs=nnx.Rngs(2)), nnx.Param), "int8w")
    v = params["layers"][0]["attn"]["v_proj"]["kernel"]
    v.set_value(
        quantize(logical_weights(v.get_value()).dequantize(), "int8", granularity=PerTensor())
    )
    with pytest.raises(ValueError, match=r"layers/0/attn/v_proj/kernel: one int8 scale over all"):
        shard_for_generation(params, _mesh((1, 2), False), THREE)


def test_a_group_that_straddles_two_devices_names_the_weight():
    params = _params("int4w_g64")  # o_proj rows: 32 a device at TP=4, groups of 64
    with pytest.raises(ValueError, match=r"layers/0/attn/o_proj/kernel: groups of 64.*32"):
        shard_for_generation(params, _mesh((1, 4), False), CONFIG)


def test_fused_projections_refuse_a_model_axis():
    config = dataclasses.replace(CONFIG, fused_qkv=True)
    with pytest.raises(ValueError, match=r"fused_qkv.*qkv_proj"):
        shard_for_generation({}, _mesh((1, 2), False), config)


def test_a_mesh_without_either_axis_is_refused(model):
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=r"model_axis='model'.*data_axis='data'"):
        generate_tokens(model, PROMPTS, max_new_tokens=2, mesh=mesh)


def test_each_device_runs_the_cpu_kernels_on_its_own_pieces():
    """Prepared (kernel-layout) weights split over the model axis enter the shard_map as each
    device's laid-out piece: the compiled step calls the CPU kernels and gathers nothing."""
    from lowbit import kernels
    from lowbit.ops import is_prepared

    if not kernels.available():
        pytest.skip("CPU kernels not built")
    config = dataclasses.replace(CONFIG, dim=512, n_layers=1, head_dim=64, ffn_dim=1024)
    model = Decoder(config, rngs=nnx.Rngs(0))
    params = quantize_params(nnx.state(model, nnx.Param), "int4w_g32_asym", kernel_layouts=True)
    assert is_prepared(params["layers"][0]["attn"]["q_proj"]["kernel"].get_value())
    params, plan = shard_for_generation(params, _mesh((1, 2), False), config)
    cache = plan.place_cache(model.init_cache(4, 64, "int8"))
    tokens = jax.device_put(jnp.ones((4, 1), jnp.int32), plan.rows(2))
    sharded = _Sharded(type(model), config, model.dtype, plan)
    step = jax.jit(interpret(functools.partial(_forward, sharded)))
    text = step.lower(params, tokens, cache).compile().as_text()
    targets = set(re.findall(r'custom_call_target="([^"]+)"', text))
    assert {"lowbit_wo_linear", "lowbit_decode_attention"} <= targets
    assert len(re.findall(r"\ball-gather(?:-start)?\(", text)) == 0


# Wide enough that each device's piece of gate/up/down (256 x 256) is run by a CPU kernel.
WIDE = dataclasses.replace(CONFIG, dim=256, head_dim=32, ffn_dim=512)


@pytest.mark.skipif(
    not kernels.available() or jax.default_backend() != "cpu", reason=kernels.status()
)
@pytest.mark.parametrize("shape", [(1, 2), (2, 1)], ids=["tp2", "dp2"])
def test_split_weights_run_as_laid_out_pieces_and_whole_ones_keep_their_layout(shape):
    """`lowbit.quantize`'s CPU layouts: a weight split over the model axis has each device's
    piece laid out once (no layout built inside the call, no fallback), one left whole keeps
    its layout; the tokens are one device's and the pieces join back into the codes."""
    wide = Decoder(WIDE, rngs=nnx.Rngs(0))
    params = lowbit.quantize(nnx.state(wide, nnx.Param), "int4w_g32_asym")
    expected = generate_tokens(wide, PROMPTS, params=params, max_new_tokens=8).tokens
    placed, plan = shard_for_generation(params, _mesh(shape, explicit=False), WIDE)
    leaf = lambda name: placed["layers"][0]["mlp"][name]["kernel"].get_value()
    if plan.tp == 2:
        for name, axis in (("gate_proj", 1), ("down_proj", 0)):
            pieces = leaf(name)
            assert isinstance(pieces, PreparedPieces) and (pieces.count, pieces.axis) == (2, axis)
            assert pieces.pieces.weight.data.sharding.spec == P("model")
            logical = logical_weights(params)["layers"][0]["mlp"][name]["kernel"].get_value()
            np.testing.assert_array_equal(pieces.logical().codes, logical.codes)
            np.testing.assert_array_equal(pieces.logical().zero_point, logical.zero_point)
    else:
        assert isinstance(leaf("down_proj"), PreparedQArray)
    cache = plan.init_cache(wide, len(PROMPTS), 64, None)
    graphdef = _Sharded(type(wide), WIDE, wide.dtype, plan)
    tokens = jax.device_put(jnp.ones((len(PROMPTS), 1), jnp.int32), plan.rows(2))
    report = trace_report(functools.partial(_forward, graphdef), placed, tokens, cache)
    assert not report.fallbacks, report
    # Kernels run every weight of 64K+ elements on a device: gate/up/down pieces at TP=2,
    # q/o (256 x 256) too when whole.
    kernel_weights = 3 if plan.tp == 2 else 5
    assert report.quantized_ops["dot_general:cpu_kernel_uint4"] == kernel_weights * WIDE.n_layers
    out = generate_tokens(wide, PROMPTS, params=placed, max_new_tokens=8, mesh=plan)
    assert out.tokens == expected
