"""A rotating recipe on a loaded decoder: the rotated model, online-rotated down projections
served as `HadamardInput`, calibration statistics rotated to match, and checkpoints that read
back rotated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowbit import serving
from lowbit.api import run
from lowbit.io import save_checkpoint
from lowbit.models._decoder import LayerView
from lowbit.ops import HadamardInput
from lowbit.qarray import QArray
from lowbit.recipes import Recipe, Rule, preset

TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 6)), jnp.int32)


@pytest.fixture(scope="module")
def tiny():
    from lm_support import tiny_lm

    return tiny_lm(dim=64, ffn_dim=96)


def _recipe(rotate="hadamard"):
    base = preset("int8w")
    return Recipe(rules=base.rules, name="int8w_rot", rotate=rotate)


def _logits(loaded, params):
    graphdef = nnx.split(loaded.model)[0]
    return run(lambda p, t: nnx.merge(graphdef, p)(t))(params, TOKENS)


def test_recipe_needs_the_rotated_model(tiny, tmp_path):
    path = tmp_path / "rot.json"
    path.write_text(_recipe().to_json())
    with pytest.raises(ValueError, match="rotated_model"):
        serving.apply_recipe(tiny, nnx.state(tiny.model), str(path))


def test_rotated_recipe_serves_down_proj_with_an_online_rotation(tiny, tmp_path):
    path = tmp_path / "rot.json"
    path.write_text(_recipe().to_json())
    rotated = serving.rotated_for_spec(tiny, str(path))
    assert rotated.rotation is not None and not rotated.model.config.tie_embeddings
    params, recipe = serving.apply_recipe(rotated, nnx.state(rotated.model), str(path))
    down = params["layers"][0]["mlp"]["down_proj"]["kernel"]
    assert isinstance(down, HadamardInput)
    reference = tiny.model(TOKENS)
    got = _logits(rotated, params)
    err = float(jnp.max(jnp.abs(got - reference)) / jnp.max(jnp.abs(reference)))
    assert err < 0.05, err
    # The checkpoint stores H^T W as a plain QArray; reading it back wraps it again.
    storable = serving.storable(params)
    assert not isinstance(storable["layers"][0]["mlp"]["down_proj"]["kernel"], HadamardInput)
    save_checkpoint(tmp_path / "ckpt", storable, recipe=recipe)
    with pytest.raises(ValueError, match="holds a rotated model"):
        serving.read_checkpoint(tmp_path / "ckpt", tiny)
    again = serving.rotated_model(tiny, serving.checkpoint_recipe(tmp_path / "ckpt"))
    back = serving.read_checkpoint(tmp_path / "ckpt", again)
    assert isinstance(back["layers"][0]["mlp"]["down_proj"]["kernel"], HadamardInput)
    np.testing.assert_allclose(np.asarray(_logits(again, back)), np.asarray(got), atol=1e-5)


def test_online_statistics_are_those_of_the_rotated_input(tiny):
    from lowbit.algorithms import capture
    from lowbit.ops import hadamard_transform
    from lowbit.serving._rotation import rotate_statistics

    path = "layers/0/mlp/down_proj/kernel"
    pure = nnx.to_pure_dict(nnx.state(tiny.model))
    graphdef = nnx.split(tiny.model)[0]
    fn = lambda p, t: nnx.merge(graphdef, p)(t)
    stats = capture(fn, pure, [(TOKENS,)], paths=(path,))
    (before,) = stats.for_path(path)
    (after,) = rotate_statistics(stats, (path,)).for_path(path)
    # Gram of x H, from the down projection's input recomputed here.
    layer = tiny.model.layers[0]
    x = tiny.model.embed(TOKENS)
    x = (
        x
        + layer.attn(
            layer.attn_norm(x),
            LayerView(*_rope(tiny, TOKENS), _mask(TOKENS), jnp.zeros((2,), jnp.int32), None),
            None,
        )[0]
    )
    mlp = layer.mlp
    h = jax.nn.silu(mlp.gate_proj(layer.mlp_norm(x))) * mlp.up_proj(layer.mlp_norm(x))
    rows = hadamard_transform(h.reshape(-1, h.shape[-1]))
    np.testing.assert_allclose(
        np.asarray(after.gram),
        np.asarray(rows.T @ rows),
        rtol=2e-3,
        atol=2e-3 * float(jnp.max(jnp.abs(before.gram))),
    )
    assert after.activation_scale is None


def _rope(loaded, tokens):
    return loaded.model._rope(jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape), False)


def _mask(tokens):
    s = tokens.shape[1]
    causal = jnp.arange(s)[None, :] <= jnp.arange(s)[:, None]
    return jnp.broadcast_to(causal, (tokens.shape[0], s, s))


def test_streaming_refuses_a_rotating_recipe():
    from lowbit.io import streaming_problem

    assert "rotates the model" in streaming_problem(_recipe())
    assert isinstance(Rule(path="x"), Rule) and QArray is not None
