"""`qat_gguf`: block-by-block then end-to-end QAT on K-quant grids lowers the divergence from
the float model, and the served params are exactly the trained grid."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowbit.eval import (
    QatGGUFSettings,
    calibration_windows,
    gguf_recipe,
    qat_gguf,
    recipe_types,
)
from lowbit.models import Decoder, DecoderConfig
from lowbit.qarray import QArray, QuantConfig, gguf_fake_quant
from lowbit.recipes import Recipe, Rule

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
    assert result.kl_tokens == 8 * 16  # every window: fewer than KL_TOKENS
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


def test_recipe_types_and_windows():
    params = {
        "layers": {
            0: {
                "attn": {"q_proj": {"kernel": np.zeros((256, 8))}},
                "mlp": {"up_proj": {"kernel": np.zeros((256, 8))}},
            }
        }
    }
    types = {"layers/0/attn/q_proj/kernel": "Q4_0", "layers/0/mlp/up_proj/kernel": "Q5_K"}
    recipe = gguf_recipe(types, params)
    assert {r.weight.format for r in recipe.rules} == {"int4", "q5_k"}
    assert recipe_types(recipe, params) == types  # a plan's types, back
    nf4 = Recipe(rules=(Rule(path=r".*kernel", weight=QuantConfig(format="nf4")),))
    with pytest.raises(ValueError, match="quantizes 'layers/0/attn/q_proj/kernel' to 'nf4'"):
        recipe_types(nf4, params)
    settings = QatGGUFSettings(windows=3, seq_len=4, batch=2)
    np.testing.assert_array_equal(
        calibration_windows(np.arange(13), settings), np.arange(12).reshape(3, 4)
    )
    with pytest.raises(ValueError, match="has 11 tokens; the calibration needs 12"):
        calibration_windows(np.arange(11), settings)
    with pytest.raises(ValueError, match="batch=4 is more than windows=3"):
        QatGGUFSettings(windows=3, batch=4)


@pytest.mark.parametrize("e2e_weights", [False, True])
def test_the_end_to_end_phase_trains_the_weights_only_when_asked(e2e_weights):
    config = DecoderConfig(
        vocab_size=64, dim=64, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=32, ffn_dim=64
    )
    model = Decoder(config, rngs=nnx.Rngs(1))
    tokens = np.array([(i * 5 + i // 3) % 64 for i in range(64)])
    settings = QatGGUFSettings(
        windows=4, seq_len=8, batch=2, block_steps=0, e2e_steps=2, weight_lr=1e-2,
        e2e_weights=e2e_weights,
    )  # fmt: skip
    path = "layers/0/mlp/down_proj/kernel"
    before = np.array(model.layers[0].mlp.down_proj.kernel[...])
    result = qat_gguf(model, tokens, "Q8_0", settings, types={path: "Q8_0"})
    after = np.asarray(result.params["layers"][0]["mlp"]["down_proj"]["kernel"])
    assert np.array_equal(before, after) != e2e_weights
