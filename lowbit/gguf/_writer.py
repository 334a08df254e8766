"""Write a GGUF file: header, metadata and tensor table first, then each tensor's bytes in turn,
all through one atomic replacement of the target.

The file is written to a temporary name beside the target (`lowbit._atomic.atomic_write`: never
through a link), parsed back (`read_gguf`'s parser) to check it holds every tensor as declared,
and renamed into place; on any error nothing is left behind. The tensor table comes before the
data, so every tensor's type and byte shape is declared up front (`TensorSpec`) and the data
can be produced one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Iterable, Sequence
from typing import Any

import gguf
import numpy as np

from lowbit._atomic import atomic_write
from lowbit.gguf._reader import GGUFError, parse_gguf

FLOAT_TYPES = ("F32", "F16")
"""Types whose arrays are written as float arrays (the others as their block bytes)."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of a file to write, before its data.

    Attributes:
      name: GGUF tensor name, e.g. ``"blk.0.attn_q.weight"``.
      ggml_type: the type written: ``"F32"``, ``"F16"`` or a quantized GGML type name.
      shape: the shape of the array that will be written, in NumPy order: the tensor's own for
        F32 / F16, ``[*lead, row_bytes]`` (its block bytes) for a quantized type.
      dtype: that array's dtype (float32, float16, or uint8 for block bytes).
    """

    name: str
    ggml_type: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


Metadata = tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]
"""(key, value, value type, array item type or None) of one metadata key."""


def write_gguf(
    path: str | os.PathLike[str],
    architecture: str,
    metadata: Iterable[Metadata],
    tensors: Sequence[TensorSpec],
    data: Iterable[np.ndarray],
) -> None:
    """Writes a GGUF file atomically: metadata, the tensor table, then the tensors' data.

    Args:
      path: the ``.gguf`` file to write (replaced atomically); its directory must exist.
      architecture: the ``general.architecture`` value, written first.
      metadata: the other keys, in order, each with its type (`Metadata`).
      tensors: every tensor's name, type and written shape, in file order.
      data: one array per tensor of `tensors`, in order, of the declared shape and dtype;
        consumed one at a time while writing, so only one needs to be resident.
    Raises:
      ValueError: for data that is not one array of the declared shape and dtype per tensor,
        or a written file that does not read back with every declared tensor.
      OSError: when the file cannot be written (nothing is left behind).
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise OSError(f"cannot write {path!r}: directory {directory!r} does not exist")

    def write(file) -> None:
        writer = _write_header(file, architecture, metadata, tensors)
        arrays = iter(data)
        for t in tensors:
            raw = next(arrays, None)
            if raw is None:
                raise ValueError(f"no data for GGUF tensor {t.name!r} (of {len(tensors)} declared)")
            raw = np.ascontiguousarray(raw)
            if raw.shape != tuple(t.shape) or raw.dtype != t.dtype:
                raise ValueError(
                    f"GGUF tensor {t.name!r} is declared {t.ggml_type} {tuple(t.shape)} "
                    f"{np.dtype(t.dtype)}, but its data is {raw.shape} {raw.dtype}"
                )
            writer.write_tensor_data(raw)
            del raw
        if next(arrays, None) is not None:
            raise ValueError(f"more arrays than the {len(tensors)} GGUF tensors declared")
        writer.flush()
        _validate(file, path, tensors)

    atomic_write(path, write)


def header_nbytes(
    architecture: str, metadata: Iterable[Metadata], tensors: Sequence[TensorSpec]
) -> int:
    """Bytes `write_gguf` writes before the first tensor's data: the header, the metadata, the
    tensor table and the padding to the data's alignment (written to memory, not to a file).

    A file's size is this plus `padded` of each tensor's bytes: every tensor's data starts
    aligned and is padded after.
    """
    buffer = io.BytesIO()
    _write_header(buffer, architecture, metadata, tensors)
    return padded(buffer.tell())


def padded(nbytes: int) -> int:
    """`nbytes` rounded up to the alignment of a GGUF file's tensor data (32 bytes: the
    writer sets no ``general.alignment``)."""
    align = gguf.GGUF_DEFAULT_ALIGNMENT
    return -(-nbytes // align) * align


def _write_header(
    file, architecture: str, metadata: Iterable[Metadata], tensors: Sequence[TensorSpec]
) -> gguf.GGUFWriter:
    """Writes the header, the metadata and the tensor table to `file`; returns the writer,
    ready for the tensors' data."""
    writer = _FileWriter(file, architecture)
    for key, value, vtype, sub in metadata:
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for t in tensors:
        raw_dtype = None if t.ggml_type in FLOAT_TYPES else gguf.GGMLQuantizationType[t.ggml_type]
        writer.add_tensor_info(t.name, t.shape, t.dtype, t.nbytes, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    return writer


class _FileWriter(gguf.GGUFWriter):
    """gguf's writer, writing to a file we opened (it would open the path itself, following
    links) rather than to a path."""

    def __init__(self, file, architecture: str):
        super().__init__(None, architecture)
        self._file = file

    def open_output_file(self, path=None) -> None:
        if self.state is gguf.WriterState.NO_FILE:
            self.fout = [self._file]
            self.state = gguf.WriterState.EMPTY


def _validate(file, path: str, tensors: Sequence[TensorSpec]) -> None:
    """Checks the written `file` (open for reading, to be renamed to `path`) parses as GGUF
    (`read_gguf`'s checks: offsets aligned, no tensor past the end) and holds every declared
    tensor with its type and byte count."""
    data = np.memmap(file, dtype=np.uint8, mode="r")
    try:
        found = parse_gguf(data, path).tensors
    except GGUFError as err:
        raise ValueError(f"written GGUF file does not read back: {err}") from None
    for spec in tensors:
        t = found.get(spec.name)
        if t is None or t.ggml_type.name != spec.ggml_type or t.raw.nbytes != spec.nbytes:
            raise ValueError(
                f"written GGUF file does not read back tensor {spec.name!r} as {spec.ggml_type}"
            )
