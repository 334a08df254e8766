"""Read a GGUF file: its header parsed once, each tensor a lazy view of its stored blocks.

GGUF tensors are stored row-major with ggml's dimension order reversed relative to NumPy; here
every shape is given in NumPy order, so a linear layer's weight is `[out_features,
in_features]` and quantization blocks run along the last (input) axis.

The raw bytes of each tensor are a read-only memory-mapped `uint8` view of shape
`[*shape[:-1], row_bytes]`, so that an importer can keep the blocks as they are stored (see
`lowbit.gguf._types` for the layouts) and nothing is read or decoded until asked.
`GGUFTensor.dequantize` decodes the types of `lowbit.gguf.BLOCK_TYPES` with their codecs and
any other ggml type with the `gguf` package's.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
from typing import Any

import gguf
import numpy as np

from lowbit._untrusted import open_regular
from lowbit.gguf._types import BLOCK_TYPES, decode


class GGUFError(ValueError):
    """A file that is not a well-formed GGUF file: the message names the file (and the tensor
    or metadata key) and what is wrong."""


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
        """The tensor as ``float32`` of shape `shape`: F32 and F16 as stored, the block types
        of `lowbit.gguf.BLOCK_TYPES` by their decoders (bit-identical to llama.cpp's), any
        other type by `gguf.quants.dequantize`.

        Raises:
          ValueError: naming the tensor, for a type neither decodes.
        """
        name = self.type_name
        if name == "F32":
            return self.raw.copy().view(np.float32).reshape(self.shape)
        if name == "F16":
            return self.raw.copy().view(np.float16).astype(np.float32).reshape(self.shape)
        if name in BLOCK_TYPES:
            return decode(name, self.raw).reshape(self.shape)
        try:
            values = gguf.quants.dequantize(self.raw, self.ggml_type)
        except NotImplementedError as err:
            raise ValueError(
                f"tensor {self.name!r} has storage type {self.type_name}, which cannot be "
                "dequantized"
            ) from err
        return np.asarray(values, dtype=np.float32).reshape(self.shape)


@dataclasses.dataclass(frozen=True, eq=False)
class GGUFFile:
    """Metadata and tensors of one GGUF file.

    Attributes:
      path: where it was read from.
      metadata: key/value metadata with plain Python values (strings, numbers, bools, lists),
        e.g. ``metadata["llama.block_count"] == 30``, in file order.
      tensors: tensors by GGUF name, in file order.
      value_types: each metadata key's stored type (``gguf.GGUFValueType``) and, for an array,
        its items' type (None otherwise, or for an empty array of a type this package does not
        know), e.g. ``(ARRAY, STRING)`` for ``tokenizer.ggml.tokens``: what a writer needs to
        copy the key as it is.
    """

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    value_types: dict[str, tuple[gguf.GGUFValueType, gguf.GGUFValueType | None]] = (
        dataclasses.field(default_factory=dict)
    )

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


# Limits that no real file reaches but that keep a corrupt header from running away: ggml
# tensors have 1 to 4 dimensions, and GGUF arrays nest (arrays of arrays) only a few levels.
_MAX_DIMS = 4
_MAX_ARRAY_DEPTH = 8


class _Cursor:
    """Sequential little-endian reads from the file header; every failure is a `GGUFError`."""

    def __init__(self, buf: memoryview, path: str):
        self.buf = buf
        self.pos = 0
        self.path = path

    def fail(self, message: str) -> GGUFError:
        return GGUFError(f"GGUF file {self.path!r}: {message}")

    def remaining(self) -> int:
        return len(self.buf) - self.pos

    def unpack(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise self.fail(f"truncated at byte {self.pos}") from None
        self.pos += struct.calcsize(fmt)
        return value

    def count(self, what: str, min_bytes: int) -> int:
        """A uint64 count of items that take at least `min_bytes` each, checked against the
        bytes left (a corrupt count such as 2**40 is refused here, not looped over)."""
        at = self.pos
        n = self.unpack("<Q")
        if n * min_bytes > self.remaining():
            raise self.fail(
                f"{what} {n} at byte {at} needs at least {n * min_bytes} bytes, but only "
                f"{self.remaining()} remain: the header is corrupt or truncated"
            )
        return n

    def string(self, what: str) -> str:
        at = self.pos
        n = self.count(f"length of {what}", 1)
        raw = bytes(self.buf[self.pos : self.pos + n])
        try:
            value = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise self.fail(
                f"{what} at byte {at} is not valid UTF-8 ({err.reason} at byte "
                f"{self.pos + err.start}): {raw[:40]!r}"
            ) from None
        self.pos += n
        return value

    def strings(self, n: int, what: str) -> list[str]:
        """`n` strings in a row: `string` n times, in one tight loop (a vocabulary holds
        10**5 of them, tokens and merges, and a second start reads them all again)."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        starts = [0] * n
        out: list[Any] = [None] * n
        for i in range(n):
            if end - pos < 8:
                raise self.fail(f"truncated at byte {pos}")
            length = int.from_bytes(buf[pos : pos + 8], "little")
            pos += 8
            if length > end - pos:
                raise self.fail(
                    f"length of {what} {length} at byte {pos - 8} needs at least {length} "
                    f"bytes, but only {end - pos} remain: the header is corrupt or truncated"
                )
            starts[i] = pos
            out[i] = buf[pos : pos + length]
            pos += length
        try:
            out = [str(raw, "utf-8") for raw in out]
        except UnicodeDecodeError:
            for start in starts:  # again, one by one, so that the error names the string
                self.pos = start - 8
                self.string(what)
        self.pos = pos
        return out

    def entry(self, what: str) -> tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]:
        """One metadata value and its types: (value, value type, an array's item type)."""
        vtype = self.unpack("<I")
        item = None
        if vtype == gguf.GGUFValueType.ARRAY and self.remaining() >= 4:
            (item,) = struct.unpack_from("<I", self.buf, self.pos)
        value = self.value(vtype, what)
        try:
            item_type = None if item is None else gguf.GGUFValueType(item)
        except ValueError:  # an empty array's (any other fails to read)
            item_type = None
        return value, gguf.GGUFValueType(vtype), item_type

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype == gguf.GGUFValueType.STRING:
            return self.string(f"string value of {what}")
        if vtype == gguf.GGUFValueType.ARRAY:
            if depth >= _MAX_ARRAY_DEPTH:
                raise self.fail(f"{what} nests arrays deeper than {_MAX_ARRAY_DEPTH} levels")
            item_type = self.unpack("<I")
            fmt = _SCALAR_FORMATS.get(item_type)
            if fmt is not None:
                # Numeric arrays (token types, scores) are long: decode them in one go.
                dtype = np.dtype(fmt)
                n = self.count(f"length of array {what}", dtype.itemsize)
                values = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos)
                self.pos += n * dtype.itemsize
                return values.tolist()
            # Strings take at least their 8-byte length, nested arrays their 12-byte header.
            n = self.count(f"length of array {what}", 8)
            if item_type == gguf.GGUFValueType.STRING:
                return self.strings(n, f"string value of {what}")
            return [self.value(item_type, what, depth + 1) for _ in range(n)]
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise self.fail(f"{what} has unknown value type {vtype}")
        return self.unpack(fmt)


