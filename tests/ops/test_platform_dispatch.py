"""The quantized `dot_general` chooses its implementation per lowering platform.

On CPU: the traced product carries one `lowbit_by_platform` equation whose CUDA branch is the
Pallas kernel and whose CPU branch is the C++ kernel, and its value is the CPU one. On a GPU
(`benchmarks/gpu_check.sh` runs this file there) the same call runs the Pallas kernel and
matches the dequantized reference, and its gradient is the straight-through one.
"""

import dataclasses
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.kernels import by_platform_p
from lowbit.ops import _accelerated, _dot_general, dot_general
from lowbit.qarray import PerChannel, PerGroup, PerToken, QuantConfig, quantize

pytestmark = [
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
    pytest.mark.usefixtures("gpu_kernel_on_small_weights"),  # these weights are small
]

DIMS = (((1,), (0,)), ((), ()))
K, N = 512, 256


def _weight(fmt):
    w = np.random.default_rng(0).standard_normal((K, N)).astype(np.float32) / np.sqrt(K)
    return quantize(jnp.asarray(w), fmt, granularity=PerGroup(64))


def _outermost(jaxpr):
    return next(e for e in _equations(jaxpr) if e.primitive is by_platform_p)


def _equations(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple) else (value,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    yield from _equations(inner)


@pytest.mark.parametrize("fmt", ["int4", "uint4", "nf4"])
def test_product_carries_a_branch_per_platform(fmt):
    q = _weight(fmt)
    x = jnp.ones((2, K), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda x, q: dot_general(x, q, DIMS))(x, q).jaxpr
    # The product's switch comes first; the CPU kernel's own (FFI call or reference) is inside.
    eqn = _outermost(jaxpr)
    assert "cuda" in eqn.params["platforms"]
    cuda = eqn.params["branches"][eqn.params["platforms"].index("cuda")]
    assert any(e.primitive.name == "pallas_call" for e in _equations(cuda.jaxpr))


@pytest.mark.parametrize("fmt", ["int4", "uint4", "nf4", "int8"])
@pytest.mark.parametrize("m", [1, 5, 64])
def test_product_matches_the_dequantized_reference_on_this_platform(fmt, m):
    q = _weight(fmt)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((m, K)), jnp.float32)
    got = jax.jit(lambda x, q: dot_general(x, q, DIMS))(x, q)
    want = np.asarray(x, np.float64) @ np.asarray(q.dequantize(jnp.float32), np.float64)
    # TF32 dots on NVIDIA GPUs; float32 on CPU.
    tol = 1e-2 if jax.default_backend() == "gpu" else 1e-5
    np.testing.assert_allclose(np.asarray(got), want, atol=tol * np.abs(want).max())


def test_gradient_is_straight_through_on_this_platform():
    q = _weight("nf4")
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, K)), jnp.float32)
    g = jax.jit(jax.grad(lambda x: dot_general(x, q, DIMS).sum()))(x)
    want = np.broadcast_to(np.asarray(q.dequantize(jnp.float32)).sum(axis=1), (3, K))
    tol = 1e-2 if jax.default_backend() == "gpu" else 1e-5
    np.testing.assert_allclose(np.asarray(g), want, atol=tol * np.abs(want).max())


def test_small_weights_keep_xla_on_cuda(monkeypatch):
    monkeypatch.setattr(_accelerated, "GPU_MIN_WEIGHT_ELEMENTS", K * N + 1)
    q = _weight("int4")
    x = jnp.ones((2, K), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda x, q: dot_general(x, q, DIMS))(x, q).jaxpr
    for eqn in _equations(jaxpr):
        if eqn.primitive is by_platform_p:
            assert "cuda" not in eqn.params["platforms"]
    assert not any(e.primitive.name == "pallas_call" for e in _equations(jaxpr))


def test_plans_say_why_cuda_keeps_xla(monkeypatch):
    """Each product the CUDA kernel leaves to XLA says why; one it takes, or one meant for
    another product (activation-quantized), says nothing."""
    plan = lambda x, q, dims=DIMS: _dot_general.plan_dot_general(x, q, dims).declined
    x = jnp.ones((2, K), jnp.float32)
    assert plan(x, _weight("int4")) == ()
    monkeypatch.setattr(_accelerated, "GPU_MIN_WEIGHT_ELEMENTS", K * N + 1)
    assert plan(x, _weight("int4")) == (
        ("cuda", f"pallas: a weight under GPU_MIN_WEIGHT_ELEMENTS ({K * N + 1})"),
    )
    monkeypatch.setattr(_accelerated, "GPU_MIN_WEIGHT_ELEMENTS", 0)
    # N = 40: no power-of-two tile of 32 (nibbles packed along N) divides it.
    odd = quantize(jnp.ones((K, 40)), "int4", granularity=PerGroup(64, 0))
    [(platform, reason)] = plan(x, odd)
    assert platform == "cuda" and "N=40" in reason and "Pad N" in reason
    # The weight contracted on its axis 1 (x @ W.T): the kernel reads [K, N] only.
    [(_, reason)] = plan(jnp.ones((2, N)), _weight("int4"), (((1,), (1,)), ((), ())))
    assert "axis 1" in reason
    w8a8 = dataclasses.replace(_weight("int8"), activation=QuantConfig(format="int8"))
    assert plan(x, w8a8) == ()


