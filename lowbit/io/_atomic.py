"""Durable, atomic replacement of a directory, and the temporaries a killed writer leaves.

A directory is written whole into a temporary directory beside its target, flushed, and then
swapped in by rename. Where the kernel offers it (Linux ``renameat2`` with
``RENAME_EXCHANGE``), an existing target is exchanged with the new directory in one atomic step,
so every reader sees either the old directory or the new one. Elsewhere the old directory is
first renamed aside: a crash between the two renames leaves no directory at the target, but
both versions whole on disk, the old one under ``<tmp>.old``.

Temporaries are named ``.<target name>.tmp-<16 hex digits>`` (``.old`` appended for the
fallback's aside copy), and their writer holds an exclusive ``flock`` on the directory for as
long as it works in it. A writer killed by SIGKILL leaves its temporary behind, but the kernel
drops its lock: a temporary that matches the name, belongs to this user, holds only the
files its writer makes, and whose lock can be taken, is provably a dead writer's and may be
removed. Where locks are unavailable nothing is ever proved stale, so nothing is removed.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import stat
from collections.abc import Collection

try:
    import fcntl
except ImportError:  # not POSIX: no locks, so temporaries are never proved stale
    fcntl = None

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
TEMP_INFIX = ".tmp-"


def write_file(file: str, data: bytes) -> None:
    """Writes `data` to a new `file` and flushes it to disk."""
    with open(file, "xb") as f:
        f.write(data)
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
    _fsync_directory(new)  # its entries reach the disk before it becomes visible at `path`
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
    _fsync_directory(os.path.dirname(path) or ".")


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def same_directory(path: str, fd: int) -> bool:
    """Whether `path` still names the directory open as `fd` (it was not removed or swapped)."""
    try:
        here, there = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino) and there.st_nlink > 0


def _open_directory(path: str) -> int:
    return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))


def _try_lock(fd: int, *, wait: bool) -> bool:
    """Takes an exclusive lock on `fd`; False if it is held elsewhere or locks are unsupported."""
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        return False
    return True


def make_temporary(path: str) -> tuple[str, int | None]:
    """Creates a private, locked temporary directory beside `path`.

    Returns:
      ``(directory, lock)``: the new directory and the open descriptor holding its lock (None
      where locks are unavailable); hand both to `release_temporary` when done.
    """
    parent, base = os.path.split(path)
    for _ in range(100):
        tmp = os.path.join(parent, f".{base}{TEMP_INFIX}{secrets.token_hex(8)}")
        try:
            os.mkdir(tmp, 0o700)
            fd = _open_directory(tmp)
        except FileExistsError:
            continue
        except FileNotFoundError:  # removed as stale before we could lock it: take another
            continue
        if not _try_lock(fd, wait=True):
            os.close(fd)
            return tmp, None
        if same_directory(tmp, fd):
            return tmp, fd
        os.close(fd)
    raise FileExistsError(f"cannot create a temporary directory beside {path!r}")


def release_temporary(lock: int | None) -> None:
    """Drops the lock `make_temporary` took (the directory is the caller's to remove)."""
    if lock is not None:
        os.close(lock)


def remove_stale_temporaries(path: str, files: Collection[str]) -> list[str]:
    """Removes the temporaries of writers to `path` that died, and nothing else.

    A sibling of `path` is removed only if all hold: its name is one `make_temporary` makes
    for `path`; it is a real directory (not a symlink) owned by this user; no live writer
    holds its lock; and it contains only regular files named in `files`.

    Returns:
      The directories removed.
    """
    parent, base = os.path.split(path)
    removed = []
    try:
        names = os.listdir(parent or ".")
    except FileNotFoundError:
        return removed
    for name in names:
        if not _is_temporary_name(name, base):
            continue
        tmp = os.path.join(parent, name)
        try:
            fd = _open_directory(tmp)
        except OSError:  # vanished, a symlink, or not a directory
            continue
        try:
            if os.fstat(fd).st_uid != os.geteuid() or not _try_lock(fd, wait=False):
                continue
            if not same_directory(tmp, fd) or not _only_files(tmp, files):
                continue
            for file in os.listdir(tmp):
                os.unlink(os.path.join(tmp, file))
            os.rmdir(tmp)
            removed.append(tmp)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


def _is_temporary_name(name: str, base: str) -> bool:
    """Whether `name` is ``.<base>.tmp-<16 hex digits>``, optionally with ``.old`` after."""
    prefix = f".{base}{TEMP_INFIX}"
    if not name.startswith(prefix):
        return False
    token = name[len(prefix) :].removesuffix(".old")
    return len(token) == 16 and all(c in "0123456789abcdef" for c in token)


# safetensors' writer (Rust `tempfile`) writes through ".tmp" + 6 alphanumerics beside its
# target: a save killed mid-write leaves one in the temporary directory.
_WRITER_TEMPORARY = r"\.tmp[A-Za-z0-9]{6}"


def _only_files(directory: str, files: Collection[str]) -> bool:
    for name in os.listdir(directory):
        if name not in files and not re.fullmatch(_WRITER_TEMPORARY, name):
            return False
        if not stat.S_ISREG(os.lstat(os.path.join(directory, name)).st_mode):
            return False
    return True
