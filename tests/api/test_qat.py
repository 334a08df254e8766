"""QAT with optax on scikit-learn digits; convert is bit-identical; QLoRA-style gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from api_models import MLP
from flax import nnx
from sklearn.datasets import load_digits

from lowbit.api import convert, qat, quantize_params, run
from lowbit.ops import QatWeight
from lowbit.qarray import QArray
from lowbit.recipes import preset

STEPS, BATCH = 200, 128


def mlp(params, x):
    h = jax.nn.relu(x @ params["hidden"]["kernel"] + params["hidden"]["bias"])
    return h @ params["out"]["kernel"] + params["out"]["bias"]


def init(key, sizes=(64, 128, 10)):
    k1, k2 = jax.random.split(key)
    he = lambda k, n, m: jax.random.normal(k, (n, m)) * jnp.sqrt(2.0 / n)
    return {
        "hidden": {"kernel": he(k1, sizes[0], sizes[1]), "bias": jnp.zeros(sizes[1])},
        "out": {"kernel": he(k2, sizes[1], sizes[2]), "bias": jnp.zeros(sizes[2])},
    }


@pytest.fixture(scope="module")
def digits():
    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))  # fixed split: 1400 train, 397 test
    train, test = order[:1400], order[1400:]
    return x[train], y[train], x[test], y[test]


def train(forward, digits):
    """200 Adam steps on fixed batches; `forward(params, x)` is the model."""
    x_train, y_train, _, _ = digits
    opt = optax.adam(3e-3)
    params = init(jax.random.key(0))
    state = opt.init(params)

    def loss(params, x, y):
        logits = forward(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(params, state, x, y):
        grads = jax.grad(loss)(params, x, y)
        # Gradients come back in the float params' pytree shape: optax works unchanged.
        assert jax.tree.structure(grads) == jax.tree.structure(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    rng = np.random.default_rng(1)
    for _ in range(STEPS):
        idx = rng.choice(len(x_train), BATCH, replace=False)
        params, state = step(params, state, x_train[idx], y_train[idx])
    return params


def accuracy(logits, labels):
    return float(np.mean(np.argmax(np.asarray(logits), -1) == labels))


def test_qat_int8_matches_float_accuracy_and_convert_is_bit_identical(digits):
    recipe = preset("int8")  # w8a8: int8 per-channel weights, int8 per-token activations
    wrap = qat.wrapper(recipe)
    qat_forward = lambda params, x: run(mlp)(wrap(params), x)

    float_params = train(mlp, digits)
    qat_params = train(qat_forward, digits)
    _, _, x_test, y_test = digits
    float_acc = accuracy(mlp(float_params, x_test), y_test)
    qat_logits = jax.jit(qat_forward)(qat_params, x_test)
    qat_acc = accuracy(qat_logits, y_test)
    assert float_acc > 0.93, float_acc
    assert qat_acc >= float_acc - 0.01, (qat_acc, float_acc)

    served = convert(qat_params, recipe)
    assert isinstance(served["hidden"]["kernel"], QArray)
    assert served["hidden"]["kernel"].activation == recipe.rules[1].activation
    served_logits = jax.jit(run(mlp))(served, x_test)
    assert np.array_equal(np.asarray(served_logits), np.asarray(qat_logits))
    # QAT params (QatWeight leaves) convert the same way.
    wrapped = qat(qat_params, recipe)
    assert isinstance(wrapped["out"]["kernel"], QatWeight)
    again = convert(wrapped, recipe)
    assert np.array_equal(again["out"]["kernel"].codes, served["out"]["kernel"].codes)


def test_fp8_full_gradients_follow_the_float_gradients():
    params = init(jax.random.key(2))
    x = jax.random.uniform(jax.random.key(3), (32, 64))
    labels = jnp.arange(32) % 10
    wrap = qat.wrapper("fp8_full")  # e4m3 forward, e5m2 gradient matmuls

    def loss(forward, params):
        return optax.softmax_cross_entropy_with_integer_labels(forward(params, x), labels).mean()

    g_float = jax.jit(jax.grad(lambda p: loss(mlp, p)))(params)
    g_qat = jax.jit(jax.grad(lambda p: loss(lambda p, x: run(mlp)(wrap(p), x), p)))(params)
    for path in (("hidden", "kernel"), ("out", "kernel"), ("out", "bias")):
        a, b = g_qat[path[0]][path[1]], g_float[path[0]][path[1]]
        # e4m3/e5m2 keep 3/2 mantissa bits: a few % relative error per matmul.
        assert 0 < float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 0.15


def test_qlora_gradients_through_frozen_quantized_weights():
    base = init(jax.random.key(4))
    qbase = quantize_params(base, "nf4_g64")
    rank = 4
    lora = {
        "a": jax.random.normal(jax.random.key(5), (64, rank)) * 0.1,
        "b": jax.random.normal(jax.random.key(6), (rank, 128)) * 0.1,
    }
    x = jax.random.normal(jax.random.key(7), (16, 64))

    def forward(base, lora, x):
        hidden = x @ base["hidden"]["kernel"] + (x @ lora["a"]) @ lora["b"]
        return jax.nn.relu(hidden + base["hidden"]["bias"]) @ base["out"]["kernel"]

    def loss(lora, base):
        return jnp.mean(run(forward)(base, lora, x) ** 2)

    grads = jax.jit(jax.grad(loss))(lora, qbase)
    dequantized = jax.tree.map(
        lambda v: v.dequantize() if isinstance(v, QArray) else v,
        qbase,
        is_leaf=lambda v: isinstance(v, QArray),
    )
    expected = jax.jit(jax.grad(lambda lo: jnp.mean(forward(dequantized, lo, x) ** 2)))(lora)
    for key in ("a", "b"):
        np.testing.assert_allclose(grads[key], expected[key], rtol=1e-4, atol=1e-6)
    # The base stays packed: no gradient flows to it and it is never re-materialized as a leaf.
    assert isinstance(qbase["hidden"]["kernel"], QArray)


def test_qat_on_nnx_state_gradients_and_convert():
    graphdef, state = nnx.split(MLP((16, 32, 4), rngs=nnx.Rngs(0)), nnx.Param)
    forward = run(lambda s, x: nnx.merge(graphdef, s)(x))
    wrap = qat.wrapper("int8")
    x = jax.random.normal(jax.random.key(8), (4, 16))
    qat_forward = jax.jit(lambda s, x: forward(wrap(s), x))
    grads = jax.jit(jax.grad(lambda s: jnp.mean(qat_forward(s, x) ** 2)))(state)
    assert jax.tree.structure(grads) == jax.tree.structure(state)
    assert all(bool(jnp.any(g != 0)) for g in jax.tree.leaves(grads))
    served = convert(state, "int8")
    assert np.array_equal(jax.jit(forward)(served, x), qat_forward(state, x))
