"""QAT on GGUF grids through `lowbit.qat`: learned block scales, and `convert` packs exactly
the trained grid (the served forward equals the QAT forward bit for bit)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.api import convert, qat, run
from lowbit.gguf import decode
from lowbit.qarray import QArray, QuantConfig
from lowbit.recipes import Recipe, Rule


def model(params, x):
    return jnp.tanh(x @ params["up"]["kernel"]) @ params["down"]["kernel"]


def _setup(fmt):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {
        "up": {"kernel": 0.05 * jax.random.normal(k1, (512, 256))},
        "down": {"kernel": 0.05 * jax.random.normal(k2, (256, 8))},
    }
    x = jax.random.normal(k3, (4, 512))
    recipe = Recipe(rules=(Rule(path=r".*kernel", weight=QuantConfig(format=fmt)),))
    return params, x, recipe


@pytest.mark.parametrize("fmt", ["q4_k", "iq4_nl"])
def test_trained_grid_converts_exactly(fmt):
    params, x, recipe = _setup(fmt)
    grids = qat.grid_init(params, recipe)
    assert set(grids) == {"up/kernel", "down/kernel"}
    wrap = qat.wrapper(recipe)
    forward = run(model)

    # Step 0 is llama.cpp's PTQ.
    ptq = forward(convert(params, recipe), x)
    np.testing.assert_array_equal(np.asarray(forward(wrap(params, grids), x)), np.asarray(ptq))

    def loss(params, grids):
        return jnp.sum(forward(wrap(params, grids), x) ** 2)

    g_params, g_grids = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, grids)
    for leaf in jax.tree.leaves((g_params, g_grids)):
        assert np.isfinite(np.asarray(leaf)).all()
    assert float(jnp.abs(g_grids["up/kernel"]["d"]).max()) > 0
    assert float(jnp.abs(g_params["up"]["kernel"]).max()) > 0

    # A step that moves the grid: the served params are that grid, byte for byte.
    params = jax.tree.map(lambda p, g: p - 0.5 * g, params, g_params)
    grids = jax.tree.map(lambda p, g: p - 1e-4 * jnp.sign(g) * jnp.abs(p), grids, g_grids)
    served = convert(params, recipe, grids=grids)
    trained = forward(wrap(params, grids), x)
    np.testing.assert_array_equal(np.asarray(forward(served, x)), np.asarray(trained))
    assert not np.array_equal(np.asarray(trained), np.asarray(forward(convert(params, recipe), x)))
    q = served["up"]["kernel"]
    assert isinstance(q, QArray) and q.format == fmt
    rows = np.moveaxis(np.asarray(q.codes), q.packed_axis, -1)
    values = np.moveaxis(decode(fmt.upper(), rows), -1, q.packed_axis)
    np.testing.assert_array_equal(np.asarray(q.dequantize()), values)


def test_grids_must_name_grid_weights():
    params, x, recipe = _setup("q4_k")
    with pytest.raises(ValueError, match="does not quantize"):
        qat.wrapper(recipe)(params, {"missing": {}})
    int8 = Recipe(rules=(Rule(path=r".*kernel", weight=QuantConfig(format="int8")),))
    assert qat.grid_init(params, int8) == {}


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_0", "Q4_1"])
def test_ggml_32_blocks_held_as_element_formats_train_on_their_grid(ggml_type):
    from lowbit.qarray import gguf_fake_quant
    from lowbit.recipes import parse_candidate

    params, x, _ = _setup("q4_k")
    config = parse_candidate(ggml_type.lower()).config("up/kernel", 2)
    recipe = Recipe(rules=(Rule(path=r".*kernel", weight=config),))
    grids = qat.grid_init(params, recipe)
    assert set(grids) == {"up/kernel", "down/kernel"}
    wrap = qat.wrapper(recipe)
    forward = run(model)

    def loss(params, grids):
        return jnp.sum(forward(wrap(params, grids), x) ** 2)

    g_params, g_grids = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, grids)
    assert float(jnp.abs(g_grids["up/kernel"]["d"]).max()) > 0
    grids = jax.tree.map(lambda p, g: p - 1e-3 * jnp.sign(g) * jnp.abs(p), grids, g_grids)
    served = convert(params, recipe, grids=grids)
    np.testing.assert_array_equal(
        np.asarray(forward(served, x)), np.asarray(forward(wrap(params, grids), x))
    )
    q = served["up"]["kernel"]
    assert isinstance(q, QArray) and q.format == config.format
    # The element QArray holds the trained blocks: its values are the fake-quantized weight
    # (Q4_1's zero point -m / d costs a float32 rounding).
    want = gguf_fake_quant(params["up"]["kernel"].T, grids["up/kernel"], ggml_type).T
    tolerance = 1e-6 if ggml_type == "Q4_1" else 0
    np.testing.assert_allclose(np.asarray(q.dequantize()), np.asarray(want), atol=tolerance)
