"""LoRA / QLoRA through the engine: NNX, Linen and plain functions; jit, scan, remat; optax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from api_models import MLP, LinenMLP
from flax import nnx

import lowbit
from lowbit.api import LoraConfig, LoraRule, lora_apply, lora_init, lora_merge, lora_param_count
from lowbit.ops import LoraWeight
from lowbit.qarray import QArray

RULES = LoraConfig(rules=(LoraRule(path=r".*kernel", rank=4, alpha=8.0),))


def _bump(adapters, seed=0):
    """Non-zero `b` factors (fresh adapters leave the model unchanged)."""
    out = {}
    for i, (path, entry) in enumerate(sorted(adapters.items())):
        key = jax.random.key(seed + i)
        out[path] = {**entry, "b": 0.1 * jax.random.normal(key, entry["b"].shape)}
    return out


def _reference(params, adapters, config):
    merged = lora_merge(params, adapters, config)
    return jax.tree.map(
        lambda x: x.dequantize() if isinstance(x, QArray) else x,
        merged,
        is_leaf=lambda x: isinstance(x, QArray),
    )


@pytest.fixture(scope="module")
def nnx_model():
    model = MLP((64, 128, 32), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    return graphdef, state, lowbit.quantize_params(state, "nf4_g64")


@pytest.mark.parametrize("base", ["float", "nf4"])
def test_nnx_forward_equals_the_merged_model(nnx_model, base):
    graphdef, state, qstate = nnx_model
    params = state if base == "float" else qstate
    adapters = _bump(lora_init(params, RULES, jax.random.key(0)))
    report = lowbit.EngineReport()
    apply = lowbit.run(lambda s, x: nnx.merge(graphdef, s)(x), strict=True, report=report)
    x = jax.random.normal(jax.random.key(1), (4, 64))
    got = jax.jit(apply)(lora_apply(params, adapters, RULES), x)
    want = nnx.merge(graphdef, _reference(params, adapters, RULES))(x)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    assert all(k.startswith("dot_general:lora+") for k in report.quantized_ops)
    assert sum(report.quantized_ops.values()) == 2 and not report.fallbacks


def test_qlora_training_updates_only_adapters_and_lowers_the_loss(nnx_model):
    graphdef, _, qstate = nnx_model
    config = LoraConfig(rules=(LoraRule(path=r".*kernel", rank=4, dropout=0.1),), train=r".*bias")
    adapters = lora_init(qstate, config, jax.random.key(0))
    n_adapter = (64 + 128) * 4 + (128 + 32) * 4
    assert lora_param_count(adapters) == n_adapter + 128 + 32
    apply = lowbit.run(lambda s, x: nnx.merge(graphdef, s)(x))
    x = jax.random.normal(jax.random.key(2), (32, 64))
    y = jax.random.randint(jax.random.key(3), (32,), 0, 32)

    def loss(adapters, params, key):
        logits = apply(lora_apply(params, adapters, config, key=key), x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    opt = optax.adam(1e-2)

    @jax.jit
    def step(adapters, state, key):
        value, grads = jax.value_and_grad(loss)(adapters, qstate, key)
        updates, state = opt.update(grads, state, adapters)
        return optax.apply_updates(adapters, updates), state, value

    state = opt.init(adapters)
    losses = []
    for i in range(30):
        adapters, state, value = step(adapters, state, jax.random.key(i))
        losses.append(float(value))
    assert losses[-1] < 0.5 * losses[0]
    # The base stayed packed: the params holding it were never an optimizer argument.
    leaves = jax.tree.leaves(qstate, is_leaf=lambda v: isinstance(v, QArray))
    assert any(isinstance(v, QArray) for v in leaves)


def test_linen_and_plain_function():
    module = LinenMLP(hidden=64, out=16)
    variables = module.init(jax.random.key(0), jnp.ones((1, 32)))
    qvars = lowbit.quantize_params(variables, "int8w")
    config = LoraConfig(rules=(LoraRule(path=r"params/Dense_0/kernel", rank=2),))
    adapters = _bump(lora_init(qvars, config, jax.random.key(0)))
    assert set(adapters) == {"params/Dense_0/kernel"}
    x = jnp.ones((2, 32))
    got = lowbit.run(module.apply)(lora_apply(qvars, adapters, config), x)
    np.testing.assert_allclose(
        got, module.apply(_reference(qvars, adapters, config), x), rtol=1e-4, atol=1e-4
    )

    params = {"w": jax.random.normal(jax.random.key(1), (16, 8))}
    plain = LoraConfig(rules=(LoraRule(path="w", rank=2),))
    ad = _bump(lora_init(params, plain, jax.random.key(0)))
    fn = lowbit.run(lambda p, x: jnp.tanh(x @ p["w"]))
    xs = jnp.ones((3, 16))
    np.testing.assert_allclose(
        fn(lora_apply(params, ad, plain), xs),
        jnp.tanh(xs @ lora_merge(params, ad, plain)["w"]),
        rtol=1e-5,
    )


def test_scan_over_stacked_layers_and_remat():
    # Stacked weights [layers, in, out]: the adapters get a leading layer axis too.
    w = jax.random.normal(jax.random.key(0), (3, 16, 16)) / 4
    with pytest.warns(UserWarning, match="quantizes none"):  # no preset rule names `w`
        params = {"w": lowbit.quantize_params({"w": w}, "int8w")["w"]}
    config = LoraConfig(rules=(LoraRule(path="w", rank=2),))
    adapters = _bump(lora_init(params, config, jax.random.key(1)))
    assert adapters["w"]["a"].shape == (3, 16, 2) and adapters["w"]["b"].shape == (3, 2, 16)

    def net(p, x):
        body = jax.checkpoint(lambda h, layer: (jnp.tanh(h @ layer), None))
        return jax.lax.scan(body, x, p["w"])[0]

    report = lowbit.EngineReport()
    x = jnp.ones((2, 16))
    got = jax.jit(lowbit.run(net, report=report, strict=True))(
        lora_apply(params, adapters, config), x
    )
    want = net(lora_merge(params, adapters, config), x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert report.quantized_ops and not report.fallbacks
    grads = jax.grad(lambda ad: lowbit.run(net)(lora_apply(params, ad, config), x).sum())(adapters)
    ref = jax.grad(lambda ad: net(lora_merge(params, ad, config), x).sum())(adapters)
    np.testing.assert_allclose(grads["w"]["a"], ref["w"]["a"], rtol=1e-3, atol=1e-5)


def test_merge_then_requantize():
    params = {"dense": {"kernel": jax.random.normal(jax.random.key(0), (64, 32))}}
    config = LoraConfig(rules=(LoraRule(path=".*kernel", rank=4),))
    adapters = _bump(lora_init(params, config, jax.random.key(1)))
    requantized = lora_merge(params, adapters, config, recipe="int8w")["dense"]["kernel"]
    assert isinstance(requantized, QArray)
    merged = lora_merge(params, adapters, config)["dense"]["kernel"]
    err = np.abs(requantized.dequantize() - merged).max()
    assert err <= np.abs(merged).max() / 127 + 1e-6


@pytest.mark.parametrize(
    "rule, fragment",
    [
        (LoraRule(path="nothing/.*", rank=2), "matches no parameter"),
        (LoraRule(path="w", rank=16), "rank=16 is not below min"),
        (LoraRule(path="w", rank=2, in_axes=(3,)), "in_axes"),
    ],
)
def test_bad_rules_name_the_field(rule, fragment):
    params = {"w": jnp.ones((16, 32))}
    with pytest.raises(ValueError, match=fragment):
        lora_init(params, rule, jax.random.key(0))


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"rank": 0}, "LoraRule.rank"),
        ({"dropout": 1.0}, "LoraRule.dropout"),
        ({"alpha": -1}, "LoraRule.alpha"),
        ({"ops": ("matmul",)}, "LoraRule.ops"),
    ],
)
def test_bad_rule_fields(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        LoraRule(**kwargs)


def test_adapters_for_another_shape_are_refused():
    params = {"w": jnp.ones((16, 32))}
    config = LoraConfig(rules=(LoraRule(path="w", rank=2),))
    other = lora_init({"w": jnp.ones((16, 24))}, config, jax.random.key(0))
    with pytest.raises(ValueError, match="needs"):
        lora_apply(params, other, config)
    assert isinstance(
        lora_apply(params, lora_init(params, config, jax.random.key(0)), config)["w"], LoraWeight
    )
