"""JSON read from a file that may be truncated, corrupt or hostile (a manifest, a header)."""

from __future__ import annotations

import json
from typing import Any


def load_json(raw: bytes, where: str, error: type[ValueError] = ValueError) -> Any:
    """The JSON value in `raw`, or `error` naming `where` (e.g. ``"FILE: header"``).

    Python's parser recurses once per nesting level, so a file of a million ``[`` would raise
    `RecursionError`; that is turned into `error` as well, so that no input crashes a reader.

    Raises:
      error: if `raw` is not UTF-8 JSON, or nests too deeply to parse.
    """
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise error(f"{where} is not valid JSON ({err})") from None
    except RecursionError:
        raise error(f"{where} is JSON nested too deeply") from None
