"""Opening and parsing files that may come from strangers: truncated, corrupt or hostile.

Below every layer (models, io and recipes all read such files), so it imports nothing of the
library's own.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any, BinaryIO

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(
    path: str | os.PathLike[str],
    error: type[ValueError] = ValueError,
    *,
    dir_fd: int | None = None,
    shown: str | None = None,
) -> BinaryIO:
    """Opens `path` for binary reading if it is a regular file; `error` at once otherwise.

    A FIFO would block the open (and every read) until some other process writes to it, and a
    device may never end: both are refused before a byte is read. The file is opened
    non-blocking (which cannot block on a FIFO) and checked by its descriptor, so the check and
    the read see the same file.

    Args:
      path: the file (relative to `dir_fd` if given).
      error: the exception type to raise (a `ValueError` subclass naming the format).
      dir_fd: a directory descriptor `path` is relative to.
      shown: how to name the file in errors (default: `path`).
    Raises:
      FileNotFoundError: if there is no such file.
      error: naming the file and what it is, if it is not a regular file.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, dir_fd=dir_fd) if dir_fd is not None else os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise error(
                f"{shown or os.fspath(path)}: is {_kind(mode)}, not a regular file; refusing "
                "to read it (give the path of the file itself)"
            )
        os.set_blocking(fd, True)
        # Through `opener`, so the file object's `name` is the path readers put in errors.
        return open(shown or os.fspath(path), "rb", opener=lambda _name, _flags: fd)  # noqa: SIM115
    except BaseException:
        os.close(fd)
        raise


def require_regular(path: str | os.PathLike[str], error: type[ValueError] = ValueError) -> None:
    """Refuses `path` unless it is a regular file (symlinks followed), for readers that open
    the path themselves (another library's).

    Raises:
      FileNotFoundError: if there is no such file.
      error: naming the file and what it is, if it is not a regular file.
    """
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise error(
            f"{os.fspath(path)}: is {_kind(mode)}, not a regular file; refusing to read it "
            "(give the path of the file itself)"
        )


def read_text(path: str | os.PathLike[str], error: type[ValueError] = ValueError) -> str:
    """The UTF-8 text of the regular file `path` (see `open_regular`).

    Raises:
      error: naming the file if it is not a regular file or not UTF-8.
    """
    with open_regular(path, error) as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{os.fspath(path)}: not UTF-8 text ({err})") from None


def load_json(raw: bytes | str, where: str, error: type[ValueError] = ValueError) -> Any:
    """The JSON value in `raw`, or `error` naming `where` (e.g. ``"FILE: header"``).

    Python's parser recurses once per nesting level, so a file of a million ``[`` would raise
    `RecursionError`, and an integer of more than 4300 digits raises Python's own int-conversion
    `ValueError`; both become `error`, so that no input crashes a reader or escapes its type.
    An object naming a key twice is refused too: parsers disagree on which value wins (Python
    keeps the last), so such a file means different things to different readers.

    Raises:
      error: if `raw` is not UTF-8 JSON, nests too deeply to parse, holds an integer too long
        to convert, or an object with a duplicate key.
    """
    try:
        return json.loads(raw, object_pairs_hook=_unique_object)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise error(f"{where} is not valid JSON ({err})") from None
    except RecursionError:
        raise error(f"{where} is JSON nested too deeply") from None
    except ValueError as err:  # "Exceeds the limit (4300 digits) for integer string conversion"
        raise error(f"{where} is not JSON this reader accepts ({err})") from None


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise ValueError(f"key {twice!r} appears twice in one object")
    return out
