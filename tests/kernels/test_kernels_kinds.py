"""The kernel-kind table against the compiled module and the rest of lowbit."""

import jax.numpy as jnp
import numpy as np
import pytest

from lowbit import kernels
from lowbit.formats import get_format
from lowbit.kernels import _kinds, _native, _reference

ZERO_POINT_IDS = {"none": 0, "fixed8": 1, "per_group": 2}


@pytest.mark.skipif(not kernels.available(), reason=kernels.status())
def test_table_matches_compiled_module():
    compiled = {kid: (pb, lut, zp) for kid, _name, pb, lut, zp in _native.module().kinds()}
    used = {k.kernel_id for k in kernels.KERNEL_KINDS.values() if k.kernel_id is not None}
    assert used == set(compiled), "a compiled kind has no Python entry, or the reverse"
    for kind in kernels.KERNEL_KINDS.values():
        if kind.kernel_id is None:
            continue
        pb, lut, zp = compiled[kind.kernel_id]
        assert kind.pair_bytes == pb, kind.name
        assert (kind.lut is not None) == lut, kind.name
        assert ZERO_POINT_IDS[kind.zero_point] == zp, kind.name


def test_derived_lists_follow_the_table():
    table = kernels.KERNEL_KINDS
    assert kernels.KINDS == tuple(table)
    assert set(_kinds.KIND_IDS) == {n for n, k in table.items() if k.kernel_id is not None}
    assert set(_reference.LUTS) == {n for n, k in table.items() if k.lut is not None}
    assert set(_reference.WEIGHT_ONLY_KINDS) == set(_kinds.KIND_IDS)
    for fmt, kind in kernels.FORMAT_KINDS.items():
        get_format(fmt)  # every listed format exists
        assert kind in _kinds.KIND_IDS


@pytest.mark.parametrize("name", [n for n in kernels.KINDS if n != "w8a8"])
def test_codes_round_trip_with_table_dtype(name):
    kind = kernels.KERNEL_KINDS[name]
    rng = np.random.default_rng(0)
    if kind.pair_bytes == 32:
        codes = jnp.asarray(rng.integers(-100, 100, (20, 18)), jnp.int8).astype(kind.code_dtype)
    else:
        codes = jnp.asarray(rng.integers(0, 16, (20, 18)), kind.code_dtype)
    scale = jnp.ones((1, 18), jnp.float32)
    zp = jnp.full((1, 18), 3.0) if kind.zero_point == "per_group" else None
    w = kernels.pack(name, codes, scale, zp)
    back = kernels.prepared_to_logical(w)
    assert back["codes"].dtype == kind.code_dtype
    np.testing.assert_array_equal(
        np.asarray(back["codes"]).view(np.uint8), np.asarray(codes).view(np.uint8)
    )


def test_codebooks_are_the_format_registrys_decodes():
    # The kernels' tables are built without JAX (importing lowbit compiles nothing); the
    # registry's own decode of every code must give the same values, sign of zero included.
    for name, table in (("nf4", kernels.NF4_LEVELS), ("fp4_e2m1", kernels.FP4_LEVELS)):
        decoded = np.asarray(get_format(name).decode(jnp.arange(16, dtype=jnp.uint8)))
        np.testing.assert_array_equal(table, decoded)
        np.testing.assert_array_equal(np.signbit(table), np.signbit(decoded))
