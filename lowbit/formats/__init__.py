"""Number formats (exact encode/decode, bits per value) and packing of sub-byte codes."""

from lowbit.formats._base import Format
from lowbit.formats._block import BlockFormat
from lowbit.formats._codebook import CodebookFormat, normal_float_levels
from lowbit.formats._float import FloatFormat
from lowbit.formats._gguf import GGUF_BLOCK_FORMATS, GGUF_ELEMENT_FORMATS, GGUFBlockFormat
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
    "GGUF_ELEMENT_FORMATS",
    "GGUFBlockFormat",
    "Format",
    "IntFormat",
    "TernaryFormat",
    "format_names",
    "get_format",
    "group_shape",
    "normal_float_levels",
    "pack",
    "packed_length",
    "unpack",
]
