"""Writing a safetensors file one tensor at a time, with memory bounded by the largest tensor.

A safetensors file starts with its header (every tensor's dtype, shape and byte range), so it
cannot be written front to back while the tensors are still arriving. `TensorFileWriter`
appends each tensor's bytes to a spool file as it comes (hashing them on the way, for the
checkpoint manifest) and forgets it; `finish` writes the header and then copies each tensor's
range from the spool behind it inside the kernel (``copy_file_range``), so no tensor passes
through this process twice and the disk holds the data twice only until the spool is removed.

The layout is the one the ``safetensors`` library writes: data ordered by dtype (wider
elements first, so every tensor is aligned to its element size), then by name, and the header
JSON compact and padded with spaces to a multiple of 8 bytes. Only the ``__metadata__`` keys
differ in order: here ``format`` first, then the caller's keys as given (the library's order
depends on a per-process hash seed).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import struct
from collections.abc import Mapping

import numpy as np

from lowbit.io._safetensors_file import CODES

# safetensors' dtype enum, in declaration order: the library sorts tensors by it, descending.
_RANK = {
    code: i
    for i, code in enumerate(
        (
            "BOOL",
            "U8",
            "I8",
            "F8_E5M2",
            "F8_E4M3",
            "I16",
            "U16",
            "F16",
            "BF16",
            "I32",
            "U32",
            "F32",
            "F64",
            "I64",
            "U64",
        )
    )
}
_COPY_CHUNK = 64 * 2**20
_UNSUPPORTED = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM)


@dataclasses.dataclass(frozen=True)
class _Spooled:
    name: str
    code: str
    shape: tuple[int, ...]
    offset: int  # in the spool
    nbytes: int


class TensorFileWriter:
    """Appends tensors to a spool file; `finish` writes the safetensors file from it.

    Args:
      path: the safetensors file to create (must not exist).
      spool: the spool file to create beside it (same filesystem, so copies stay in the
        kernel); removed by `finish`.
    """

    def __init__(self, path: str, spool: str):
        self._path, self._spool_path = path, spool
        self._spool = open(spool, "x+b")  # noqa: SIM115 - closed by finish / discard
        self._entries: dict[str, _Spooled] = {}
        self._offset = 0

    def add(self, name: str, array: np.ndarray) -> str:
        """Appends one tensor (a `storage_view`: C order, a dtype safetensors has a code for).

        Returns:
          The sha256 hex digest of its bytes.
        Raises:
          ValueError: if a tensor of that name was added already.
        """
        if name in self._entries:
            raise ValueError(f"tensor {name!r} is added twice")
        data = memoryview(np.require(array, requirements="C").reshape(-1).view(np.uint8))
        digest = hashlib.sha256(data).hexdigest()
        self._spool.write(data)
        self._entries[name] = _Spooled(
            name, CODES[array.dtype.name], tuple(array.shape), self._offset, data.nbytes
        )
        self._offset += data.nbytes
        return digest

    def finish(self, metadata: Mapping[str, str]) -> None:
        """Writes the file (header, then the data in safetensors' order), flushes it to disk
        and removes the spool.

        Args:
          metadata: the header's ``__metadata__`` strings, after ``"format": "lowbit"``.
        """
        self._spool.flush()
        order = sorted(self._entries.values(), key=lambda e: (-_RANK[e.code], e.name))
        header: dict[str, object] = {"__metadata__": {"format": "lowbit", **metadata}}
        begin = 0
        for e in order:
            header[e.name] = {
                "dtype": e.code,
                "shape": list(e.shape),
                "data_offsets": [begin, begin + e.nbytes],
            }
            begin += e.nbytes
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        text += b" " * (-len(text) % 8)
        with open(self._path, "xb") as out:
            out.write(struct.pack("<Q", len(text)))
            out.write(text)
            out.flush()
            for e in order:
                _copy(self._spool.fileno(), out.fileno(), e.offset, e.nbytes)
            os.fsync(out.fileno())
        self.discard()

    def discard(self) -> None:
        """Closes and removes the spool (the caller removes a partial output)."""
        self._spool.close()
        if os.path.exists(self._spool_path):
            os.unlink(self._spool_path)


def _copy(src: int, dst: int, offset: int, nbytes: int) -> None:
    """Appends bytes ``[offset, offset + nbytes)`` of `src` at `dst`'s position."""
    done = 0
    use_kernel = hasattr(os, "copy_file_range")
    while done < nbytes:
        if use_kernel:
            try:
                got = os.copy_file_range(src, dst, nbytes - done, offset + done)
            except OSError as err:
                if err.errno not in _UNSUPPORTED:
                    raise
                use_kernel = False  # another filesystem, or no such call here: copy by hand
                continue
            if got == 0:
                raise OSError(f"spool ended {nbytes - done} bytes early")
        else:
            chunk = os.pread(src, min(_COPY_CHUNK, nbytes - done), offset + done)
            if not chunk:
                raise OSError(f"spool ended {nbytes - done} bytes early")
            got = os.write(dst, chunk)
        done += got
