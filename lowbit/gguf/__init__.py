"""GGUF: the GGML block types and their codecs (bit-identical to llama.cpp).

`BLOCK_TYPES` is the one list of block types lowbit encodes and decodes: each `BlockType`
holds its sizes, its ggml type id and its codec (`BlockType.encode` / `BlockType.decode`,
traced JAX functions); `encode` and `decode` are their compiled NumPy entry points.
"""

from lowbit.gguf._types import BLOCK_TYPES, BlockType, block_type, decode, encode

__all__ = [
    "BLOCK_TYPES",
    "BlockType",
    "block_type",
    "decode",
    "encode",
]
