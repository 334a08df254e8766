"""`qat_gguf`: block-by-block then end-to-end QAT on K-quant grids lowers the divergence from
the float model, and the served params are exactly the trained grid."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowbit.eval import QatGGUFSettings, calibration_windows, gguf_recipe, qat_gguf
from lowbit.models import Decoder, DecoderConfig
from lowbit.qarray import QArray, gguf_fake_quant

TYPES = {"layers/0/mlp/down_proj/kernel": "Q3_K", "layers/0/attn/q_proj/kernel": "Q2_K"}


def test_k_quant_qat_lowers_the_divergence_and_serves_the_trained_grid():
    config = DecoderConfig(
        vocab_size=64, dim=256, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=256
    )
    model = Decoder(config, rngs=nnx.Rngs(0))
    tokens = np.array([(i * 7 + i // 5) % 64 for i in range(200)])
    settings = QatGGUFSettings(
        windows=8, seq_len=16, batch=4, block_steps=12, e2e_steps=6, weight_lr=1e-2,
        grid_lr=1e-2, norm_lr=1e-2,
    )  # fmt: skip
    result = qat_gguf(model, tokens, "Q2_K", settings, types=TYPES)
    (block,) = result.block_losses
    assert np.mean(block[-3:]) < np.mean(block[:3])
    assert result.kl_after < result.kl_before
    served = result.served()
    for path, ggml_type in TYPES.items():
        keys = path.split("/")
        q = served["layers"][0][keys[2]][keys[3]]["kernel"]
        assert isinstance(q, QArray) and q.format == ggml_type.lower()
        trained = result.params["layers"][0][keys[2]][keys[3]]["kernel"]
        want = gguf_fake_quant(jnp.asarray(trained).T, result.grids[path], ggml_type).T
        np.testing.assert_array_equal(np.asarray(q.dequantize()), np.asarray(want))
    # Weights the types leave out stay float.
    assert not isinstance(served["layers"][0]["mlp"]["up_proj"]["kernel"], QArray)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(result.grids))


def test_recipe_and_windows():
    params = {"layers": {0: {"attn": {"q_proj": {"kernel": np.zeros((256, 8))}}}}}
    recipe = gguf_recipe({"layers/0/attn/q_proj/kernel": "Q4_0"}, params)
    (rule,) = recipe.rules
    assert rule.weight.format == "int4" and rule.weight.granularity.size == 32
    settings = QatGGUFSettings(windows=3, seq_len=4, batch=2)
    np.testing.assert_array_equal(
        calibration_windows(np.arange(13), settings), np.arange(12).reshape(3, 4)
    )
    with pytest.raises(ValueError, match="has 11 tokens; the calibration needs 12"):
        calibration_windows(np.arange(11), settings)
    with pytest.raises(ValueError, match="batch=4 is more than windows=3"):
        QatGGUFSettings(windows=3, batch=4)
