"""A quantized decode step traced on this CPU host exports for CUDA and TPU.

Kernel choice follows the platform a program is lowered for, not the host's backend: lowered
for an accelerator, the module must hold none of the CPU kernels' FFI targets; exported for
several platforms, the CPU branch keeps them and still computes what the direct call does.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export

import lowbit
from lowbit.models import Decoder, DecoderConfig

# These layers are far below the size where CUDA runs the Pallas kernel; the export checks
# need its branch in the CUDA module.
pytestmark = pytest.mark.usefixtures("gpu_kernel_on_small_weights")

_CPU_TARGET = re.compile(r"custom_call @(lowbit_\w+)")
_TRITON = re.compile(r"custom_call @__gpu\$xla\.gpu\.triton")
# Pallas kernels lower through Triton for CUDA (a target without JAX's compatibility promise).
_ALLOW_TRITON = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
_ALLOW_CPU_TARGETS = [
    export.DisabledSafetyCheck.custom_call(name)
    for name in (
        "lowbit_wo_linear",
        "lowbit_wo_dequantize",
        "lowbit_w8a8_linear",
        "lowbit_w8a8_linear_q",
        "lowbit_w8a8_int32",
        "lowbit_w4a8_linear",
        "lowbit_decode_attention",
        "lowbit_row_sum",
    )
]

# SmolLM2's shape of block (GQA 3:1, head_dim 64, gated MLP), fewer and narrower layers; every
# projection is large enough for the CPU kernels, so a CPU lowering does carry FFI calls.
_CONFIG = DecoderConfig(
    vocab_size=512,
    dim=256,
    n_layers=2,
    n_heads=6,
    n_kv_heads=2,
    head_dim=64,
    ffn_dim=512,
    context_length=64,
)


@pytest.fixture(scope="module")
def llm():
    model = Decoder(_CONFIG, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    return model, graphdef, nnx.to_pure_dict(state)


def _decode_step(graphdef):
    def step(params, tokens, cache):
        return nnx.merge(graphdef, params)(tokens, cache=cache, last_only=True)

    return jax.jit(lowbit.run(step))


def _targets(exported) -> set[str]:
    return set(_CPU_TARGET.findall(exported.mlir_module()))


def _export(fn, platforms, *args, allow=()):
    """`jax.export` for `platforms` from this CPU host. Lowering a Pallas kernel for CUDA asks
    for the GPU's kind, which a host without one names through an abstract mesh."""
    disabled = [*allow, *_ALLOW_TRITON]
    if "cuda" not in platforms or jax.default_backend() == "gpu":
        return export.export(fn, platforms=platforms, disabled_checks=disabled)(*args)
    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=auto, abstract_device=h100)
    with jax.sharding.use_abstract_mesh(mesh):
        return export.export(fn, platforms=platforms, disabled_checks=disabled)(*args)


@pytest.mark.parametrize(
    ("recipe", "kv_cache"),
    [
        ("int4_weight_only", "int8"),
        ("int8_dynamic_activation_int8_weight", None),
        ("nf4", "int4"),
    ],
)
def test_decode_step_exports_for_accelerators_without_cpu_targets(llm, recipe, kv_cache):
    model, graphdef, params = llm
    # Logical QArrays, as weights quantized on (or for) an accelerator stay; CPU-laid-out
    # weights are the next test's.
    qparams = lowbit.quantize(params, recipe, kernel_layouts=False)
    cache = model.init_cache(2, 16, kv_cache)
    tokens = jnp.array([[3], [7]], jnp.int32)
    step = _decode_step(graphdef)

    on_cpu = _export(step, ("cpu",), qparams, tokens, cache, allow=_ALLOW_CPU_TARGETS)
    assert _targets(on_cpu), "the CPU lowering should use the kernels"
    assert not _TRITON.search(on_cpu.mlir_module())
    cuda, tpu = (_export(step, p, qparams, tokens, cache) for p in (("cuda",), ("tpu",)))
    assert _targets(cuda) == set() and _targets(tpu) == set()
    # Weight-only int4 / nf4 layers run the Pallas kernel on CUDA (w8a8: XLA's int8 GEMM).
    gpu_kernel = recipe != "int8_dynamic_activation_int8_weight"
    assert bool(_TRITON.search(cuda.mlir_module())) == gpu_kernel
    assert not _TRITON.search(tpu.mlir_module())

    everywhere = _export(
        step, ("cpu", "cuda", "tpu"), qparams, tokens, cache, allow=_ALLOW_CPU_TARGETS
    )
    (logits, _), (want, _) = everywhere.call(qparams, tokens, cache), step(qparams, tokens, cache)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", ["int4_weight_only", "nf4"])