def test_tpu_branch_only_when_its_kernels_are_enabled(monkeypatch):
    q = _weight("int4")
    x = jnp.ones((2, K), jnp.float32)

    def by_platform_equation():
        jaxpr = jax.make_jaxpr(lambda x, q: dot_general(x, q, DIMS))(x, q).jaxpr
        return _outermost(jaxpr)

    monkeypatch.delenv(_accelerated.TPU_KERNELS_ENV, raising=False)
    assert "tpu" not in by_platform_equation().params["platforms"]
    monkeypatch.setenv(_accelerated.TPU_KERNELS_ENV, "1")
    eqn = by_platform_equation()
    tpu = eqn.params["branches"][eqn.params["platforms"].index("tpu")]
    assert any(e.primitive.name == "pallas_call" for e in _equations(tpu.jaxpr))


def _activation_weight(fmt):
    w = np.random.default_rng(3).standard_normal((K, N)).astype(np.float32) / np.sqrt(K)
    q = quantize(jnp.asarray(w), fmt, granularity=PerChannel((1,)))
    return dataclasses.replace(q, activation=QuantConfig(format=fmt))


@pytest.mark.parametrize(
    ("fmt", "rows", "k_major"),
    [("int8", 256, True), ("int8", 16, False), ("fp8_e4m3fn", 1, True)],
)
def test_cuda_multiplies_k_n_activation_weights_through_a_k_major_copy(fmt, rows, k_major):
    q = _activation_weight(fmt)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((rows, K)), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda x, q: dot_general(x, q, DIMS))(x, q)
    found = [e for e in _equations(jaxpr.jaxpr) if e.primitive is by_platform_p]
    assert ("cuda" in found[0].params["platforms"] if found else False) == k_major
    if not k_major:
        return
    eqn = found[0]
    cuda = eqn.params["branches"][eqn.params["platforms"].index("cuda")]
    names = {e.primitive.name for e in _equations(cuda.jaxpr)}
    assert {"transpose", "optimization_barrier", "dot_general"} <= names
    # The branch is plain XLA: evaluated here, it gives the portable product's values.
    flat = jax.tree.leaves((x, q))
    (got,) = jax.core.eval_jaxpr(cuda.jaxpr, cuda.consts, *flat)
    want = jax.jit(lambda x, q: dot_general(x, q, DIMS))(x, q)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def _cuda_branch(jaxpr):
    found = [e for e in _equations(jaxpr.jaxpr) if e.primitive is by_platform_p]
    found = [e for e in found if "cuda" in e.params["platforms"]]
    return [e.params["branches"][e.params["platforms"].index("cuda")] for e in found]


@pytest.mark.parametrize("group", [8, 16, 32])
def test_cuda_multiplies_short_int8_contractions_in_float(group):
    # XLA's CUDA int8 GEMM returns wrong sums below 32 contracted elements
    # (`CUDA_INT8_MIN_CONTRACTION`); a w4a8 product contracts one group at a time.
    w = np.random.default_rng(5).standard_normal((K, N)).astype(np.float32) / np.sqrt(K)
    q = quantize(jnp.asarray(w), "int4", granularity=PerGroup(group))
    q = dataclasses.replace(q, activation=QuantConfig(format="int8", granularity=PerToken()))
    x = jnp.asarray(np.random.default_rng(6).standard_normal((3, K)), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda x, q: dot_general(x, q, DIMS))(x, q)
    branches = _cuda_branch(jaxpr)
    if group >= _dot_general.CUDA_INT8_MIN_CONTRACTION:
        assert branches == []
        return
    (cuda,) = branches
    dots = [e for e in _equations(cuda.jaxpr) if e.primitive.name == "dot_general"]
    assert [str(v.aval.dtype) for d in dots for v in d.invars] == ["float32", "float32"]
    # Evaluated here, the float branch gives the int32 product's sums exactly.
    a = np.random.default_rng(7).integers(-128, 128, (4, 3, group)).astype(np.int8)
    b = np.random.default_rng(8).integers(-8, 8, (4, group, 5)).astype(np.int8)
    dims = (((2,), (1,)), ((0,), (0,)))
    traced = jax.make_jaxpr(lambda a, b: _dot_general.integer_dot(a, b, dims))(a, b)
    (branch,) = _cuda_branch(traced)
    (got,) = jax.core.eval_jaxpr(branch.jaxpr, branch.consts, a, b)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.einsum("bmk,bkn->bmn", a.astype(np.int64), b))


def test_a_jitted_product_traces_once_in_a_fresh_process():
    # The accelerator check runs inside the trace; had it imported Pallas there (which grows
    # JAX's trace context), the second call would trace and compile everything again.
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        import lowbit
        traces = []
        def f(p, x):
            traces.append(1)
            return x @ p["kernel"]
        w = {"kernel": jnp.ones((2048, 2048))}  # large enough for the GPU kernels' check
        p = lowbit.quantize(w, "int4_weight_only", kernel_layouts=False)
        g = jax.jit(lowbit.run(f))
        x = jnp.ones((2, 2048))
        g(p, x).block_until_ready()
        g(p, x).block_until_ready()
        print(len(traces))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "1", out.stdout
