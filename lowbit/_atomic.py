"""Durable, atomic replacement of a file or a directory, and the temporaries a killed writer
leaves.

Every file lowbit writes outside a checkpoint's private temporary directory goes through
`atomic_write`: a new file created beside the target with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under
a random name, written, flushed to disk and renamed over the target. Checkpoints come from
strangers, so no name in one can be trusted: a symlink planted at the target, at a temporary's
name or at a directory on the way never redirects the write (see `atomic_write`).

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

import contextlib
import ctypes
import errno
import os
import re
import secrets
import stat
from collections.abc import Callable, Collection
from typing import BinaryIO

try:
    import fcntl
except ImportError:  # not POSIX: no locks, so temporaries are never proved stale
    fcntl = None

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
TEMP_INFIX = ".tmp-"


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC
# Descriptor-relative calls pin the directory: a link swapped in after the checks is not followed.
_AT_DIRECTORY = {os.open, os.stat, os.rename, os.unlink} <= os.supports_dir_fd


class LinkedPathError(ValueError):
    """A write refused because its target, or a directory on its way, is a symbolic link."""


def atomic_write(
    path: str | os.PathLike[str],
    content: bytes | Callable[[BinaryIO], None],
    *,
    within: str | os.PathLike[str] | None = None,
) -> None:
    """Writes the whole file `path`, so that readers see the old file or the new one, and
    nothing is ever written through a link.

    The bytes go to a new file beside `path`, created with ``O_CREAT | O_EXCL | O_NOFOLLOW``
    under a random name (so a link planted at any name cannot receive them), flushed to disk,
    and renamed over `path` (a rename replaces the directory entry, never what a link at it
    points to). The directory is opened once and every step is taken relative to it. The
    new file gets the modes a plain ``open`` would (0666 less the umask).

    Args:
      path: the file to write; its directory must exist.
      content: the bytes, or a function that writes them to the open file it is given (opened
        for reading too, so it may check what it wrote; closing it is allowed).
      within: a directory the caller trusts (e.g. a checkpoint given on the command line, which
        may itself be a link the user made), holding `path`. Every directory below it on the
        way to `path` must be a real directory, not a link.
    Raises:
      LinkedPathError: naming the path, if `path` or a directory below `within` is a symlink.
      IsADirectoryError: if `path` is a directory.
      ValueError: if `path` is not inside `within`.
    """
    shown = os.fspath(path)
    parent, name = os.path.split(os.path.abspath(shown))
    directory = _open_parent(parent, within, shown)
    try:
        _refuse_link(name, directory, shown)
        temporary, fd = _create_beside(name, directory, shown)
        try:
            with os.fdopen(fd, "w+b", closefd=False) as f:
                if callable(content):
                    content(f)
                else:
                    f.write(content)
            os.fsync(fd)
            os.close(fd)
            fd = -1
            _refuse_link(name, directory, shown)  # again: one may have been planted meanwhile
            _at(os.replace, directory, parent)(temporary, name)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            with contextlib.suppress(OSError):
                _at(os.unlink, directory, parent)(temporary)
            raise
        if directory is not None:
            os.fsync(directory)
        else:
            _fsync_directory(parent)
    finally:
        if directory is not None:
            os.close(directory)


def _at(function: Callable, directory: int | None, parent: str) -> Callable:
    """`function` of names in the open `directory` (or, without descriptor calls, in `parent`)."""
    if directory is None:
        if function is os.replace:
            return lambda a, b: os.replace(os.path.join(parent, a), os.path.join(parent, b))
        return lambda a, **kw: function(os.path.join(parent, a), **kw)
    if function is os.replace:
        return lambda a, b: os.replace(a, b, src_dir_fd=directory, dst_dir_fd=directory)
    return lambda a, **kw: function(a, dir_fd=directory, **kw)


def _open_parent(parent: str, within: str | os.PathLike[str] | None, shown: str) -> int | None:
    """The directory `parent`, open, checked link-free below `within`; None where the system
    has no descriptor-relative calls (then the checks are made by path)."""
    steps: list[str] = []
    if within is not None:
        root = os.path.abspath(within)
        relative = os.path.relpath(parent, root)
        if relative == os.pardir or relative.startswith(os.pardir + os.sep):
            raise ValueError(f"{shown!r} is not inside {os.fspath(within)!r}")
        steps = [part for part in relative.split(os.sep) if part not in ("", os.curdir)]
        parent = root
    if not _AT_DIRECTORY:
        for part in steps:
            parent = os.path.join(parent, part)
            if os.path.islink(parent):
                raise _linked(parent, shown)
        return None
    directory = os.open(parent, _DIRECTORY_FLAGS)
    for part in steps:
        try:
            step = os.open(part, _DIRECTORY_FLAGS | _NOFOLLOW, dir_fd=directory)
        except OSError:
            link = os.path.join(parent, part)
            is_link = stat.S_ISLNK(os.stat(part, dir_fd=directory, follow_symlinks=False).st_mode)
            os.close(directory)
            if is_link:
                raise _linked(link, shown) from None
            raise
        os.close(directory)
        directory, parent = step, os.path.join(parent, part)
    return directory


def _refuse_link(name: str, directory: int | None, shown: str) -> None:
    try:
        mode = _at(os.stat, directory, os.path.dirname(os.path.abspath(shown)))(
            name, follow_symlinks=False
        ).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise _linked(shown, shown)
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(f"cannot write {shown!r}: it is a directory")


def _linked(link: str, shown: str) -> LinkedPathError:
    target = os.readlink(link) if os.path.islink(link) else "?"
    where = "it is" if link == shown else f"{link!r}, a directory on its way, is"
    return LinkedPathError(
        f"refusing to write {shown!r}: {where} a symbolic link (to {target!r}), and lowbit never "
        "writes through a link (it may have come with a downloaded checkpoint). Remove the link, "
        "or write somewhere else."
    )


def _create_beside(name: str, directory: int | None, shown: str) -> tuple[str, int]:
    """A new, empty file ``.<name>.<random>.tmp`` beside `name`, open for reading and writing."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    create = _at(os.open, directory, os.path.dirname(os.path.abspath(shown)))
    for _ in range(100):
        temporary = f".{name}.{secrets.token_hex(8)}.tmp"
        try:
            return temporary, create(temporary, flags=flags, mode=0o666)
        except FileExistsError:  # taken (or a link planted at it): another name
            continue
    raise FileExistsError(f"cannot create a temporary file beside {shown!r}")


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
