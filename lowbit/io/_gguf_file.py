"""A lean GGUF reader: metadata as Python values, tensors as raw bytes of a memory map.

GGUF (little-endian): magic ``GGUF``, version (2 or 3), tensor count, key/value count, the
key/values, then per tensor its name, dims (ggml order: fastest-varying first), type and offset
into the data section, which starts at the next multiple of ``general.alignment``. Shapes here are
in NumPy order (the reverse of ggml's), so a linear weight is ``[out, in]`` and quantization
blocks run along the last axis. `gguf.GGUFReader` reads the same layout but builds a NumPy view
per vocabulary string, which takes seconds for a 49k-token vocabulary; this reader decodes
numeric arrays in one call and reads strings directly.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
from typing import Any

import gguf
import numpy as np

_SCALARS = {
    gguf.GGUFValueType.UINT8: "<B",
    gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H",
    gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I",
    gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.UINT64: "<Q",
    gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT32: "<f",
    gguf.GGUFValueType.FLOAT64: "<d",
    gguf.GGUFValueType.BOOL: "<?",
}


@dataclasses.dataclass(frozen=True, eq=False)
class GGUFTensorData:
    """One stored tensor.

    Attributes:
      name: GGUF name, e.g. ``"blk.0.attn_q.weight"``.
      ggml_type: storage type, e.g. ``gguf.GGMLQuantizationType.Q4_1``.
      shape: logical shape, NumPy order.
      raw: ``uint8 [*shape[:-1], row_bytes]``, read-only view of the file.
    """

    name: str
    ggml_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    raw: np.ndarray


class _Reader:
    """Sequential little-endian reads from the header bytes."""

    def __init__(self, buf: memoryview, path: str):
        self.buf, self.pos, self.path = buf, 0, path

    def number(self, code: str) -> Any:
        try:
            (value,) = struct.unpack_from(code, self.buf, self.pos)
        except struct.error:
            raise ValueError(f"{self.path}: truncated GGUF header at byte {self.pos}") from None
        self.pos += struct.calcsize(code)
        return value

    def string(self) -> str:
        n = self.number("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF header at byte {self.pos}")
        text = str(self.buf[self.pos : self.pos + n], "utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        if vtype == gguf.GGUFValueType.STRING:
            return self.string()
        if vtype == gguf.GGUFValueType.ARRAY:
            item_type, count = self.number("<I"), self.number("<Q")
            if item_type in _SCALARS:
                # Numeric arrays (token scores and types) are long: decode them in one call.
                dtype = np.dtype(_SCALARS[item_type])
                if self.pos + count * dtype.itemsize > len(self.buf):
                    raise ValueError(f"{self.path}: truncated GGUF header at byte {self.pos}")
                values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
                self.pos += count * dtype.itemsize
                return values
            return [self.value(item_type) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")
        return self.number(_SCALARS[vtype])


def read_gguf_file(
    path: str | os.PathLike[str],
) -> tuple[dict[str, Any], dict[str, GGUFTensorData]]:
    """Reads a GGUF file's metadata and tensor table.

    Returns:
      ``(metadata, tensors)``: key -> Python value; name -> `GGUFTensorData`, in file order.
    Raises:
      ValueError: naming the file for a bad magic number, an unsupported version, an unknown
        tensor or value type, a row length that is not a whole number of blocks, or a file
        that ends inside the header or a tensor.
    """
    path = os.fspath(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    reader = _Reader(memoryview(data), path)
    if reader.number("<I") != gguf.GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (bad magic number)")
    version = reader.number("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version}; accepted: 2, 3")
    n_tensors, n_keys = reader.number("<Q"), reader.number("<Q")
    metadata = {}
    for _ in range(n_keys):
        key = reader.string()
        metadata[key] = reader.value(reader.number("<I"))
    table = []
    for _ in range(n_tensors):
        name = reader.string()
        dims = [reader.number("<Q") for _ in range(reader.number("<I"))]
        type_id = reader.number("<I")
        try:
            ggml_type = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"{path}: tensor {name!r} has unknown ggml type {type_id}") from None
        table.append((name, tuple(reversed(dims)), ggml_type, reader.number("<Q")))
    alignment = int(metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    start = -(-reader.pos // alignment) * alignment
    tensors = {}
    for name, shape, ggml_type, offset in table:
        block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        if not shape or shape[-1] % block:
            raise ValueError(
                f"{path}: tensor {name!r} of shape {shape} is not whole {ggml_type.name} "
                f"blocks of {block} along its last axis"
            )
        row_bytes = shape[-1] // block * type_size
        begin = start + offset
        end = begin + math.prod(shape[:-1]) * row_bytes
        if end > data.size:
            raise ValueError(f"{path}: truncated inside tensor {name!r}")
        raw = np.asarray(data[begin:end]).reshape(*shape[:-1], row_bytes)
        tensors[name] = GGUFTensorData(name, ggml_type, shape, raw)
    return metadata, tensors
