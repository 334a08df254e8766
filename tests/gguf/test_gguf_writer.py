"""`write_gguf`: metadata with its types and streamed tensors, read back the same; a file that
does not check out is never left behind."""

import os

import gguf
import numpy as np
import pytest

from lowbit.gguf import TensorSpec, decode, encode, read_gguf, write_gguf

V = gguf.GGUFValueType


def _tensors():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 512)).astype(np.float32)
    arrays = {
        "norm.weight": rng.standard_normal(8).astype(np.float32),
        "embed.weight": rng.standard_normal((3, 16)).astype(np.float16),
        "blk.0.attn_q.weight": encode("Q4_K", w),
        "blk.0.attn_k.weight": encode("Q8_0", w[:2]),
    }
    types = {"norm.weight": "F32", "embed.weight": "F16"}
    types |= {"blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q8_0"}
    specs = [TensorSpec(n, types[n], a.shape, a.dtype) for n, a in arrays.items()]
    return arrays, specs


METADATA = [
    ("llama.block_count", 1, V.UINT32, None),
    ("general.name", "tiny", V.STRING, None),
    ("tokenizer.ggml.tokens", ["a", "b", ""], V.ARRAY, V.STRING),
    ("tokenizer.ggml.scores", [0.5, -1.0, 2.0], V.ARRAY, V.FLOAT32),
    ("general.flag", True, V.BOOL, None),
]


def test_writes_what_the_reader_reads(tmp_path):
    arrays, specs = _tensors()
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", METADATA, specs, iter(arrays.values()))
    f = read_gguf(path)
    assert f.architecture == "llama"
    assert list(f.metadata)[0] == "general.architecture"
    for key, value, vtype, sub in METADATA:
        assert f.metadata[key] == value and f.value_types[key] == (vtype, sub), key
    assert list(f.tensors) == list(arrays)
    assert f.tensors["blk.0.attn_q.weight"].shape == (4, 512)
    np.testing.assert_array_equal(
        f.tensors["blk.0.attn_q.weight"].dequantize(), decode("Q4_K", arrays["blk.0.attn_q.weight"])
    )
    for name, array in arrays.items():
        assert f.tensors[name].type_name == dict((s.name, s.ggml_type) for s in specs)[name]
        assert np.array_equal(f.tensors[name].raw.reshape(-1), array.view(np.uint8).reshape(-1))
    # gguf's own reader, independent of ours, reads the same tensors.
    theirs = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert list(theirs) == list(arrays)
    for spec in specs:
        assert theirs[spec.name].tensor_type.name == spec.ggml_type
        assert theirs[spec.name].n_bytes == spec.nbytes
    # Copied key by key with its type, a file writes again byte for byte.
    again = tmp_path / "again.gguf"
    metadata = [
        (k, v, *f.value_types[k]) for k, v in f.metadata.items() if k != "general.architecture"
    ]
    stored = [t.raw.view(s.dtype) for t, s in zip(f.tensors.values(), specs, strict=True)]
    write_gguf(again, f.architecture, metadata, specs, iter(stored))
    assert again.read_bytes() == path.read_bytes()


def test_a_file_that_does_not_check_out_is_not_left_behind(tmp_path):
    arrays, specs = _tensors()
    path = tmp_path / "m.gguf"
    path.write_bytes(b"old")
    short = [*list(arrays.values())[:-1], np.zeros(3, np.uint8)]  # the last tensor cut short
    declared = r"'blk.0.attn_k.weight' is declared Q8_0 \(2, 544\) uint8, but its data is"
    with pytest.raises(ValueError, match=declared):
        write_gguf(path, "llama", METADATA, specs, iter(short))
    with pytest.raises(ValueError, match="no data for GGUF tensor 'blk.0.attn_k.weight'"):
        write_gguf(path, "llama", METADATA, specs, iter(short[:-1]))
    with pytest.raises(ValueError, match="more arrays than the 4 GGUF tensors declared"):
        write_gguf(path, "llama", METADATA, specs, iter([*arrays.values(), short[-1]]))
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["m.gguf"]
    with pytest.raises(OSError, match="does not exist"):
        write_gguf(tmp_path / "no" / "m.gguf", "llama", METADATA, specs, iter(arrays.values()))


def test_a_written_file_that_does_not_parse_back_is_not_left_behind(tmp_path, monkeypatch):
    from lowbit.gguf import _writer

    arrays, specs = _tensors()
    path = tmp_path / "m.gguf"
    path.write_bytes(b"old")
    write = _writer._FileWriter.write_tensor_data

    def last_one_lost(self, tensor, *args, **kwargs):
        if tensor.nbytes != specs[-1].nbytes:  # the last tensor's bytes never reach the file
            write(self, tensor, *args, **kwargs)

    monkeypatch.setattr(_writer._FileWriter, "write_tensor_data", last_one_lost)
    with pytest.raises(ValueError, match="does not read back.*truncated inside tensor"):
        write_gguf(path, "llama", METADATA, specs, iter(arrays.values()))
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["m.gguf"]
