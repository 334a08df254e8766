"""The block type registry is the one list of GGUF block types: sizes and ids agree with the
`gguf` package, and every other list of GGML types in lowbit is drawn from it."""

import gguf
import jax
import numpy as np
import pytest
from gguf_support import TYPES, weights

from lowbit.formats import GGUF_BLOCK_FORMATS, GGUF_ELEMENT_FORMATS
from lowbit.gguf import BLOCK_TYPES, FLOAT_TYPES, GGUFTensor, block_type, decode, encode, split
from lowbit.io import gguf_tensor_to_qarray
from lowbit.io._gguf_export import EXPORT_TYPES
from lowbit.io._gguf_mixes import MIXES
from lowbit.kernels._kinds import GGUF_KINDS, GGUF_TYPE_IDS


@pytest.mark.parametrize("name", TYPES)
def test_sizes_and_ids_agree_with_the_gguf_package(name):
    t = block_type(name)
    assert t.name == name and BLOCK_TYPES[name] is t
    assert t.ggml_type is gguf.GGMLQuantizationType[name]
    assert t.ggml_id == gguf.GGMLQuantizationType[name].value
    assert (t.block_size, t.type_size) == gguf.GGML_QUANT_SIZES[t.ggml_type]
    assert t.bits_per_value == t.type_size * 8 / t.block_size


def test_unknown_type_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown GGUF block type 'Q7_K'; accepted: Q8_0, Q4_0"):
        block_type("Q7_K")


def test_formats_hold_every_type_once():
    blocks = [f.ggml_type for f in GGUF_BLOCK_FORMATS]
    assert sorted(blocks + list(GGUF_ELEMENT_FORMATS)) == sorted(BLOCK_TYPES)
    assert not set(blocks) & set(GGUF_ELEMENT_FORMATS)


def test_import_keeps_the_registry_types():
    for name, t in BLOCK_TYPES.items():
        raw = np.zeros((1, t.type_size), np.uint8)
        q = gguf_tensor_to_qarray(GGUFTensor("t", t.ggml_type, (1, t.block_size), raw))
        assert q.format == GGUF_ELEMENT_FORMATS.get(name, name.lower())
    f16 = GGUFTensor("t", gguf.GGMLQuantizationType.F16, (1, 2), np.zeros((1, 4), np.uint8))
    with pytest.raises(ValueError, match="direct import accepts " + ", ".join(BLOCK_TYPES)):
        gguf_tensor_to_qarray(f16)


def test_export_accepts_the_registry_types():
    quantized = [t for t in EXPORT_TYPES if t not in FLOAT_TYPES + MIXES]
    assert quantized == list(BLOCK_TYPES)


def test_kernel_types_are_registry_types():
    assert set(GGUF_TYPE_IDS) <= set(BLOCK_TYPES)
    assert sorted(GGUF_TYPE_IDS.values()) == list(range(len(GGUF_TYPE_IDS)))  # compiled ids
    assert GGUF_KINDS == tuple(t.lower() for t in GGUF_TYPE_IDS)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL"])
def test_split_fields_decode_to_the_values(name):
    t = block_type(name)
    raw = encode(name, weights(3, 64))
    d, m, q = split(name, raw)
    for ours, traced in zip((d, m, q), jax.jit(t.split)(raw), strict=True):
        assert (ours is None) == (traced is None)
        if ours is not None:
            assert ours.dtype == traced.dtype
            np.testing.assert_array_equal(ours, np.asarray(traced))
    assert d.shape == (3, 2) and (m is None or m.shape == (3, 2)) and q.shape == (3, 64)
    q = q.reshape(3, 2, 32).astype(np.float32)
    offset = {"Q4_0": 8, "Q5_0": 16}.get(name, 0)
    if name == "IQ4_NL":
        q = np.asarray(gguf.quants.IQ4_NL.kvalues, np.float32)[q.astype(np.int64)]
    values = d[..., None] * (q - offset) + (0 if m is None else m[..., None])
    np.testing.assert_array_equal(values.reshape(3, 64), decode(name, raw))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL"])
def test_join_rebuilds_the_blocks_split_took_apart(name):
    t = block_type(name)
    raw = np.asarray(encode(name, weights(3, 64)))
    d, m, q = t.split(raw)
    np.testing.assert_array_equal(np.asarray(t.join(d, m, q)), raw)
    np.testing.assert_array_equal(np.asarray(jax.jit(t.join)(d, m, q)), raw)


def test_join_refuses_the_256_element_types_and_partial_blocks():
    with pytest.raises(ValueError, match="Q4_K blocks have no scale / minimum / codes split"):
        block_type("Q4_K").join(np.zeros(1), None, np.zeros((1, 256), np.uint8))
    with pytest.raises(ValueError, match="multiple of 32, got shape \\(1, 31\\)"):
        block_type("Q4_0").join(np.zeros((1, 1)), None, np.zeros((1, 31), np.uint8))


def test_split_refuses_the_256_element_types():
    with pytest.raises(ValueError, match="Q4_K blocks have no scale / minimum / codes split"):
        block_type("Q4_K").split(np.zeros((1, 144), np.uint8))
    with pytest.raises(ValueError, match="Q4_K blocks have no scale / minimum / codes split"):
        split("Q4_K", np.zeros((1, 144), np.uint8))
    with pytest.raises(ValueError, match="multiple of 18 bytes"):
        split("Q4_0", np.zeros((1, 17), np.uint8))


def test_traced_codecs_match_the_compiled_ones():
    x = weights(4, 256)
    t = block_type("Q4_K")
    raw = np.asarray(jax.jit(t.encode)(x))
    np.testing.assert_array_equal(raw, encode("Q4_K", x))
    np.testing.assert_array_equal(np.asarray(jax.jit(t.decode)(raw)), decode("Q4_K", raw))


def test_decode_of_many_blocks_crosses_chunk_boundaries():
    # More blocks than one large chunk holds, and a remainder over several small chunks.
    name = "Q8_0"
    t = block_type(name)
    n_blocks = (1 << 20) // t.block_size + 3 * (1 << 14) // t.block_size + 5
    raw = np.random.default_rng(0).integers(0, 256, (n_blocks, t.type_size), np.uint8)
    raw[:, 1] &= 0x3B  # finite float16 scales
    got = decode(name, raw.reshape(1, -1))
    np.testing.assert_array_equal(got, decode(name, raw).reshape(1, -1))
    ref = gguf.quants.dequantize(raw.reshape(1, -1), gguf.GGMLQuantizationType[name])
    np.testing.assert_array_equal(got, ref)
