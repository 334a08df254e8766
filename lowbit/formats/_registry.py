"""The one table of formats by name. A new format is one module plus one entry here."""

from __future__ import annotations

from collections.abc import Iterator

from lowbit.formats._base import Format
from lowbit.formats._integer import INT_FORMATS, UINT_FORMATS

FORMATS: dict[str, Format] = {f.name: f for f in (*INT_FORMATS, *UINT_FORMATS)}


def get_format(fmt: str | Format) -> Format:
    """Looks a format up by name (or passes a `Format` through).

    Raises:
      ValueError: naming the unknown format and listing the accepted names.
      TypeError: if `fmt` is neither a str nor a Format.
    """
    if isinstance(fmt, Format):
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(f"format must be a str or Format, got {type(fmt).__name__}: {fmt!r}")
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(
            f"unknown format {fmt!r}; accepted: {', '.join(sorted(FORMATS))}"
        ) from None


def format_names() -> Iterator[str]:
    """Registered format names, sorted."""
    return iter(sorted(FORMATS))
