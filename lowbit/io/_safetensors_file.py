"""Reading and writing safetensors files with every dtype this library stores.

The file layout (little-endian): an 8-byte header length `n`, `n` bytes of JSON mapping tensor
names to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the data
section, which starts right after the header), then the data. The reader here parses the header
itself so that it can check every size against the file before reading a byte of data, read one
tensor at a time into its own buffer (no whole-file copy), and name the tensor that is wrong.

dtypes the format has codes for (ints, floats, bfloat16, float8 e4m3fn / e5m2) are stored as
such, so other tools read them; anything else (e.g. ``float8_e4m3fnuz``) is stored as its raw
bytes, ``uint8 [nbytes]``, and the caller records the real dtype and shape beside it.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Mapping
from typing import Any, BinaryIO

import ml_dtypes
import numpy as np
import safetensors.numpy

from lowbit._untrusted import load_json, open_regular

# numpy / ml_dtypes dtype name -> safetensors dtype code.
_CODES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "uint16": "U16",
    "int16": "I16",
    "uint32": "U32",
    "int32": "I32",
    "uint64": "U64",
    "int64": "I64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
_FROM_CODE = {code: name for name, code in _CODES.items()}
CODES = _CODES
"""numpy / ml_dtypes dtype name -> safetensors dtype code (the dtypes stored natively)."""

# Every dtype a stored array may have, by name: a fixed table, so a file can name a dtype but
# never make the reader resolve an arbitrary attribute.
_ML_DTYPES = (
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e4m3b11fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn",
    "float6_e2m3fn",
    "float6_e3m2fn",
    "int4",
    "uint4",
    "int2",
    "uint2",
)
DTYPES: dict[str, np.dtype] = {
    **{name: np.dtype(name) for name in _CODES if name not in _ML_DTYPES},
    **{name: np.dtype(getattr(ml_dtypes, name)) for name in _ML_DTYPES if hasattr(ml_dtypes, name)},
}

_MAX_HEADER = 100 * 2**20


def dtype_from_name(name: Any, what: str) -> np.dtype:
    """The dtype called `name` in `DTYPES`; ValueError naming `what` otherwise."""
    if not isinstance(name, str) or name not in DTYPES:
        raise ValueError(f"{what} has dtype {name!r}; accepted: {', '.join(sorted(DTYPES))}")
    return DTYPES[name]


def is_native(dtype: np.dtype) -> bool:
    """Whether safetensors has a dtype code for `dtype` (else it is stored as raw bytes)."""
    return np.dtype(dtype).name in _CODES


def storage_view(array: np.ndarray) -> np.ndarray:
    """The array as it is written: itself for native dtypes, else ``uint8 [nbytes]``."""
    # `np.ascontiguousarray` would turn a 0-d array into a 1-d one.
    array = np.require(array, requirements="C")
    if is_native(array.dtype):
        return array
    return array.reshape(-1).view(np.uint8)


def write_safetensors(
    path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> None:
    """Writes `tensors` (already `storage_view`s) to `path` and flushes them to disk.

    `metadata` (strings) goes into the header's ``__metadata__`` beside ``"format": "lowbit"``.
    """
    header = {"format": "lowbit", **(metadata or {})}
    safetensors.numpy.save_file(dict(tensors), path, metadata=header)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TensorEntry:
    """One header entry: dtype (numpy), shape, byte range within the file."""

    __slots__ = ("name", "dtype", "shape", "begin", "end")

    def __init__(self, name: str, dtype: np.dtype, shape: tuple[int, ...], begin: int, end: int):
        self.name, self.dtype, self.shape, self.begin, self.end = name, dtype, shape, begin, end

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(source: str | os.PathLike[str] | BinaryIO) -> dict[str, TensorEntry]:
    """Parses and checks the header of a safetensors file (a path or an open binary file).

    Returns:
      name -> `TensorEntry` with absolute file offsets, in file order.
    Raises:
      ValueError: naming the file (and tensor) when it is not a regular file, the file is too
        short for its header or data (truncated), the header is not valid JSON or names a
        tensor twice, an entry is malformed, a dtype is not one of `DTYPES`, a byte range
        disagrees with its shape and dtype, two tensors overlap, or the data section holds
        bytes no tensor does (a hole, or a tail after the last tensor).
    """
    if isinstance(source, str | os.PathLike):
        with open_regular(source) as f:
            return read_file_header(f)[0]
    return read_file_header(source)[0]


def read_file_header(f: BinaryIO) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """`read_header` of the open binary file `f`, and the header's ``__metadata__`` strings.

    Raises:
      ValueError: as `read_header`, and if ``__metadata__`` is not an object of strings.
    """
    path = f.name
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    head = f.read(8)
    if len(head) < 8:
        raise ValueError(f"{path}: truncated: {size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", head)
    if n > min(_MAX_HEADER, size - 8):
        raise ValueError(
            f"{path}: truncated or corrupt: header claims {n} bytes, file has {size - 8} "
            "after the length field"
        )
    header = load_json(f.read(n), f"{path}: header")
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError(f"{path}: header __metadata__ is not an object of strings")
    data_start = 8 + n
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(path, name, info, data_start)
    data_end = max((e.end for e in entries.values()), default=data_start)
    if size < data_end:
        last = max(entries.values(), key=lambda e: e.end)
        raise ValueError(
            f"{path}: truncated: {size} bytes but tensor {last.name!r} ends at byte {data_end}"
        )
    if size > data_end:
        raise ValueError(f"{path}: {size - data_end} bytes after the last tensor's data")
    ordered = sorted(entries.values(), key=lambda e: (e.begin, e.end))
    _check_tiling(path, ordered, data_start)
    return {e.name: e for e in ordered}, metadata


def _check_tiling(path: str, ordered: list[TensorEntry], data_start: int) -> None:
    """The format's rule: the tensors' byte ranges cover the data section exactly, each byte
    in one tensor (no overlap, which would let two tensors alias; no hole, hidden bytes)."""
    at, previous = data_start, None
    for entry in ordered:
        if entry.begin < at:
            raise ValueError(
                f"{path}: tensor {entry.name!r} (bytes {entry.begin} to {entry.end}) overlaps "
                f"tensor {previous.name!r} (ending at byte {at}); each byte of data belongs "
                "to one tensor"
            )
        if entry.begin > at:
            raise ValueError(
                f"{path}: {entry.begin - at} bytes before tensor {entry.name!r} (from byte "
                f"{at}) belong to no tensor; the data section must hold nothing but tensors"
            )
        at, previous = entry.end, entry


def _entry(path: str, name: str, info: Any, data_start: int) -> TensorEntry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict) or {"dtype", "shape", "data_offsets"} - set(info):
        raise ValueError(f"{where}: header entry {info!r} lacks dtype, shape or data_offsets")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(code, str) or code not in _FROM_CODE:
        raise ValueError(f"{where}: dtype {code!r}; accepted: {', '.join(sorted(_FROM_CODE))}")
    dtype = DTYPES[_FROM_CODE[code]]
    if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
        raise ValueError(f"{where}: shape {shape!r} is not a list of non-negative ints")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise ValueError(f"{where}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise ValueError(
            f"{where}: {end - begin} bytes for shape {shape} {dtype.name} ({expected} expected)"
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_tensor(f: Any, entry: TensorEntry) -> np.ndarray:
    """Reads one tensor from the open binary file `f` into a fresh, writable array.

    Raises:
      ValueError: if the file ends before the tensor's last byte.
    """
    buffer = np.empty(entry.nbytes, np.uint8)
    f.seek(entry.begin)
    got = f.readinto(memoryview(buffer))
    if got != entry.nbytes:
        raise ValueError(f"{f.name}: truncated inside tensor {entry.name!r}")
    return buffer.view(entry.dtype).reshape(entry.shape)
