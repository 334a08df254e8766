"""`load_decoder_hf` against transformers' own logits, and its errors on bad checkpoints.

The tiny checkpoints and the logits come from ``references/make_hf_references.py`` (run once
with transformers; not needed here).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from lowbit import models
from lowbit.models import ParamMapping, decoder_config_from_hf, hf_param_map, load_decoder_hf

REFERENCES = Path(__file__).parent / "references"
HF = REFERENCES / "hf"
LOGITS = np.load(REFERENCES / "hf_logits.npz")
TYPES = sorted(name for name in LOGITS.files if name != "prompt")


def _config(name: str) -> dict:
    return json.loads((HF / name / "config.json").read_text())


def _copy(tmp_path: Path, name: str) -> Path:
    target = tmp_path / name
    shutil.copytree(HF / name, target)
    return target


def _edit_config(directory: Path, **fields) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(fields)
    (directory / "config.json").write_text(json.dumps(config))


def test_every_model_type_has_a_reference():
    assert set(TYPES) == set(models.HF_MODEL_TYPES) - {"gemma3"}


@pytest.mark.parametrize("name", TYPES)
def test_logits_match_transformers(name):
    model, tokenizer = load_decoder_hf(HF / name)
    assert model.config.architecture == name
    logits = np.asarray(model(jnp.asarray(LOGITS["prompt"][None])))[0]
    want = LOGITS[name]
    cosine = float(np.sum(logits * want) / np.linalg.norm(logits) / np.linalg.norm(want))
    assert cosine >= 0.9999
    np.testing.assert_allclose(logits, want, atol=1e-4)
    assert tokenizer.encode("t5 t7").ids == [5, 7]


def test_the_references_exercise_what_they_claim():
    # A sharded checkpoint, a bfloat16 one, fused and per-expert experts, windows shorter
    # than the prompt, Llama 3 frequency factors, and Gemma 3's two RoPE bases.
    assert (HF / "llama" / "model.safetensors.index.json").is_file()
    assert _config("qwen3")["dtype"] == "bfloat16"
    llama = decoder_config_from_hf(_config("llama"))
    assert llama.rope_freq_factors is not None and len(set(llama.rope_freq_factors)) > 2
    assert decoder_config_from_hf(_config("mistral")).sliding_window < len(LOGITS["prompt"])
    gemma3 = decoder_config_from_hf(_config("gemma3_text"))
    assert (gemma3.global_every, gemma3.rope_base_local, gemma3.rope_scale) == (3, 1e4, 4.0)
    gemma2 = decoder_config_from_hf(_config("gemma2"))
    assert (gemma2.global_every, gemma2.attn_softcap, gemma2.final_softcap) == (2, 5.0, 3.0)
    assert math.isclose(gemma2.query_scale, 24**-0.5)
    qwen2_moe = decoder_config_from_hf(_config("qwen2_moe"))
    assert (qwen2_moe.shared_ffn_dim, qwen2_moe.norm_topk) == (64, False)


def test_experts_are_stacked_from_per_expert_tensors():
    config = decoder_config_from_hf(_config("mixtral"))
    mapping = hf_param_map(config)
    assert mapping["model.layers.1.block_sparse_moe.experts.2.w3.weight"] == ParamMapping(
        ("layers", 1, "moe", "up_proj", "kernel"), transpose=True, expert=2
    )
    fused = hf_param_map(config, fused_experts=True)
    gate, up = fused["model.layers.1.mlp.experts.gate_up_proj"]
    assert (gate.part, up.part) == ((0, 2), (1, 2))
    assert up.path == ("layers", 1, "moe", "up_proj", "kernel")


def test_gemma_norms_get_one_added():
    mapping = hf_param_map(decoder_config_from_hf(_config("gemma")))
    assert mapping["model.layers.0.input_layernorm.weight"].offset == 1.0
    assert mapping["model.embed_tokens.weight"].offset == 0.0


def test_gemma3_multimodal_config_nests_the_text_model():
    text = _config("gemma3_text")
    nested = {"model_type": "gemma3", "text_config": {**text, "model_type": "gemma3_text"}}
    assert decoder_config_from_hf(nested) == decoder_config_from_hf(text)


def test_transformers_4_rope_fields_read_like_5():
    config = _config("gemma3_text")
    del config["rope_parameters"]
    old = dict(
        rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 4}
    )
    assert decoder_config_from_hf({**config, **old}) == decoder_config_from_hf(
        _config("gemma3_text")
    )
    llama = _config("llama")
    rope = llama.pop("rope_parameters")
    theta = rope.pop("rope_theta")
    old_llama = {**llama, "rope_theta": theta, "rope_scaling": rope}
    assert decoder_config_from_hf(old_llama) == decoder_config_from_hf(_config("llama"))


def test_tokenizer_is_optional_only_when_asked(tmp_path):
    directory = _copy(tmp_path, "qwen2")
    (directory / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json.*tokenizer=False"):
        load_decoder_hf(directory)
    model, tokenizer = load_decoder_hf(directory, tokenizer=False)
    assert tokenizer is None and model.config.vocab_size == 256


def test_dtype_sets_the_parameters_dtype():
    model, _ = load_decoder_hf(HF / "qwen3", dtype=jnp.bfloat16, tokenizer=False)
    assert model.layers[0].attn.q_proj.kernel.dtype == jnp.bfloat16
    model, _ = load_decoder_hf(HF / "mixtral", dtype=jnp.bfloat16, tokenizer=False)
    stacked = model.layers[1].moe.down_proj.kernel
    assert stacked.dtype == jnp.bfloat16 and stacked.shape == (4, 24, 64)
    logits = np.asarray(model(jnp.asarray(LOGITS["prompt"][None])), np.float32)[0]
    want = LOGITS["mixtral"]
    assert np.sum(logits * want) / np.linalg.norm(logits) / np.linalg.norm(want) > 0.99


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"model_type": "gpt2"}, r"'model_type' is 'gpt2'; supported: llama, mistral"),
        ({"num_attention_heads": 0}, r"'num_attention_heads' is 0"),
        ({"rms_norm_eps": -1.0}, r"'rms_norm_eps' is -1.0"),
        ({"hidden_size": 64.5}, r"'hidden_size' is 64.5; expected an integer"),
        ({"hidden_act": "relu"}, r"'hidden_act' is 'relu'; supported"),
        ({"attention_bias": True}, r"'attention_bias' is true"),
        ({"tie_word_embeddings": "yes"}, r"'tie_word_embeddings' is 'yes'"),
        ({"use_bidirectional_attention": True}, r"'use_bidirectional_attention' is true"),
        ({"num_key_value_heads": 3}, r"n_heads=4 is not a multiple of n_kv_heads=3"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
            r"'rope_parameters' has rope_type 'yarn'",
        ),
    ],
)
def test_bad_config_fields_name_the_file_and_field(fields, match):
    with pytest.raises(ValueError, match=match) as err:
        decoder_config_from_hf({**_config("llama"), **fields}, "some/config.json")
    assert "some/config.json" in str(err.value)


def test_phi3_partial_rotary_and_longrope_are_refused():
    phi3 = _config("phi3")
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        decoder_config_from_hf({**phi3, "partial_rotary_factor": 0.5, "rope_parameters": None})
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    with pytest.raises(ValueError, match="rope_type 'longrope'"):
        decoder_config_from_hf({**phi3, "rope_parameters": None, "rope_scaling": longrope})


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"mlp_only_layers": [1]}, "'mlp_only_layers'"),
        ({"decoder_sparse_step": 2}, "'decoder_sparse_step'"),
    ],
)
def test_moe_with_dense_layers_is_refused(fields, match):
    with pytest.raises(ValueError, match=match):
        decoder_config_from_hf({**_config("qwen2_moe"), **fields})


def test_a_layer_pattern_the_decoder_lacks_is_refused():
    qwen = {**_config("qwen2"), "use_sliding_window": True, "sliding_window": 8}
    del qwen["layer_types"]
    with pytest.raises(ValueError, match="'max_window_layers' makes layers"):
        decoder_config_from_hf({**qwen, "max_window_layers": 1})
    assert decoder_config_from_hf({**qwen, "max_window_layers": 0}).sliding_window == 8
    config = {**_config("gemma2"), "layer_types": ["full_attention", "sliding_attention"]}
    with pytest.raises(ValueError, match=r"'layer_types' makes layers \['full', 'sliding'\]"):
        decoder_config_from_hf(config)
    with pytest.raises(ValueError, match="'layer_types' is"):
        decoder_config_from_hf({**config, "layer_types": ["sliding_attention"]})


def test_truncated_shard_is_named(tmp_path):
    directory = _copy(tmp_path, "llama")
    shard = directory / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match="model-00002-of-00003.safetensors: not a readable"):
        load_decoder_hf(directory)


def test_a_layer_count_the_weights_cannot_hold_is_refused_before_building(tmp_path):
    # Per-layer lists and maps follow num_hidden_layers: 10**9 would take gigabytes.
    directory = _copy(tmp_path, "llama")
    _edit_config(directory, num_hidden_layers=10**9)
    with pytest.raises(ValueError, match=r"config.json: field 'num_hidden_layers' is 1000000000"):
        load_decoder_hf(directory)


def test_missing_shard_is_named(tmp_path):
    directory = _copy(tmp_path, "llama")
    (directory / "model-00003-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="shard 'model-00003-of-00003.safetensors'"):
        load_decoder_hf(directory)


def _edit_index(directory: Path, edit) -> None:
    path = directory / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    edit(index["weight_map"])
    path.write_text(json.dumps(index))


def test_index_naming_a_tensor_its_shard_lacks_is_refused(tmp_path):
    directory = _copy(tmp_path, "llama")
    name = "model.layers.0.mlp.gate_proj.weight"
    shard = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"][name]
    other = next(p.name for p in directory.glob("model-*.safetensors") if p.name != shard)
    _edit_index(directory, lambda m: m.update({name: other}))
    with pytest.raises(ValueError, match=f"{name!r} is listed in shard {other!r}"):
        load_decoder_hf(directory)


def test_a_missing_tensor_is_named(tmp_path):
    directory = _copy(tmp_path, "llama")
    _edit_index(directory, lambda m: m.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(
        ValueError,
        match=r"index.json: checkpoint has no tensor named 'model.layers.1.self_attn.k_proj",
    ):
        load_decoder_hf(directory)


def test_a_missing_expert_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    directory = _copy(tmp_path, "mixtral")
    arrays = load_file(directory / "model.safetensors")
    del arrays["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
    save_file(arrays, directory / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors: .*experts.3.w2.weight"):
        load_decoder_hf(directory)


def test_a_tensor_the_model_does_not_use_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    directory = _copy(tmp_path, "qwen2")
    arrays = load_file(directory / "model.safetensors")
    arrays["model.layers.0.mlp.extra.weight"] = np.zeros((2, 2), np.float32)
    save_file(arrays, directory / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.layers.0.mlp.extra"):
        load_decoder_hf(directory)


def test_tied_embeddings_have_no_lm_head(tmp_path):
    from safetensors.numpy import load_file, save_file

    directory = _copy(tmp_path, "qwen2")
    _edit_config(directory, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="no tensor named 'lm_head.weight'"):
        load_decoder_hf(directory)
    _edit_config(directory, tie_word_embeddings=True)
    arrays = load_file(directory / "model.safetensors")
    arrays["lm_head.weight"] = arrays["model.embed_tokens.weight"]
    save_file(arrays, directory / "model.safetensors")
    with pytest.raises(ValueError, match="tensor 'lm_head.weight' is not used"):
        load_decoder_hf(directory)


def test_a_shape_that_disagrees_with_the_config_is_named(tmp_path):
    directory = _copy(tmp_path, "qwen2")
    _edit_config(directory, intermediate_size=96)
    with pytest.raises(
        ValueError,
        match=r"model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has shape",
    ):
        load_decoder_hf(directory)


def test_a_directory_without_weights_is_named(tmp_path):
    directory = _copy(tmp_path, "qwen2")
    (directory / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors and no"):
        load_decoder_hf(directory)


def test_unknown_model_type_in_a_directory_is_named(tmp_path):
    directory = _copy(tmp_path, "qwen2")
    _edit_config(directory, model_type="falcon")
    with pytest.raises(ValueError, match=r"config.json: field 'model_type' is 'falcon'"):
        load_decoder_hf(directory)


@pytest.mark.parametrize("language", ["model.language_model.", "language_model.model."])
def test_gemma3_multimodal_checkpoint_loads_its_language_model(tmp_path, language):
    # transformers 5 (then 4) names; the vision tower is left out.
    from safetensors.numpy import load_file, save_file

    directory = _copy(tmp_path, "gemma3_text")
    arrays = load_file(directory / "model.safetensors")
    renamed = {language + k.removeprefix("model."): v for k, v in arrays.items()}
    renamed["model.vision_tower.patch.weight"] = np.zeros((2, 2), np.float32)
    renamed["multi_modal_projector.norm.weight"] = np.zeros((2,), np.float32)
    save_file(renamed, directory / "model.safetensors")
    text = _config("gemma3_text")
    nested = {"model_type": "gemma3", "text_config": text, "vision_config": {}}
    (directory / "config.json").write_text(json.dumps(nested))
    model, _ = load_decoder_hf(directory, tokenizer=False)
    logits = np.asarray(model(jnp.asarray(LOGITS["prompt"][None])))[0]
    np.testing.assert_allclose(logits, LOGITS["gemma3_text"], atol=1e-4)


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("mistral", {"sliding_window": None}),
        ("gemma2", {"layer_types": ["full_attention"] * 2}),
        ("qwen2_moe", {"norm_topk_prob": True}),
        ("gemma2", {"attn_logit_softcapping": None}),
    ],
)
def test_the_references_depend_on_each_feature(tmp_path, name, fields):
    directory = _copy(tmp_path, name)
    _edit_config(directory, **fields)
    model, _ = load_decoder_hf(directory, tokenizer=False)
    logits = np.asarray(model(jnp.asarray(LOGITS["prompt"][None])))[0]
    assert np.abs(logits - LOGITS[name]).max() > 1e-3


def test_fields_left_out_take_transformers_defaults():
    # Gemma 3's multimodal configs keep only what differs from Gemma3TextConfig's defaults.
    sparse = {
        "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "num_hidden_layers": 34, "sliding_window": 1024},
    }
    c = decoder_config_from_hf(sparse)
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size) == (8, 4, 256, 262208)
    assert (c.rope_base, c.rope_base_local, c.global_every) == (1e6, 1e4, 6)
    assert c.query_scale == 256**-0.5 and c.sliding_window == 1024
    # An explicit null is kept: Mistral v0.2 has no window although the class default has.
    assert (
        decoder_config_from_hf({**_config("mistral"), "sliding_window": None}).sliding_window
        is None
    )


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_cached_decoding_matches_transformers(name):
    # Prefill 10 tokens, then decode one at a time through the sliding window (Gemma 2's soft
    # capped scores take the block loop; Mistral's the fused decode kernel where built).
    from flax import nnx

    model, _ = load_decoder_hf(HF / name, tokenizer=False)
    prompt = jnp.asarray(LOGITS["prompt"][None])
    logits, cache = model(prompt[:, :10], cache=model.init_cache(1, 64))
    steps = [np.asarray(logits)[0]]
    decode = nnx.jit(lambda m, tokens, cache: m.decode_step(tokens, cache))
    for i in range(10, prompt.shape[1]):
        logits, cache = decode(model, prompt[:, i : i + 1], cache)
        steps.append(np.asarray(logits)[0])
    np.testing.assert_allclose(np.concatenate(steps), LOGITS[name], atol=1e-4)
