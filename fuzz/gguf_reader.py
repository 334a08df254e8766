"""Fuzzes the GGUF reader (`lowbit.gguf.read_gguf`, which `lowbit.io.import_gguf` and the
GGUF model loaders use): header, metadata of every value type, tensor infos, alignment,
offsets, and each small tensor's decoding.

Contract: `GGUFError` naming the file, a `ValueError` naming the tensor for a storage type
that cannot be dequantized, or a file whose every tensor views exactly its declared bytes.
"""

from __future__ import annotations

import math

from fuzz._contract import documented, main, scratch_file, write
from fuzz._seeds import gguf_seeds

seeds = gguf_seeds  # what `python -m fuzz` starts the corpus from

# Tensors up to this many bytes are decoded too (bigger ones only have their views checked).
_DECODE_BYTES = 1 << 16
_PATH = scratch_file("input.gguf")


def _load():
    global GGUFError, read_gguf, gguf
    import gguf

    from lowbit.gguf import GGUFError, read_gguf


def test_one(data: bytes) -> None:
    path = write(_PATH, data)
    with documented((GGUFError,), repr(path)):
        f = read_gguf(path)
        for tensor in f.tensors.values():
            block_size, type_size = gguf.GGML_QUANT_SIZES[tensor.ggml_type]
            row_bytes = tensor.shape[-1] // block_size * type_size
            assert tensor.raw.shape == (*tensor.shape[:-1], row_bytes), tensor.name
            assert 0 < math.prod(tensor.shape)
            if tensor.raw.nbytes <= _DECODE_BYTES:
                with documented((ValueError,), repr(tensor.name)):
                    values = tensor.dequantize()
                    assert values.shape == tensor.shape and values.dtype == "float32"


if __name__ == "__main__":
    main(test_one, _load)
