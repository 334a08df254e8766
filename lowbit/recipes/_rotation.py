"""`RotationConfig`: which QuaRot-style Hadamard rotations a recipe applies before quantizing.

Text form (JSON, presets): ``"hadamard"`` (the residual stream, each attention head's values
and, online, the input of every down_proj), ``"hadamard:offline"`` (the first two only: the
rotated model is a plain float model, which GGUF export writes and llama.cpp runs unchanged),
``"float"`` / ``"none"`` / null for none. A trailing ``"+strict"`` makes a layer the fold
cannot prove exact an error instead of a reported skip.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lowbit.recipes._text_form import split_text_form

ONLINE_TARGETS = ("down_proj",)
_FORMS = "none | hadamard | hadamard:offline, optionally '+strict'"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RotationConfig:
    """Rotations of a decoder's float weights that leave its function unchanged.

    Attributes:
      residual: rotate the residual stream by a random-sign Hadamard matrix ``Q`` fused into
        the weights (every RMSNorm scale folded into the linear layers it feeds first).
      heads: rotate each attention head's values (v_proj's outputs, o_proj's inputs) by a
        Hadamard matrix of head_dim.
      online: linear layers whose input the engine rotates at run time (the weight stored as
        ``Hᵀ W``): ``("down_proj",)`` or ``()``.
      seed: the random signs of ``Q``.
      strict: raise on a layer the fold cannot prove exact instead of leaving it unrotated.
    """

    residual: bool = True
    heads: bool = True
    online: tuple[str, ...] = ONLINE_TARGETS
    seed: int = 0
    strict: bool = False

    def __post_init__(self):
        object.__setattr__(self, "online", tuple(self.online))
        unknown = sorted(set(self.online) - set(ONLINE_TARGETS))
        if unknown:
            raise ValueError(
                f"rotate.online names {unknown}; accepted targets: {list(ONLINE_TARGETS)}"
            )

    def to_text(self) -> str:
        """The text form `parse_rotation` reads back (the defaults' variations only)."""
        text = "hadamard" if self.online else "hadamard:offline"
        return text + ("+strict" if self.strict else "")


def parse_rotation(value: Any, field: str = "rotate") -> RotationConfig | None:
    """A `RotationConfig` from its text form; None for ``"none"``, ``"float"``, ``""`` or None.

    Raises:
      ValueError: naming `field`, the value and the accepted forms.
    """
    parts = split_text_form(value, RotationConfig, field, "a rotation", _FORMS, "+strict")
    if not isinstance(parts, tuple):
        return parts  # None, or a RotationConfig already
    text, strict = parts
    if text == "hadamard":
        return RotationConfig(strict=strict)
    if text == "hadamard:offline":
        return RotationConfig(online=(), strict=strict)
    raise ValueError(f"{field}: {value!r} is not a rotation; accepted: {_FORMS}")


def format_rotation(config: RotationConfig | None) -> str | None:
    """The text form of `config` (None for no rotation)."""
    return None if config is None else config.to_text()
