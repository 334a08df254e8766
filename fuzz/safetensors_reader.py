"""Fuzzes the safetensors reader (`lowbit.io._safetensors_file`: the header parser and tensor
reads that `lowbit.io.import_safetensors`, checkpoints and Hugging Face imports use).

Contract: a `ValueError` naming the file, or tensors that tile the data section exactly and
read back with their declared dtype and shape.
"""

from __future__ import annotations

from fuzz._contract import documented, main, scratch_file, write
from fuzz._seeds import safetensors_seeds

seeds = safetensors_seeds  # what `python -m fuzz` starts the corpus from

_PATH = scratch_file("input.safetensors")


def _load():
    global read_file_header, read_tensor, open_regular
    from lowbit._untrusted import open_regular
    from lowbit.io._safetensors_file import read_file_header, read_tensor


def test_one(data: bytes) -> None:
    path = write(_PATH, data)
    with documented((ValueError,), path), open_regular(path) as f:
        entries, metadata = read_file_header(f)
        assert all(isinstance(v, str) for v in metadata.values())
        at = 8 + int.from_bytes(data[:8], "little")
        for entry in entries.values():
            assert entry.begin == at, entry.name  # contiguous, in order
            at = entry.end
            array = read_tensor(f, entry)
            assert array.shape == entry.shape and array.dtype == entry.dtype
        assert at == len(data)


if __name__ == "__main__":
    main(test_one, _load)
