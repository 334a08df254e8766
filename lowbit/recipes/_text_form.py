"""What the recipes' text-form parsers share: the prelude that reads a value as text, and the
field named in front of a config's own errors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, TypeVar

T = TypeVar("T")

# The words that mean "no such config" in every text form (JSON null reads as None before).
OFF_WORDS = ("", "float", "none")


def split_text_form(
    value: Any, config_type: type[T], field: str, noun: str, forms: str, flag: str
) -> T | tuple[str, bool] | None:
    """The prelude of a text-form parser: `value` itself if it is None or a `config_type`
    already; None for one of `OFF_WORDS`; else ``(text, flagged)``: the text stripped,
    lower-cased and without a trailing `flag` (e.g. ``"+qk"``), and whether the flag was there.

    Raises:
      ValueError: naming `field` and the accepted `forms` if `value` is not a string (`noun`
        says what it should be, e.g. ``"a rotation"``).
    """
    if value is None or isinstance(value, config_type):
        return value
    if not isinstance(value, str):
        raise ValueError(f"{field}: {value!r} is not {noun}; accepted: {forms}")
    text = value.strip().lower()
    if text in OFF_WORDS:
        return None
    return text.removesuffix(flag), text.endswith(flag)


@contextlib.contextmanager
def field_errors(field: str) -> Iterator[None]:
    """Re-raises a ValueError of the block (a config's own checks) with `field` in front, so the
    message says where the value came from."""
    try:
        yield
    except ValueError as err:
        raise ValueError(f"{field}: {err}") from None
