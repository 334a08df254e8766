"""Number formats (exact encode/decode, bits per value) and packing of sub-byte codes."""

from lowbit.formats._base import Format
from lowbit.formats._block import BlockFormat
from lowbit.formats._codebook import CodebookFormat, normal_float_levels
from lowbit.formats._float import FloatFormat
from lowbit.formats._gguf import GGUF_BLOCK_FORMATS, GGUFBlockFormat
from lowbit.formats._gguf_blocks import BLOCK_TYPES as GGUF_BLOCK_TYPES
from lowbit.formats._gguf_decode import decode as gguf_decode
from lowbit.formats._gguf_decode import decode_traced as gguf_decode_traced
from lowbit.formats._gguf_encode import encode as gguf_encode
from lowbit.formats._integer import FixedPointFormat, IntFormat
from lowbit.formats._packing import group_shape, pack, packed_length, unpack
from lowbit.formats._registry import ALIASES, FORMATS, format_names, get_format
from lowbit.formats._ternary import TernaryFormat

__all__ = [
    "ALIASES",
    "FORMATS",
    "BlockFormat",
    "CodebookFormat",
    "FixedPointFormat",
    "FloatFormat",
    "GGUF_BLOCK_FORMATS",
    "GGUF_BLOCK_TYPES",
    "GGUFBlockFormat",
    "Format",
    "IntFormat",
    "TernaryFormat",
    "format_names",
    "get_format",
    "gguf_decode",
    "gguf_decode_traced",
    "gguf_encode",
    "group_shape",
    "normal_float_levels",
    "pack",
    "packed_length",
    "unpack",
]
