"""Without the compiled kernels, every entry point runs the pure-JAX reference."""

import os
import subprocess
import sys
import textwrap

import pytest

from lowbit import kernels

SCRIPT = textwrap.dedent(
    """
    import logging
    import jax.numpy as jnp
    import numpy as np
    from lowbit import kernels
    from lowbit.kernels import _reference

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    assert not kernels.available()
    print(kernels.status())
    rng = np.random.default_rng(0)
    codes = jnp.asarray(rng.integers(0, 16, (40, 9)), jnp.uint8)
    scale = jnp.asarray(rng.uniform(0.1, 1, (2, 9)), jnp.float32)
    zp = jnp.full((2, 9), 7.5, jnp.float32)
    w = kernels.pack("uint4", codes, scale, zp, 32)
    x = jnp.asarray(rng.standard_normal((3, 40)), jnp.float32)
    got = kernels.weight_only_linear(x, w)
    kernels.weight_only_linear(x, w)
    ref = _reference.weight_only_linear(x, "uint4", codes, scale, zp, 32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6)
    q = jnp.asarray(rng.integers(-128, 128, (40, 9)), jnp.int8)
    w8 = kernels.pack("w8a8", q, jnp.ones((1, 9)))
    xq, xs = kernels.quantize_per_token(x)
    np.testing.assert_array_equal(
        np.asarray(kernels.w8a8_matmul_int32(xq, w8)),
        np.asarray(_reference.w8a8_matmul_int32(xq, q)),
    )
    assert not kernels.supports("int4", 40, 9, 32, jnp.float32)
    print("OK")
    """
)


def test_disabled_kernels_fall_back_with_one_notice():
    env = dict(os.environ, LOWBIT_DISABLE_KERNELS="1")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "disabled by LOWBIT_DISABLE_KERNELS=1" in out.stdout
    assert out.stdout.strip().endswith("OK")
    notices = [line for line in out.stderr.splitlines() if line.startswith("lowbit.kernels")]
    assert len(notices) == 1 and "pure-JAX" in notices[0]


ISA_SCRIPT = textwrap.dedent(
    """
    import jax.numpy as jnp
    import numpy as np
    from lowbit import kernels
    from lowbit.kernels import _reference

    print(kernels.status())
    q = jnp.asarray(np.random.default_rng(0).integers(-128, 128, (40, 9)), jnp.int8)
    xq = jnp.asarray(np.random.default_rng(1).integers(-128, 128, (3, 40)), jnp.int8)
    got = kernels.w8a8_matmul_int32(xq, kernels.pack("w8a8", q, jnp.ones((1, 9))))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_reference.w8a8_matmul_int32(xq, q)))
    best = kernels.supported_isas()[-1]
    print(kernels.set_isa(best), best)
    """
)


@pytest.mark.skipif(not kernels.available(), reason=kernels.status())
def test_isa_env_var_selects_a_path():
    env = dict(os.environ, LOWBIT_CPU_ISA="scalar")
    env.pop("LOWBIT_DISABLE_KERNELS", None)
    out = subprocess.run(
        [sys.executable, "-c", ISA_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    first, last = out.stdout.strip().splitlines()
    assert "isa=scalar" in first
    chosen, best = last.split()
    assert chosen == best


@pytest.mark.skipif(not kernels.available(), reason=kernels.status())
def test_an_isa_the_cpu_lacks_is_refused_not_capped():
    with pytest.raises(ValueError, match="unknown instruction-set path"):
        kernels.set_isa("avx1024")
    missing = [isa for isa in kernels.ISAS if isa not in kernels.supported_isas()]
    if not missing:
        pytest.skip("this CPU runs every path")
    with pytest.raises(ValueError, match=f"cannot run the '{missing[-1]}' kernels"):
        kernels.set_isa(missing[-1])
    env = dict(os.environ, LOWBIT_CPU_ISA=missing[-1])
    env.pop("LOWBIT_DISABLE_KERNELS", None)
    out = subprocess.run(
        [sys.executable, "-c", ISA_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode != 0
    assert f"LOWBIT_CPU_ISA={missing[-1]}: this CPU cannot run" in out.stderr
