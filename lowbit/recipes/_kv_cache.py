"""`KVCacheConfig`: how a language model's key/value cache is stored (a recipe field).

Text form (JSON, the CLI's ``--kv-cache``): ``"float"`` (or null: the model's dtype),
``"float16"`` / ``"bfloat16"`` (plain 16-bit floats, no scales), ``"int8"``, ``"int4"``,
``"fp8"``, optionally with a channel group size ``"int4:g32"`` (one scale per token, head and
32 channels instead of per token and head) and ``"+qk"`` for int8 keys read by an integer
QKᵀ (``"int8+qk"``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lowbit.recipes._text_form import field_errors, split_text_form

KV_FORMATS = ("int8", "int4", "fp8", "float16", "bfloat16")
# Formats that store the values themselves, narrower than a float32 model's (no scales).
FLOAT_KV_FORMATS = ("float16", "bfloat16")
_FORMS = (
    "float | float16 | bfloat16 | int8 | int4 | fp8, optionally ':gN' (channel group, "
    "quantized formats) and, for int8, '+qk'"
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheConfig:
    """A KV cache narrower than the model's floats: quantized (codes written on each step,
    scales per token and head) or 16-bit floats.

    Attributes:
      format: ``"int8"`` (symmetric, scale = absmax / 127), ``"int4"`` (symmetric, two codes a
        byte, scale = absmax / 7), ``"fp8"`` (float8 e4m3fn, scale = absmax / 448), or
        ``"float16"`` / ``"bfloat16"``: the values rounded to that dtype, no scales (half a
        float32 cache; float16 values beyond its range are clipped to its largest finite one).
      group_size: channels per scale along head_dim; None for one scale per token and head.
      integer_qk: int8 keys only: the attention scores come from an int8 x int8 -> int32
        product of the per-token quantized queries and the key codes, instead of dequantized
        keys.
    """

    format: str
    group_size: int | None = None
    integer_qk: bool = False

    def __post_init__(self):
        if self.format not in KV_FORMATS:
            raise ValueError(
                f"kv_cache format {self.format!r} is unknown; accepted: {', '.join(KV_FORMATS)} "
                "(or 'float' / null for a float cache)"
            )
        if self.group_size is not None and (
            not isinstance(self.group_size, int) or self.group_size < 1
        ):
            raise ValueError(f"kv_cache group_size={self.group_size!r} must be a positive int")
        if self.group_size is not None and self.is_float:
            raise ValueError(
                f"kv_cache {self.format} stores values without scales; drop ':g{self.group_size}'"
            )
        if self.group_size is not None and self.format == "int4" and self.group_size % 2:
            raise ValueError(f"kv_cache int4 group_size={self.group_size} must be even")
        if self.integer_qk and self.format != "int8":
            raise ValueError(
                f"kv_cache integer_qk is for int8 keys; format is {self.format!r}. Drop '+qk'"
            )

    @property
    def is_float(self) -> bool:
        """Whether the cache stores plain 16-bit floats (no scales, no key offsets)."""
        return self.format in FLOAT_KV_FORMATS

    def to_text(self) -> str:
        """The text form `parse_kv_cache` reads back."""
        group = "" if self.group_size is None else f":g{self.group_size}"
        return self.format + group + ("+qk" if self.integer_qk else "")

    def check_head_dim(self, head_dim: int) -> None:
        """Raises ValueError if this config cannot store heads of `head_dim` channels."""
        if self.format == "int4" and head_dim % 2:
            raise ValueError(f"kv_cache int4 packs two channels a byte; head_dim={head_dim} is odd")
        if self.group_size is not None and head_dim % self.group_size:
            raise ValueError(
                f"kv_cache group_size={self.group_size} does not divide head_dim={head_dim}"
            )


def parse_kv_cache(value: Any, field: str = "kv_cache") -> KVCacheConfig | None:
    """A `KVCacheConfig` from its text form; None for ``"float"``, ``""`` or None.

    Raises:
      ValueError: for a value not in the accepted forms, or one `KVCacheConfig` refuses (an odd
        int4 group, ``+qk`` without int8); the message names `field` and the value.
    """
    parts = split_text_form(value, KVCacheConfig, field, "a KV cache format", _FORMS, "+qk")
    if not isinstance(parts, tuple):
        return parts  # None, or a KVCacheConfig already
    text, integer_qk = parts
    name, _, group = text.partition(":")
    group_size = None
    if group:
        if not (group.startswith("g") and group[1:].isdigit()):
            raise ValueError(f"{field}: {value!r} has a bad group {group!r}; accepted: {_FORMS}")
        group_size = int(group[1:])
    if name not in KV_FORMATS:
        raise ValueError(f"{field}: {value!r} is not a KV cache format; accepted: {_FORMS}")
    with field_errors(field):
        return KVCacheConfig(format=name, group_size=group_size, integer_qk=integer_qk)


def format_kv_cache(config: KVCacheConfig | None) -> str | None:
    """The text form of `config` (None for a float cache)."""
    return None if config is None else config.to_text()
