"""Read a GGUF file into metadata plus raw, still-quantized tensor blocks.

GGUF tensors are stored row-major with ggml's dimension order reversed relative to NumPy; here
every shape is given in NumPy order, so a linear layer's weight is `[out_features,
in_features]` and quantization blocks run along the last (input) axis.

The raw bytes of each tensor are kept as a `uint8` array of shape `[*shape[:-1], row_bytes]`, so
that an importer can reinterpret Q8_0 / Q4_0 / Q4_1 blocks directly as quantized arrays without
a float round trip. Block layouts (all little-endian, 32 elements per block):

  * Q8_0 (34 bytes): fp16 scale `d`, then 32 int8 codes; `x = d * q`.
  * Q4_0 (18 bytes): fp16 scale `d`, then 16 bytes of nibbles; `x = d * (q - 8)`.
  * Q4_1 (20 bytes): fp16 scale `d`, fp16 min `m`, then 16 bytes of nibbles; `x = d * q + m`.

In the 4-bit formats byte `j` of a block holds element `j` in its low nibble and element
`j + 16` in its high nibble.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
from typing import Any

import gguf
import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class GGUFTensor:
    """One tensor of a GGUF file, still in its stored encoding.

    Attributes:
      name: GGUF tensor name, e.g. ``"blk.0.attn_q.weight"``.
      ggml_type: the storage type (``gguf.GGMLQuantizationType``), e.g. ``Q4_1``.
      shape: logical shape in NumPy order, e.g. ``(576, 576)`` for `[out, in]`.
      raw: ``uint8`` array ``[*shape[:-1], row_bytes]``: the stored bytes of each row.
    """

    name: str
    ggml_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    raw: np.ndarray

    @property
    def type_name(self) -> str:
        """Short name of the storage type, e.g. ``"Q4_1"``."""
        return self.ggml_type.name

    @property
    def block_size(self) -> int:
        """Elements per block along the last axis (1 for plain float types)."""
        return gguf.GGML_QUANT_SIZES[self.ggml_type][0]

    @property
    def type_size(self) -> int:
        """Bytes per block."""
        return gguf.GGML_QUANT_SIZES[self.ggml_type][1]

    def blocks(self) -> np.ndarray:
        """The raw bytes split into blocks: ``uint8 [*shape[:-1], n_blocks, type_size]``."""
        return self.raw.reshape(*self.shape[:-1], -1, self.type_size)

    def dequantize(self) -> np.ndarray:
        """The tensor as ``float32`` of shape `shape`."""
        fast = _DEQUANTIZE.get(self.ggml_type)
        if fast is not None:
            return fast(self.blocks()).reshape(self.shape)
        try:
            values = gguf.quants.dequantize(self.raw, self.ggml_type)
        except NotImplementedError as err:
            raise ValueError(
                f"tensor {self.name!r} has storage type {self.type_name}, which cannot be "
                "dequantized"
            ) from err
        return np.asarray(values, dtype=np.float32).reshape(self.shape)


# Whole-tensor NumPy decoders for the common types (the `gguf` package's generic path works
# 16 rows at a time, which takes seconds on a 49k-row embedding). blocks: [..., n, type_size].


def _fp16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of each block, as float32 [..., n, 1]."""
    return blocks[..., at : at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: low nibbles are elements 0-15, high ones 16-31."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.float32)


def _dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    return _fp16(blocks, 0) * blocks[..., 2:].view(np.int8).astype(np.float32)


def _dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    return _fp16(blocks, 0) * (_nibbles(blocks[..., 2:]) - 8.0)


def _dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    return _fp16(blocks, 0) * _nibbles(blocks[..., 4:]) + _fp16(blocks, 2)


_DEQUANTIZE = {
    gguf.GGMLQuantizationType.F32: lambda b: b.copy().view(np.float32),
    gguf.GGMLQuantizationType.F16: lambda b: b.copy().view(np.float16).astype(np.float32),
    gguf.GGMLQuantizationType.Q8_0: _dequantize_q8_0,
    gguf.GGMLQuantizationType.Q4_0: _dequantize_q4_0,
    gguf.GGMLQuantizationType.Q4_1: _dequantize_q4_1,
}


@dataclasses.dataclass(frozen=True, eq=False)
class GGUFFile:
    """Metadata and tensors of one GGUF file.

    Attributes:
      path: where it was read from.
      metadata: key/value metadata with plain Python values (strings, numbers, bools, lists),
        e.g. ``metadata["llama.block_count"] == 30``.
      tensors: tensors by GGUF name, in file order.
    """

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        """The ``general.architecture`` value, e.g. ``"llama"``."""
        return str(self.metadata.get("general.architecture", ""))

    def tensor(self, name: str) -> GGUFTensor:
        """The tensor called `name`; ValueError naming it when the file has none."""
        if name not in self.tensors:
            raise ValueError(f"GGUF file {self.path!r} has no tensor named {name!r}")
        return self.tensors[name]


# Scalar metadata value types, as `struct` codes (little-endian).
_SCALAR_FORMATS = {
    gguf.GGUFValueType.UINT8: "<B",
    gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H",
    gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I",
    gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f",
    gguf.GGUFValueType.BOOL: "<?",
    gguf.GGUFValueType.UINT64: "<Q",
    gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT64: "<d",
}


class _Cursor:
    """Sequential little-endian reads from the file header."""

    def __init__(self, buf: memoryview, path: str):
        self.buf = buf
        self.pos = 0
        self.path = path

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error as err:
            raise ValueError(f"GGUF file {self.path!r} is truncated at byte {self.pos}") from err
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        value = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return value

    def value(self, vtype: int) -> Any:
        if vtype == gguf.GGUFValueType.STRING:
            return self.string()
        if vtype == gguf.GGUFValueType.ARRAY:
            item_type = self.unpack("<I")
            n = self.unpack("<Q")
            fmt = _SCALAR_FORMATS.get(item_type)
            if fmt is not None:
                # Numeric arrays (token types, scores) are long: decode them in one go.
                dtype = np.dtype(fmt)
                values = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
                self.pos += n * dtype.itemsize
                return values.tolist()
            return [self.value(item_type) for _ in range(n)]
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise ValueError(f"GGUF file {self.path!r} has unknown value type {vtype}")
        return self.unpack(fmt)


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Read a GGUF file's metadata and raw tensors.

    Tensor bytes are read-only memory-mapped views of the file, so reading is cheap and nothing
    is dequantized until asked. The header is parsed directly (the layout `gguf.GGUFReader`
    reads) because building that reader's per-string views of a 49k-token vocabulary takes
    seconds; value and tensor types are the `gguf` package's enums.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"path {path!r} is not a GGUF file")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(data), path)
    if cur.unpack("<I") != gguf.GGUF_MAGIC:
        raise ValueError(f"path {path!r} is not a GGUF file (bad magic)")
    version = cur.unpack("<I")
    if version not in (2, 3):
        # A byte-swapped version number means a big-endian file.
        raise ValueError(f"GGUF file {path!r} has unsupported version {version}")
    n_tensors = cur.unpack("<Q")
    n_kv = cur.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I")
        ggml_dims = [cur.unpack("<Q") for _ in range(n_dims)]
        type_id = cur.unpack("<I")
        try:
            ggml_type = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(
                f"GGUF file {path!r}: tensor {name!r} has unknown ggml type {type_id}; this gguf "
                "package knows " + ", ".join(t.name for t in gguf.GGMLQuantizationType)
            ) from None
        offset = cur.unpack("<Q")
        infos.append((name, tuple(reversed(ggml_dims)), ggml_type, offset))
    alignment = int(metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, shape, ggml_type, offset in infos:
        block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        if shape[-1] % block_size:
            raise ValueError(
                f"GGUF file {path!r}: tensor {name!r} has row length {shape[-1]}, not a "
                f"multiple of the {ggml_type.name} block size {block_size}"
            )
        row_bytes = shape[-1] // block_size * type_size
        n_bytes = math.prod(shape[:-1]) * row_bytes
        begin = data_start + offset
        if begin + n_bytes > data.size:
            raise ValueError(f"GGUF file {path!r} is truncated inside tensor {name!r}")
        raw = np.asarray(data[begin : begin + n_bytes]).reshape(*shape[:-1], row_bytes)
        tensors[name] = GGUFTensor(name=name, ggml_type=ggml_type, shape=shape, raw=raw)
    return GGUFFile(path=path, metadata=metadata, tensors=tensors)
