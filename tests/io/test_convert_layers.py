"""GPTQ while streaming: `convert_checkpoint(..., model=, calibration=)` quantizes a decoder from
its file one layer at a time, and gives what GPTQ on the loaded model gives, up to the
statistics of layers past the first (captured behind quantized layers instead of float ones)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_gguf_architectures import CONFIGS as ARCHITECTURES

import lowbit
from lowbit.io import convert_checkpoint, export_gguf, import_gguf, load_checkpoint
from lowbit.models import Decoder, DecoderConfig, decoder_from_params, gguf_param_map
from lowbit.qarray import is_qarray

RECIPE = "int4w_g32_asym_gptq"
BASE = dict(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128)
# Three of the GGUF architecture tests' configs: a plain decoder, Gemma 2 (sliding window,
# post-norms, soft caps, tied head) and Qwen2-MoE (experts through ragged_dot).
CONFIGS = {name: ARCHITECTURES[name] for name in ("llama", "gemma2", "qwen2moe")}


def _source(name, tmp_path):
    """A float GGUF file of a random `name` decoder, and its params as read back."""
    config = DecoderConfig(**BASE, **CONFIGS[name])
    model = Decoder(config, rngs=nnx.Rngs(0))
    path = tmp_path / f"{name}.gguf"
    export_gguf(nnx.to_pure_dict(nnx.split(model)[1]), path, config=config, log=None)
    params, _ = import_gguf(path, name_map=gguf_param_map(config).get, quantized=False)
    return config, path, jax.tree.map(jnp.asarray, params)


def _batches(config, seed, count=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, config.vocab_size, (4, 16)).astype(np.int32) for _ in range(count)]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gptq_layer_by_layer_agrees_with_gptq_on_the_loaded_model(name, tmp_path):
    config, path, params = _source(name, tmp_path)
    batches = _batches(config, 1)
    report = convert_checkpoint(
        path,
        tmp_path / "out",
        RECIPE,
        name_map=gguf_param_map(config),
        model=config,
        calibration=batches,
    )
    streamed = load_checkpoint(tmp_path / "out")

    def forward(p, tokens):
        return decoder_from_params(config, p)(tokens)

    loaded = lowbit.quantize(
        params, RECIPE, fn=forward, calibration=[(b,) for b in batches], kernel_layouts=False
    )
    # The same tree: every weight the recipe quantizes is quantized, in the same format.
    assert jax.tree.structure(streamed, is_leaf=is_qarray) == jax.tree.structure(
        loaded, is_leaf=is_qarray
    )
    pairs = list(
        zip(
            jax.tree.leaves(streamed, is_leaf=is_qarray),
            jax.tree.leaves(loaded, is_leaf=is_qarray),
            strict=True,
        )
    )
    assert report.quantized == sum(is_qarray(a) for a, _ in pairs) > 0
    for a, b in pairs:
        assert is_qarray(a) == is_qarray(b)
        if is_qarray(a):
            assert (a.format, a.shape) == (b.format, b.shape)
    # The first layer's inputs are the float embeddings either way: the same statistics, so
    # the same GPTQ codes (up to the float rounding of two differently compiled programs).
    for proj in ("q_proj", "o_proj"):
        a, b = (t["layers"][0]["attn"][proj]["kernel"].codes for t in (streamed, loaded))
        assert np.mean(np.asarray(a) == np.asarray(b)) > 0.99
    # Later layers see quantized inputs: the model's error stays that of GPTQ on the whole.
    tokens = jnp.asarray(_batches(config, 2, 1)[0])
    reference = forward(params, tokens)
    run = jax.jit(lowbit.run(forward))

    def error(q):
        return float(jnp.linalg.norm(run(q, tokens) - reference) / jnp.linalg.norm(reference))

    assert error(streamed) < 1.25 * error(loaded) + 1e-4


def test_layer_by_layer_needs_the_config_calibration_and_tokens(tmp_path):
    config, path, _ = _source("llama", tmp_path)
    mapping = gguf_param_map(config)
    with pytest.raises(ValueError, match="runs on calibration data.*layer by layer"):
        convert_checkpoint(path, tmp_path / "out", RECIPE, name_map=mapping)
    with pytest.raises(ValueError, match=r"needs the decoder's config \(model=\)"):
        convert_checkpoint(path, tmp_path / "out", RECIPE, name_map=mapping, model=config)
    bad = [np.full((2, 8), config.vocab_size, np.int32)]
    with pytest.raises(ValueError, match=r"calibration\[0\] holds token ids outside"):
        convert_checkpoint(
            path, tmp_path / "out", RECIPE, name_map=mapping, model=config, calibration=bad
        )
    with pytest.raises(ValueError, match=r"calibration\[0\] must be token ids"):
        convert_checkpoint(
            path,
            tmp_path / "out",
            RECIPE,
            name_map=mapping,
            model=config,
            calibration=[np.zeros((8,), np.float32)],
        )
    assert not (tmp_path / "out").exists()
