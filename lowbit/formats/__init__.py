"""Number formats (exact encode/decode, bits per value) and dense bit packing."""

from lowbit.formats._base import Format
from lowbit.formats._integer import IntFormat
from lowbit.formats._packing import group_shape, pack, packed_length, unpack
from lowbit.formats._registry import FORMATS, format_names, get_format

__all__ = [
    "FORMATS",
    "Format",
    "IntFormat",
    "format_names",
    "get_format",
    "group_shape",
    "pack",
    "packed_length",
    "unpack",
]