# Bytes of the smallest possible records: a key/value pair (empty key, u8 value) and a tensor
# info (empty name, one dim), so that counts can be checked against the file size.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Read a GGUF file's metadata and raw tensors.

    Tensor bytes are read-only memory-mapped views of the file, so reading is cheap and nothing
    is dequantized until asked. The header is parsed directly (the layout `gguf.GGUFReader`
    reads) because building that reader's per-string views of a 49k-token vocabulary takes
    seconds; value and tensor types are the `gguf` package's enums.

    Raises:
      GGUFError: (a `ValueError`) naming the file, and the tensor or key where there is one, for
        anything that is not a well-formed GGUF file: a missing or empty file, a bad magic or
        version, counts or lengths past the end of the file, names that are not UTF-8, duplicate
        tensor names or keys, a tensor with no dimension, a zero-sized one, or a row that is not
        whole blocks, an unknown type, an alignment that is not a power of two, a tensor offset
        that is not aligned, or tensor data past the end of the file (the size each declares
        is in the message: nothing is allocated for it). A path that is not a regular file
        (a FIFO, a device) is refused before a byte is read.
    """
    path = os.fspath(path)
    try:
        f = open_regular(path, GGUFError, shown=f"GGUF file {path!r}")
    except (FileNotFoundError, NotADirectoryError):
        raise GGUFError(f"path {path!r} is not a GGUF file (there is no such file)") from None
    with f:
        if os.fstat(f.fileno()).st_size == 0:
            raise GGUFError(f"path {path!r} is not a GGUF file (it is empty)")
        data = np.memmap(f, dtype=np.uint8, mode="r")
    return parse_gguf(data, path)


def parse_gguf(data: np.ndarray, path: str) -> GGUFFile:
    """`read_gguf` of a file's bytes already mapped: ``uint8 [file bytes]``, named `path` in
    errors and in the result. Tensors are views of `data`.

    Raises:
      GGUFError: as `read_gguf`, for anything that is not a well-formed GGUF file.
    """
    cur = _Cursor(memoryview(data), path)
    if cur.unpack("<I") != gguf.GGUF_MAGIC:
        raise GGUFError(f"path {path!r} is not a GGUF file (bad magic)")
    version = cur.unpack("<I")
    if version not in (2, 3):
        # A byte-swapped version number means a big-endian file.
        raise cur.fail(f"unsupported version {version}")
    n_tensors = cur.count("tensor count", _MIN_TENSOR_INFO_BYTES)
    n_kv = cur.count("metadata key count", _MIN_KV_BYTES)
    metadata: dict[str, Any] = {}
    value_types = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        if key in metadata:
            raise cur.fail(f"metadata key {key!r} appears twice")
        metadata[key], vtype, item_type = cur.entry(f"metadata key {key!r}")
        value_types[key] = (vtype, item_type)
    infos = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = cur.string(f"name of tensor #{i}")
        if name in names:
            raise cur.fail(f"two tensors are named {name!r}")
        names.add(name)
        n_dims = cur.unpack("<I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions; ggml tensors have 1 to 4")
        ggml_dims = [cur.unpack("<Q") for _ in range(n_dims)]
        type_id = cur.unpack("<I")
        try:
            ggml_type = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise cur.fail(
                f"tensor {name!r} has unknown ggml type {type_id}; this gguf package knows "
                + ", ".join(t.name for t in gguf.GGMLQuantizationType)
            ) from None
        if ggml_type not in gguf.GGML_QUANT_SIZES:
            raise cur.fail(f"tensor {name!r} has ggml type {ggml_type.name} of unknown size")
        offset = cur.unpack("<Q")
        infos.append((name, tuple(reversed(ggml_dims)), ggml_type, offset))
    alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    if (
        isinstance(alignment, bool)
        or not isinstance(alignment, int)
        or alignment <= 0
        or alignment & (alignment - 1)
    ):
        raise cur.fail(f"general.alignment is {alignment!r}; it must be a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, shape, ggml_type, offset in infos:
        block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        if 0 in shape:
            raise cur.fail(
                f"tensor {name!r} has shape {shape}, with a zero-sized dimension; a GGUF tensor "
                "holds at least one element (leave an empty tensor out of the file)"
            )
        if offset % alignment:
            raise cur.fail(
                f"tensor {name!r} starts at data offset {offset}, not a multiple of the file's "
                f"alignment {alignment}"
            )
        if shape[-1] % block_size:
            raise cur.fail(
                f"tensor {name!r} has row length {shape[-1]}, not a multiple of the "
                f"{ggml_type.name} block size {block_size}"
            )
        row_bytes = shape[-1] // block_size * type_size
        n_bytes = math.prod(shape[:-1]) * row_bytes
        begin = data_start + offset
        if begin + n_bytes > data.size:
            raise cur.fail(
                f"truncated inside tensor {name!r}: it declares {n_bytes} bytes (shape {shape}, "
                f"{ggml_type.name}) at bytes {begin} to {begin + n_bytes}, the file has "
                f"{data.size}"
            )
        raw = np.asarray(data[begin : begin + n_bytes]).reshape(*shape[:-1], row_bytes)
        tensors[name] = GGUFTensor(name=name, ggml_type=ggml_type, shape=shape, raw=raw)
    return GGUFFile(path=path, metadata=metadata, tensors=tensors, value_types=value_types)
