"""Offline rotations of a decoder's float params compute the same logits, per architecture;
what the fold cannot prove exact is reported (or raises in strict mode)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowbit.models import (
    Decoder,
    DecoderConfig,
    RotationError,
    decoder_from_params,
    rotate_decoder,
)
from lowbit.recipes import RotationConfig

BASE = dict(vocab_size=64, dim=24, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48)
VARIANTS = {
    "llama": dict(),
    "qwen2": dict(qkv_bias=True, tie_embeddings=False),
    "gemma": dict(activation="gelu_tanh", embed_scale=True, final_softcap=3.0),
    "gemma2": dict(activation="gelu_tanh", embed_scale=True, post_norms=True, attn_softcap=5.0),
    "phi3": dict(fused_qkv=True, fused_gate_up=True, qkv_bias=True),
    "qwen2moe": dict(n_experts=4, n_experts_used=2, expert_ffn_dim=16, shared_ffn_dim=8),
}
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 7)), jnp.int32)


def _model(name: str) -> tuple[DecoderConfig, dict]:
    config = DecoderConfig(**BASE, **VARIANTS[name])
    params = nnx.to_pure_dict(nnx.split(Decoder(config, rngs=nnx.Rngs(0)))[1])
    rng = np.random.default_rng(1)

    def jitter(path, x):  # norm scales far from 1, so that every fold matters
        if "scale" in jax.tree_util.keystr(path):
            return x * jnp.asarray(1 + 0.5 * rng.standard_normal(x.shape), x.dtype)
        return x

    return config, jax.tree_util.tree_map_with_path(jitter, params)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_rotated_model_gives_the_same_logits(name):
    config, params = _model(name)
    reference = decoder_from_params(config, params)(TOKENS)
    new_config, new_params, report = rotate_decoder(config, params)
    got = decoder_from_params(new_config, new_params)(TOKENS)
    np.testing.assert_allclose(np.asarray(got), np.asarray(reference), atol=1e-4)
    assert "heads" in report.rotated
    if name == "gemma2":
        # Per-channel post-norms: the residual rotation is refused and the layers named.
        assert "residual" not in report.rotated
        assert "layers/0/post_attn_norm/scale" in report.skipped
        return
    assert "residual" in report.rotated and not report.skipped
    assert new_config.tie_embeddings is False and "lm_head" in new_params
    assert report.untied == config.tie_embeddings
    # Every norm folded: the rotated model's norms are all ones.
    np.testing.assert_array_equal(np.asarray(new_params["norm"]["scale"]), 1.0)
    # The stream is rotated: the embedding rows are no longer those of the input.
    assert not np.allclose(new_params["embed"]["embedding"], params["embed"]["embedding"])


def test_uniform_post_norms_commute_with_the_rotation():
    config, params = _model("gemma2")
    for layer in params["layers"].values():
        for name in ("post_attn_norm", "post_mlp_norm"):
            layer[name]["scale"] = jnp.full_like(layer[name]["scale"], 1.5)
    reference = decoder_from_params(config, params)(TOKENS)
    new_config, new_params, report = rotate_decoder(config, params)
    assert "residual" in report.rotated
    got = decoder_from_params(new_config, new_params)(TOKENS)
    np.testing.assert_allclose(np.asarray(got), np.asarray(reference), atol=1e-4)


def test_strict_rotation_names_the_layer():
    config, params = _model("gemma2")
    with pytest.raises(RotationError, match="layers/0/post_attn_norm/scale.*post-norms"):
        rotate_decoder(config, params, RotationConfig(strict=True))


def test_heads_only_keeps_the_tied_embedding():
    config, params = _model("llama")
    new_config, new_params, report = rotate_decoder(config, params, RotationConfig(residual=False))
    assert report.rotated == ("heads",) and new_config.tie_embeddings
    assert "lm_head" not in new_params
    np.testing.assert_array_equal(new_params["embed"]["embedding"], params["embed"]["embedding"])


def test_rotation_is_seeded():
    config, params = _model("llama")
    a = rotate_decoder(config, params, RotationConfig(seed=0))[1]["embed"]["embedding"]
    b = rotate_decoder(config, params, RotationConfig(seed=0))[1]["embed"]["embedding"]
    c = rotate_decoder(config, params, RotationConfig(seed=1))[1]["embed"]["embedding"]
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    assert dataclasses.replace(config) == config  # the input config is untouched
