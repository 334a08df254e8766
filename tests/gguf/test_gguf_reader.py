"""`read_gguf`: metadata, raw blocks and dequantization, against the `gguf` package."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from lowbit import models
from lowbit.gguf import read_gguf


def _write_small_gguf(path, arch: str = "llama") -> dict[str, np.ndarray]:
    """A small GGUF with every metadata value kind and F32/Q8_0/Q4_0/Q4_1 tensors."""
    rng = np.random.default_rng(0)
    tensors = {
        "a.f32": rng.standard_normal((3, 8)).astype(np.float32),
        "b.q8_0": rng.standard_normal((4, 64)).astype(np.float32),
        "c.q4_0": rng.standard_normal((2, 32)).astype(np.float32),
        "d.q4_1": rng.standard_normal((5, 3, 96)).astype(np.float32),
    }
    kinds = {
        "a.f32": gguf.GGMLQuantizationType.F32,
        "b.q8_0": gguf.GGMLQuantizationType.Q8_0,
        "c.q4_0": gguf.GGMLQuantizationType.Q4_0,
        "d.q4_1": gguf.GGMLQuantizationType.Q4_1,
    }
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32("t.u32", 7)
    w.add_int32("t.i32", -3)
    w.add_float32("t.f32", 0.5)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.strs", ["x", "yz", ""])
    w.add_array("t.ints", [1, 2, 3])
    w.add_uint64("t.u64", 2**40)
    for name, x in tensors.items():
        q = gguf.quants.quantize(x, kinds[name])
        w.add_tensor(name, q, raw_dtype=kinds[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def test_matches_gguf_reader_on_small_file(tmp_path):
    path = tmp_path / "small.gguf"
    _write_small_gguf(path)
    ours = read_gguf(path)
    ref = gguf.GGUFReader(str(path))
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == field.contents(), key
    assert ours.metadata["t.strs"] == ["x", "yz", ""]
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.ggml_type == t.tensor_type
        assert mine.shape == tuple(reversed(t.shape.tolist()))
        assert np.array_equal(mine.raw.reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))
        expected = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        assert np.array_equal(mine.dequantize(), np.asarray(expected).reshape(mine.shape))


def test_smollm2_file_layout(smollm2_file):
    f = smollm2_file
    assert f.architecture == "llama"
    assert len(f.tensors) == 272
    kinds = {}
    for t in f.tensors.values():
        kinds[t.type_name] = kinds.get(t.type_name, 0) + 1
    assert kinds == {"Q8_0": 1, "Q4_1": 210, "F32": 61}
    embed = f.tensor("token_embd.weight")
    assert (embed.shape, embed.raw.shape, embed.blocks().shape) == (
        (49152, 576),
        (49152, 18 * 34),
        (49152, 18, 34),
    )
    q = f.tensor("blk.0.attn_q.weight")
    assert (q.shape, q.block_size, q.type_size, q.blocks().shape) == (
        (576, 576),
        32,
        20,
        (576, 18, 20),
    )
    assert f.tensor("blk.0.ffn_down.weight").shape == (576, 1536)
    with pytest.raises(ValueError, match="blk.99.attn_q.weight"):
        f.tensor("blk.99.attn_q.weight")


def test_q4_1_and_q8_0_block_layout(smollm2_file):
    """Decode a few blocks by hand from the documented layout; compare with `dequantize`."""
    q = smollm2_file.tensor("blk.3.ffn_up.weight")
    full = q.dequantize()
    for row, blk in [(0, 0), (7, 5), (1535, 17)]:
        b = q.blocks()[row, blk]
        d, m = b[0:2].view(np.float16)[0], b[2:4].view(np.float16)[0]
        codes = [b[4 + j] & 0xF for j in range(16)] + [b[4 + j] >> 4 for j in range(16)]
        expect = np.float32(d) * np.array(codes, np.float32) + np.float32(m)
        np.testing.assert_array_equal(full[row, blk * 32 : (blk + 1) * 32], expect)
    e = smollm2_file.tensor("token_embd.weight")
    b = e.blocks()[12345, 3]
    expect = np.float32(b[0:2].view(np.float16)[0]) * b[2:].view(np.int8).astype(np.float32)
    np.testing.assert_array_equal(e.dequantize()[12345, 96:128], expect)


def test_dequantize_matches_gguf_package(smollm2_file):
    for name in ["blk.0.attn_k.weight", "blk.29.ffn_down.weight", "output_norm.weight"]:
        t = smollm2_file.tensor(name)
        ref = np.asarray(gguf.quants.dequantize(t.raw, t.ggml_type)).reshape(t.shape)
        np.testing.assert_array_equal(t.dequantize(), ref)
    e = smollm2_file.tensor("token_embd.weight")
    ref = np.asarray(gguf.quants.dequantize(e.raw[:512], e.ggml_type))
    np.testing.assert_array_equal(e.dequantize()[:512], ref)


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not gguf at all")
    with pytest.raises(ValueError, match="bad magic"):
        read_gguf(junk)
    path = tmp_path / "bert.gguf"
    _write_small_gguf(path, arch="bert")
    with pytest.raises(ValueError, match="'bert'"):
        models.decoder_config_from_gguf(read_gguf(path))
    # A tensor whose ggml type id this gguf package does not know: the error names the file
    # and the tensor. Tensor info: name, n_dims (u32), dims (u64 each), type (u32), offset.
    raw = bytearray(path.read_bytes())
    name = b"a.f32"
    at = raw.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    at += 4 + 8 * int.from_bytes(raw[at : at + 4], "little")
    raw[at : at + 4] = (999).to_bytes(4, "little")
    bad = tmp_path / "bad_type.gguf"
    bad.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"bad_type\.gguf.*'a\.f32'.*unknown ggml type 999"):
        read_gguf(bad)


def test_value_types_match_gguf_reader(tmp_path):
    path = tmp_path / "small.gguf"
    _write_small_gguf(path)
    ours = read_gguf(path)
    ref = gguf.GGUFReader(str(path))
    assert list(ours.value_types) == list(ours.metadata)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        vtype, item_type = ours.value_types[key]
        assert vtype == field.types[0], key
        assert item_type == (field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None), key
