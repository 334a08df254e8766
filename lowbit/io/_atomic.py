"""Durable, atomic replacement of a directory.

A checkpoint is written whole into a temporary directory beside its target, flushed, and then
swapped in by rename. Where the kernel offers it (Linux ``renameat2`` with
``RENAME_EXCHANGE``), an existing target is exchanged with the new directory in one atomic step,
so every reader sees either the old checkpoint or the new one. Elsewhere the old directory is
first renamed aside: a crash between the two renames leaves no directory at the target, but
both checkpoints whole on disk, the old one under ``<tmp>.old``.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
from typing import Any

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def write_json(file: str, data: Any) -> None:
    """Writes `data` as JSON to `file` and flushes it to disk."""
    with open(file, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())


def _umask() -> int:
    """The process umask, read without changing it where the system allows."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere the only way to read it is to set it
    os.umask(mask)
    return mask


def publish_permissions(directory: str) -> None:
    """Gives `directory` and the files in it the modes a plain ``mkdir`` / ``open`` would.

    Temporary directories are created private (0700), and some writers create their files
    0600; a checkpoint written through them would be unreadable to anyone else (a serving
    process under another user, a shared cache) however the user's umask is set.
    """
    mask = _umask()
    for name in os.listdir(directory):
        file = os.path.join(directory, name)
        if os.path.isfile(file) and not os.path.islink(file):
            os.chmod(file, 0o666 & ~mask)
    os.chmod(directory, 0o777 & ~mask)


def exchange(a: str, b: str) -> bool:
    """Atomically swaps two existing paths; False where the system cannot.

    Raises:
      OSError: for failures other than the call or flag being unsupported.
    """
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), b)


def replace_directory(new: str, path: str) -> None:
    """Moves directory `new` to `path`; a directory already at `path` ends up at `new`.

    Both must be on one filesystem (put `new` in `path`'s parent).
    """
    if not os.path.lexists(path):
        os.rename(new, path)
    elif not exchange(new, path):
        old = f"{new}.old"
        os.rename(path, old)
        try:
            os.rename(new, path)
        except OSError:
            os.rename(old, path)
            raise
        os.rename(old, new)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