def test_decode_step_exports_the_tpu_kernel_when_enabled(llm, recipe, monkeypatch):
    """With ``LOWBIT_TPU_KERNELS=1`` weight-only layers lower to the Mosaic kernel for TPU."""
    monkeypatch.setenv("LOWBIT_TPU_KERNELS", "1")
    model, graphdef, params = llm
    qparams = lowbit.quantize(params, recipe, kernel_layouts=False)
    cache = model.init_cache(2, 16, None)
    tokens = jnp.array([[3], [7]], jnp.int32)
    step = _decode_step(graphdef)
    tpu = _export(step, ("tpu",), qparams, tokens, cache).mlir_module()
    assert "tpu_custom_call" in tpu and not _CPU_TARGET.search(tpu)
    everywhere = _export(
        step, ("cpu", "cuda", "tpu"), qparams, tokens, cache, allow=_ALLOW_CPU_TARGETS
    )
    (logits, _), (want, _) = everywhere.call(qparams, tokens, cache), step(qparams, tokens, cache)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_prepared_weights_export_for_accelerators(llm):
    """Weights laid out for the CPU kernels still lower for CUDA (their logical form)."""
    model, graphdef, params = llm
    qparams = lowbit.quantize(params, "int8_weight_only")
    tokens = jnp.array([[3]], jnp.int32)
    cache = model.init_cache(1, 16, None)
    step = _decode_step(graphdef)
    prepared = lowbit.prepare(
        qparams, lambda p, t, c: nnx.merge(graphdef, p)(t, cache=c, last_only=True), tokens, cache
    )
    assert any(
        type(w).__name__ == "PreparedQArray"
        for w in jax.tree.leaves(prepared, is_leaf=lambda x: type(x).__name__ == "PreparedQArray")
    )
    exported = _export(step, ("cuda",), prepared, tokens, cache)
    assert _targets(exported) == set()


def _mlp_params():
    keys = jax.random.split(jax.random.key(3), 2)
    return {
        "up": {"kernel": jax.random.normal(keys[0], (256, 512)) / 16},
        "down": {"kernel": jax.random.normal(keys[1], (512, 256)) / 22},
    }


def _mlp(p, x):
    return jax.nn.gelu(x @ p["up"]["kernel"]) @ p["down"]["kernel"]


def _train_steps():
    """name -> (step(state, x) -> gradients, state) for the three kinds of training."""
    params = _mlp_params()
    forward = lowbit.run(_mlp)
    config = lowbit.LoraConfig(rules=(lowbit.LoraRule(path=r".*kernel", rank=4, alpha=8.0),))
    base = lowbit.quantize(params, "nf4", kernel_layouts=False)
    adapters = lowbit.lora_init(base, config, jax.random.key(0))
    qlora = lambda a, x: forward(lowbit.lora_apply(base, a, config), x).sum()
    to_qat = lowbit.qat.wrapper("int8")
    qat = lambda p, x: forward(to_qat(p), x).sum()
    fp8 = lowbit.fp8_recipe("fp8_delayed", history_length=4)
    fp8_step = lambda s, x: forward(lowbit.fp8_apply(s[0], s[1], fp8), x).sum()
    return {
        "qlora": (jax.jit(jax.grad(qlora)), adapters),
        "qat": (jax.jit(jax.grad(qat)), params),
        "fp8": (jax.jit(jax.grad(fp8_step)), (params, lowbit.fp8_init(params, fp8))),
    }


@pytest.mark.parametrize("name", ["qlora", "qat", "fp8"])
def test_training_steps_export_for_accelerators(name):
    step, state = _train_steps()[name]
    x = jnp.ones((4, 256))
    for platforms in (("cuda",), ("tpu",)):
        exported = _export(step, platforms, state, x)
        assert _targets(exported) == set(), platforms
    # The QLoRA base (NF4) runs the Pallas kernel forward on CUDA, its gradient in XLA.
    cuda = _export(step, ("cuda",), state, x).mlir_module()
    assert bool(_TRITON.search(cuda)) == (name == "qlora")
    want = step(state, x)
    everywhere = _export(step, ("cpu", "cuda", "tpu"), state, x, allow=_ALLOW_CPU_TARGETS)
    got = everywhere.call(state, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
