"""GGUF block-row kernels: dequantization bit-identical to llama.cpp's, products in both
arithmetics on every CPU path, tiles (every type of `TILE_BYTES`) the same bytes reordered and
the same products, bad input refused."""

import functools

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit import kernels
from lowbit.gguf import block_type
from lowbit.gguf import decode as gguf_decode
from lowbit.gguf import encode as gguf_encode
from lowbit.kernels._gguf import TILE_BYTES, _q8_blocks, tile_reference

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.status())

TYPES = tuple(kernels.GGUF_TYPE_IDS)
ISAS = tuple(kernels.supported_isas())


def _rows(ggml_type: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    w[1] = 0.0  # an all-zero row: zero scales
    w[2, : k // 2] = 0.25  # constant blocks: Q4_K / Q2_K sub-blocks holding only their minimum
    return np.asarray(gguf_encode(ggml_type, w))


def _k(ggml_type: str) -> int:
    # 32-element types: 18 blocks, so the second 256-element unit is partial.
    return 576 if kernels.GGUF_TYPE_IDS[ggml_type] <= 5 else 512


@pytest.fixture(params=ISAS)
def isa(request):
    before = kernels.set_isa(ISAS[-1])
    kernels.set_isa(request.param)
    yield request.param
    kernels.set_isa(before)


_dequantize = jax.jit(kernels.gguf_dequantize, static_argnums=(1, 2))
_linear = jax.jit(kernels.gguf_linear, static_argnames=("ggml_type", "int8_activations", "tiled"))
TILED_TYPES = tuple(TILE_BYTES)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_dequantize_is_llama_cpps(ggml_type, isa):
    k = _k(ggml_type)
    rows = _rows(ggml_type, 24, k)
    got = np.asarray(_dequantize(jnp.asarray(rows), ggml_type, k))
    # gguf-py's NumPy decoder: an independent reference of llama.cpp's dequantization.
    ref = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[ggml_type]).reshape(24, k)
    assert got.tobytes() == ref.astype(np.float32).tobytes()


@pytest.mark.parametrize("ggml_type", TYPES)
def test_products_in_both_arithmetics(ggml_type, isa):
    k, n = _k(ggml_type), 40
    rows = jnp.asarray(_rows(ggml_type, n, k, seed=1))
    w = gguf_decode(ggml_type, np.asarray(rows))
    rng = np.random.default_rng(2)
    for m in (1, 5):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[0, :32] = 0.0  # a zero activation block: zero scale, no NaN
        ref = x @ w.T
        y = np.asarray(_linear(jnp.asarray(x), rows, ggml_type=ggml_type, int8_activations=False))
        np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
        yq = np.asarray(_linear(jnp.asarray(x), rows, ggml_type=ggml_type, int8_activations=True))
        assert np.isfinite(yq).all()
        # int8 activations: the error of rounding x to 8 bits, not more.
        err = np.abs(yq - ref).max() / np.abs(ref).max()
        assert err < 3e-2, err
        np.testing.assert_array_equal(y[:, 1], 0.0)  # the zero row


@pytest.mark.parametrize("ggml_type", TILED_TYPES)
def test_tiles_are_the_block_rows_reordered(ggml_type):
    # Any bytes at all (scale fields with every 6-bit pattern, NaN halves): tiles are a
    # permutation of them, read back byte for byte.
    n, k = 24, _k(ggml_type)
    t = block_type(ggml_type)
    rows = np.random.default_rng(5).integers(0, 256, (n, k // t.block_size * t.type_size), np.uint8)
    tiles = kernels.gguf_tile(jnp.asarray(rows), ggml_type)
    assert tiles.shape == (n // 8, k // t.block_size * TILE_BYTES[ggml_type])
    assert tiles.size == rows.size or ggml_type in ("Q3_K", "Q4_K", "Q5_K")  # scales spelled out
    back = kernels.gguf_untile(tiles, ggml_type, k)
    assert np.asarray(back).tobytes() == rows.tobytes()


@pytest.mark.skipif(not kernels.available(), reason=kernels.status())
@pytest.mark.parametrize("ggml_type", TILED_TYPES)
def test_the_tiling_kernel_writes_the_references_bytes(ggml_type):
    # Any bytes (every 6-bit scale pattern of Q3_K / Q4_K / Q5_K spelled out); one group,
    # several blocks, and more groups than one thread's share (the kernel splits the groups).
    t = block_type(ggml_type)
    reference = jax.jit(tile_reference, static_argnums=1)
    rng = np.random.default_rng(11)
    for n, blocks in ((8, 1), (24, 3), (8 * (2**19 // (TILE_BYTES[ggml_type] * 2) + 3), 2)):
        rows = jnp.asarray(rng.integers(0, 256, (n, blocks * t.type_size), np.uint8))
        got = np.asarray(kernels.gguf_tile(rows, ggml_type))
        want = np.asarray(reference(rows, ggml_type))
        assert got.shape == want.shape and got.tobytes() == want.tobytes(), (n, blocks)


_tile_over_donated_rows = jax.jit(
    functools.partial(kernels.gguf_tile, over_rows=True), static_argnums=1, donate_argnums=0
)


def test_the_types_tiled_over_their_rows_are_those_whose_tiles_are_their_size():
    assert kernels.TILES_OVER_ROWS == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q6_K"}


@pytest.mark.parametrize("ggml_type", sorted(kernels.TILES_OVER_ROWS))
def test_tiles_written_over_their_donated_rows_are_the_same_bytes(ggml_type):
    # One group, and more groups than one thread's share: each group is copied aside before
    # its tiles overwrite it, whichever thread runs it.
    t = block_type(ggml_type)
    rng = np.random.default_rng(12)
    for n, blocks in ((8, 1), (8 * (2**19 // (TILE_BYTES[ggml_type] * 2) + 3), 2)):
        host = rng.integers(0, 256, (n, blocks * t.type_size), np.uint8)
        want = np.asarray(kernels.gguf_tile(jnp.asarray(host), ggml_type))
        rows = jnp.asarray(host)
        at = rows.unsafe_buffer_pointer()
        got = _tile_over_donated_rows(rows, ggml_type)
        assert got.shape == want.shape and np.asarray(got).tobytes() == want.tobytes()
        assert rows.is_deleted() and got.unsafe_buffer_pointer() == at  # no second buffer
        # Not donated, the rows are left as they were (XLA copies them first).
        kept = jnp.asarray(host)
        again = jax.jit(functools.partial(kernels.gguf_tile, over_rows=True), static_argnums=1)
        assert np.asarray(again(kept, ggml_type)).tobytes() == want.tobytes()
        assert np.asarray(kept).tobytes() == host.tobytes()


@pytest.mark.parametrize("ggml_type", TILED_TYPES)
def test_tiled_products_are_the_rows_products(ggml_type, isa):
    """The tile kernels (int8 activations, 1-8 activation rows at a time) and the paths that
    read tiles back a group at a time (float activations, the portable path, dequantization)
    give the block rows' results, within float summation order."""
    k, n = _k(ggml_type), 40
    rows = jnp.asarray(_rows(ggml_type, n, k, seed=6))
    tiles = kernels.gguf_tile(rows, ggml_type)
    got = np.asarray(_dequantize_tiled(tiles, ggml_type, k))
    assert got.tobytes() == np.asarray(_dequantize(rows, ggml_type, k)).tobytes()
    rng = np.random.default_rng(7)
    for m in (1, 2, 3, 8, 13):
        x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
        for q8 in (True, False):
            ref = np.asarray(_linear(x, rows, ggml_type=ggml_type, int8_activations=q8))
            y = np.asarray(_linear(x, tiles, ggml_type=ggml_type, int8_activations=q8, tiled=True))
            np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
            np.testing.assert_array_equal(y[:, 1], 0.0)  # the zero row


@pytest.mark.parametrize("ggml_type", TILED_TYPES)
def test_tiled_products_are_the_same_bits_on_every_path(ggml_type):
    """Every CPU path's tile kernel (AVX-512 VNNI: two groups a register, the odd last group
    on AVX2; AVX-VNNI: one group a register) sums the same integers in the same float order
    as the AVX2 tiles: the same bits, so a batch's answers do not depend on the instruction
    set."""
    paths = [i for i in ISAS if i != "scalar"]
    if len(paths) < 2:
        pytest.skip("one vector path on this CPU")
    k, n = _k(ggml_type), 56  # 7 groups: pairs and an odd one
    tiles = kernels.gguf_tile(jnp.asarray(_rows(ggml_type, n, k, seed=8)), ggml_type)
    x = jnp.asarray(np.random.default_rng(9).standard_normal((13, k)).astype(np.float32))
    before = kernels.set_isa(ISAS[-1])
    try:
        got = {}
        for path in paths:
            kernels.set_isa(path)
            got[path] = np.asarray(
                _linear(x, tiles, ggml_type=ggml_type, int8_activations=True, tiled=True)
            )
    finally:
        kernels.set_isa(before)
    for path in paths[1:]:
        assert got[path].tobytes() == got[paths[0]].tobytes(), path


_dequantize_tiled = jax.jit(
    lambda t, ggml_type, k: kernels.gguf_dequantize(t, ggml_type, k, tiled=True),
    static_argnums=(1, 2),
)


def test_int8_activations_match_the_reference_rounding():
    """Q8_0 blocks of 32 for 32-element types: the kernel equals the pure-JAX reference's
    rounding of the activations within float summation order."""
    k, n = 576, 16
    rows = jnp.asarray(_rows("Q8_0", n, k))
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, k)).astype(np.float32))

    ref = np.asarray(_q8_blocks(x)) @ gguf_decode("Q8_0", np.asarray(rows)).T
    y = np.asarray(_linear(x, rows, ggml_type="Q8_0", int8_activations=True))
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_K"])
def test_int8_activations_round_ties_to_even_on_every_path(ggml_type, isa):
    """Rows quantized in parallel (M >= 16) and by the vector copy: halves round to even as the
    reference's, an all-zero block gives no NaN, and an Inf activation makes its row NaN."""
    k, m = 512, 20
    rows = jnp.asarray(_rows(ggml_type, 16, k))
    x = np.random.default_rng(5).standard_normal((m, k)).astype(np.float32)
    # amax 127: scale exactly 1, so these are ties in both the kernel's x * (1 / d) and x / d.
    x[:, :32] = np.resize(np.array([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -126.5], np.float32), 32)
    x[3, 32:64] = 0.0
    x[7, 100] = np.inf
    x[9, 200] = -np.inf
    ref = np.asarray(_q8_blocks(jnp.asarray(x))) @ gguf_decode(ggml_type, np.asarray(rows)).T
    y = np.asarray(_linear(jnp.asarray(x), rows, ggml_type=ggml_type, int8_activations=True))
    finite = [r for r in range(m) if r not in (7, 9)]
    assert np.isnan(y[[7, 9]]).all() and np.isfinite(y[finite]).all()
    if ggml_type == "Q8_0":  # Q8_K's blocks of 256 round other values than the reference's 32
        np.testing.assert_allclose(
            y[finite], ref[finite], rtol=0, atol=1e-4 * np.abs(ref[finite]).max()
        )


@pytest.mark.parametrize("ggml_type", ["Q5_0", "Q4_K"])
def test_nan_activations_give_nan_outputs(ggml_type):
    k = _k(ggml_type)
    rows = jnp.asarray(_rows(ggml_type, 8, k))
    x = np.ones((2, k), np.float32)
    x[1, 5] = np.nan
    for q8 in (False, True):
        y = np.asarray(_linear(jnp.asarray(x), rows, ggml_type=ggml_type, int8_activations=q8))
        assert np.isfinite(y[0]).all() and np.isnan(y[1]).all()


def test_bfloat16_in_and_out():
    rows = jnp.asarray(_rows("Q4_K", 8, 256))
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 256)), jnp.bfloat16)
    y = kernels.gguf_linear(x, rows, "Q4_K")
    assert y.dtype == jnp.bfloat16 and y.shape == (3, 8)
    ref = np.asarray(x, np.float32) @ gguf_decode("Q4_K", np.asarray(rows)).T
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, rtol=2e-2, atol=2e-2)


def test_bad_input_is_refused_by_name():
    rows = jnp.asarray(_rows("Q4_K", 8, 256))
    with pytest.raises(ValueError, match=r"uint8 \[N, 288\] for K = 512"):
        kernels.gguf_linear(jnp.ones((1, 512)), rows, "Q4_K")
    with pytest.raises(ValueError, match="no kernel"):
        kernels.gguf_linear(jnp.ones((1, 256)), rows, "TQ1_0")
    with pytest.raises(ValueError, match="whole number"):
        kernels.gguf_dequantize(rows, "Q4_K", 300)
    with pytest.raises(ValueError, match=r"tiled Q8_0 weight must be"):
        kernels.gguf_linear(jnp.ones((1, 256)), rows, "Q8_0", tiled=True)
    with pytest.raises(ValueError, match="no tiled layout"):
        kernels.gguf_tile(rows[:4], "Q4_K")
