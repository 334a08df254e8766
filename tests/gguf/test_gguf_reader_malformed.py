"""`read_gguf` on malformed files: one error type (`GGUFError`) naming the file and tensor."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from lowbit.gguf import GGUFError, read_gguf
from lowbit.io import import_gguf

F32 = int(gguf.GGMLQuantizationType.F32)
U32 = int(gguf.GGUFValueType.UINT32)
STRING = int(gguf.GGUFValueType.STRING)
ARRAY = int(gguf.GGUFValueType.ARRAY)


def _string(raw: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def _gguf_bytes(
    tensors=((b"w", (4, 2), F32, 0),),
    kv=(),
    n_tensors: int | None = None,
    n_kv: int | None = None,
    alignment: int = 32,
) -> bytes:
    """A GGUF v3 file by hand: tensors are (name, NumPy shape, type id, offset), kv are
    (key bytes, value type, encoded value); F32 data of the given shapes follows."""
    out = struct.pack(
        "<IIQQ",
        gguf.GGUF_MAGIC,
        3,
        len(tensors) if n_tensors is None else n_tensors,
        len(kv) if n_kv is None else n_kv,
    )
    for key, vtype, value in kv:
        out += _string(key) + struct.pack("<I", vtype) + value
    for name, shape, type_id, offset in tensors:
        out += _string(name) + struct.pack("<I", len(shape))
        out += b"".join(struct.pack("<Q", d) for d in reversed(shape))
        out += struct.pack("<IQ", type_id, offset)
    out += b"\0" * (-len(out) % alignment)
    size = sum(4 * int(np.prod(shape)) for _, shape, _, _ in tensors)
    return out + np.arange(size // 4, dtype=np.float32).tobytes()


def _write(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_well_formed_hand_written_file_reads(tmp_path):
    path = _write(tmp_path, "ok.gguf", _gguf_bytes(kv=((b"a.b", U32, struct.pack("<I", 7)),)))
    f = read_gguf(path)
    assert f.metadata == {"a.b": 7}
    np.testing.assert_array_equal(f.tensor("w").dequantize(), np.arange(8.0).reshape(4, 2))


BAD_NAME = b"bad\xff\xfename"


@pytest.mark.parametrize(
    "data, fragment",
    [
        (_gguf_bytes(n_tensors=2**40), "tensor count 1099511627776"),
        (_gguf_bytes(n_kv=2**40), "metadata key count 1099511627776"),
        (_gguf_bytes(tensors=((BAD_NAME, (4, 2), F32, 0),)), "name of tensor #0 .*not valid UTF-8"),
        (_gguf_bytes(kv=((BAD_NAME, U32, b"\0" * 4),)), "metadata key #0 .*not valid UTF-8"),
        (
            _gguf_bytes(kv=((b"k", STRING, _string(b"\xc3\x28")),)),
            "string value of metadata key 'k' .*not valid UTF-8",
        ),
        (
            _gguf_bytes(kv=((b"k", STRING, _string(b"abc", length=2**62)),)),
            "length of string value of metadata key 'k' 4611686018427387904",
        ),
        (
            _gguf_bytes(
                kv=(
                    (
                        b"k",
                        ARRAY,
                        struct.pack("<IQ", STRING, 2) + _string(b"ok") + _string(b"\xc3\x28"),
                    ),
                )
            ),
            "string value of metadata key 'k' at byte 59 is not valid UTF-8",
        ),
        (
            _gguf_bytes(
                kv=(
                    (
                        b"k",
                        ARRAY,
                        struct.pack("<IQ", STRING, 2) + _string(b"ok") + _string(b"a", 2**62),
                    ),
                )
            ),
            "length of string value of metadata key 'k' 4611686018427387904 at byte 59",
        ),
        (
            _gguf_bytes(kv=((b"k", ARRAY, struct.pack("<IQ", ARRAY, 1) * 5000),)),
            "metadata key 'k' nests arrays deeper than",
        ),
        (
            _gguf_bytes(kv=((b"k", ARRAY, struct.pack("<IQ", U32, 2**40)),)),
            "length of array metadata key 'k'",
        ),
        (_gguf_bytes(tensors=((b"scalar", (), F32, 0),)), "tensor 'scalar' has 0 dimensions"),
        (
            _gguf_bytes(tensors=((b"w", (4, 2), F32, 0), (b"w", (4, 2), F32, 32))),
            "two tensors are named 'w'",
        ),
        (
            _gguf_bytes(kv=((b"k", U32, b"\0" * 4), (b"k", U32, b"\0" * 4))),
            "metadata key 'k' appears twice",
        ),
        (
            _gguf_bytes(kv=((b"general.alignment", U32, struct.pack("<I", 0)),)),
            "general.alignment is 0",
        ),
        (_gguf_bytes(tensors=((b"w", (4, 2), F32, 2**40),)), "truncated inside tensor 'w'"),
        (
            _gguf_bytes().replace(struct.pack("<QQ", 2, 4), struct.pack("<QQ", 2**20, 2**30)),
            r"tensor 'w': it declares 4503599627370496 bytes",
        ),
        (
            _gguf_bytes(tensors=((b"w", (0, 2), F32, 0),)),
            r"tensor 'w' has shape \(0, 2\), with a zero",
        ),
        (_gguf_bytes(tensors=((b"w", (4, 0), F32, 0),)), "zero-sized dimension"),
        (_gguf_bytes(tensors=((b"w", (4, 2), F32, 4),)), "data offset 4, not a multiple of the"),
        (
            _gguf_bytes(kv=((b"general.alignment", U32, struct.pack("<I", 24)),)),
            "general.alignment is 24; it must be a power of two",
        ),
        (_gguf_bytes()[:60], "truncated at byte 57"),
        (b"", "is empty"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_malformed_files_raise_one_error_naming_the_file(tmp_path, data, fragment):
    path = _write(tmp_path, "bad.gguf", data)
    with pytest.raises(GGUFError, match=rf"'{path}'.*{fragment}|{fragment}.*'{path}'"):
        read_gguf(path)


def test_import_gguf_reports_the_same_error(tmp_path):
    path = _write(tmp_path, "dup.gguf", _gguf_bytes(tensors=((b"w", (4, 2), F32, 0),) * 2))
    with pytest.raises(GGUFError, match="two tensors are named 'w'"):
        import_gguf(path)
    assert issubclass(GGUFError, ValueError)
