"""Fuzzes `lowbit.io.import_gguf` end to end: the reader, then each tensor turned into a QArray
(Q8_0 / Q4_0 / Q4_1 directly, the K-quants and others as GGUF block formats) or float32 values,
nested into a params tree. Slower than `fuzz.gguf_reader` (JAX runs per tensor), so it is fed
the same seeds but explores less; run it for longer.

Contract: `GGUFError` naming the file, a `ValueError` naming a tensor, or params whose every
leaf has its tensor's shape and traces a decode of that shape.
"""

from __future__ import annotations

from fuzz._contract import documented, main, scratch_file, write
from fuzz._seeds import gguf_seeds

seeds = gguf_seeds  # what `python -m fuzz` starts the corpus from

_PATH = scratch_file("import.gguf")
# Bigger files would spend the time in JAX, not in lowbit's parsing.
_MAX_TENSOR_BYTES = 1 << 14


def _load():
    global GGUFError, import_gguf, read_gguf, is_qarray, jax
    import jax

    from lowbit.gguf import GGUFError, read_gguf
    from lowbit.io import import_gguf
    from lowbit.qarray import is_qarray


def test_one(data: bytes) -> None:
    path = write(_PATH, data)
    tensors = {}
    with documented((GGUFError,), repr(path)):
        tensors = read_gguf(path).tensors
    if not tensors or any(t.raw.nbytes > _MAX_TENSOR_BYTES for t in tensors.values()):
        return
    with documented((ValueError,), (repr(path), *(repr(name) for name in tensors))):
        params, _ = import_gguf(path)
        for name, tensor in tensors.items():
            leaf = params[name]
            assert tuple(leaf.shape) == tensor.shape, (name, leaf.shape, tensor.shape)
            if is_qarray(leaf):
                # Traced, not run: running it compiled each decoder's ops for every new
                # shape (5 s for a 7.7 KB file of seven block types), a cost of JAX's
                # warm-up, not of the input. The decoders' values are tested against
                # llama.cpp's in tests/gguf.
                assert tuple(jax.eval_shape(leaf.dequantize).shape) == tensor.shape


if __name__ == "__main__":
    main(test_one, _load)
