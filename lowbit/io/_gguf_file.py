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
    gguf.GGUFValueType.UINT8: "<u1",
    gguf.GGUFValueType.INT8: "<i1",
    gguf.GGUFValueType.UINT16: "<u2",
    gguf.GGUFValueType.INT16: "<i2",
    gguf.GGUFValueType.UINT32: "<u4",
    gguf.GGUFValueType.INT32: "<i4",
    gguf.GGUFValueType.UINT64: "<u8",
    gguf.GGUFValueType.INT64: "<i8",
    gguf.GGUFValueType.FLOAT32: "<f4",
    gguf.GGUFValueType.FLOAT64: "<f8",
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
    def __init__(self, data: np.ndarray, path: str):
        self.data, self.pos, self.path = data, 0, path

    def take(self, n: int) -> np.ndarray:
        if self.pos + n > self.data.size:
            raise ValueError(f"{self.path}: truncated GGUF header at byte {self.pos}")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def number(self, code: str) -> Any:
        dtype = np.dtype(code)
        return self.take(dtype.itemsize).view(dtype)[0].item()

    def string(self) -> str:
        return bytes(self.take(self.number("<u8"))).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == gguf.GGUFValueType.STRING:
            return self.string()
        if vtype == gguf.GGUFValueType.ARRAY:
            item_type, count = self.number("<u4"), self.number("<u8")
            if item_type in _SCALARS:
                dtype = np.dtype(_SCALARS[item_type])
                return self.take(count * dtype.itemsize).view(dtype).tolist()
            return [self.value(item_type) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")
        return self.number(_SCALARS[vtype])


def read_gguf_file(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, GGUFTensorData]]:
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
    reader = _Reader(data, path)
    if bytes(reader.take(4)) != struct.pack("<I", gguf.GGUF_MAGIC):
        raise ValueError(f"{path}: not a GGUF file (bad magic number)")
    version = reader.number("<u4")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version}; accepted: 2, 3")
    n_tensors, n_keys = reader.number("<u8"), reader.number("<u8")
    metadata = {}
    for _ in range(n_keys):
        key = reader.string()
        metadata[key] = reader.value(reader.number("<u4"))
    table = []
    for _ in range(n_tensors):
        name = reader.string()
        dims = [reader.number("<u8") for _ in range(reader.number("<u4"))]
        type_id = reader.number("<u4")
        try:
            ggml_type = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"{path}: tensor {name!r} has unknown ggml type {type_id}") from None
        table.append((name, tuple(reversed(dims)), ggml_type, reader.number("<u8")))
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
