"""GGUF: the GGML block types and their codecs (bit-identical to llama.cpp), and the file
reader and writer.

`BLOCK_TYPES` is the one list of block types lowbit encodes and decodes: each `BlockType`
holds its sizes, its ggml type id and its codec (`BlockType.encode` / `BlockType.decode`,
traced JAX functions); `encode`, `decode` and `split` (a 32-element block's scale, minimum
and codes) are their compiled NumPy entry points.
`read_gguf` parses a file's header once and hands each tensor over as a memory-mapped view of
its stored blocks (`GGUFFile`, `GGUFTensor`); a malformed file raises `GGUFError`.
`write_gguf` writes one atomically, its tensors declared up front (`TensorSpec`) and their
data streamed one at a time; `header_nbytes` and `padded` give its size before it is written.
"""

from lowbit.gguf._grid import (
    GRIDS,
    Grid,
    GridParams,
    grid_initial_params,
    grid_of,
    round_fp16,
    round_level,
)
from lowbit.gguf._reader import GGUFError, GGUFFile, GGUFTensor, read_gguf
from lowbit.gguf._types import BLOCK_TYPES, BlockType, block_type, decode, encode, split
from lowbit.gguf._writer import FLOAT_TYPES, TensorSpec, header_nbytes, padded, write_gguf

__all__ = [
    "GRIDS",
    "Grid",
    "GridParams",
    "grid_initial_params",
    "grid_of",
    "round_fp16",
    "round_level",
    "BLOCK_TYPES",
    "FLOAT_TYPES",
    "BlockType",
    "GGUFError",
    "GGUFFile",
    "GGUFTensor",
    "TensorSpec",
    "block_type",
    "decode",
    "encode",
    "header_nbytes",
    "padded",
    "read_gguf",
    "split",
    "write_gguf",
]
