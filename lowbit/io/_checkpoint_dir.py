"""The checkpoint directory on disk: what a save may replace, and one consistent read of it.

A checkpoint is a directory holding exactly ``manifest.json`` and ``model.safetensors`` (or,
written by several processes, ``manifest.json`` and one ``process-NNNNN.safetensors`` per
process: `lowbit.io._shard_index`). It
is only ever published whole (`lowbit._atomic`): files inside a published directory are
never rewritten, a new checkpoint replaces the directory. So a reader that opens both files
from the same directory (resolved once, held open as a descriptor) reads one checkpoint, old
or new, never a mix: if a save swaps the directory between the two opens, the reader notices
that the path names another directory now and starts again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import BinaryIO

from lowbit._atomic import publish_permissions, replace_directory, same_directory, write_file
from lowbit._untrusted import open_regular
from lowbit.io._manifest import FORMAT_NAME, READABLE_VERSIONS, CheckpointError
from lowbit.io._shard_index import is_shard_file
from lowbit.io._untrusted_json import load_json

TENSORS_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"
CHECKPOINT_FILES = frozenset({TENSORS_FILE, MANIFEST_FILE})

# A manifest larger than this is not one of ours (a 30-layer model's is ~100 KB).
MAX_MANIFEST_BYTES = 256 * 2**20
# Saves swapping the directory under a reader faster than it can open two files, this often in
# a row, would be a writer in a loop; give up rather than spin.
_ATTEMPTS = 100
_DIR_FD = os.open in os.supports_dir_fd and hasattr(os, "O_DIRECTORY")


def publish_checkpoint(
    tmp: str, manifest: bytes, given: str | os.PathLike[str], target: str
) -> None:
    """Writes `manifest` into the temporary directory `tmp` and swaps it in at `target`.

    `given` is the path the caller saved to: it is resolved again first, because writing takes a
    while and a symlink may have been pointed elsewhere since `resolve_save_path` chose `target`.
    """
    write_file(os.path.join(tmp, MANIFEST_FILE), manifest)
    publish_permissions(tmp)
    if resolve_save_path(given) != target:
        raise ValueError(f"{os.fspath(given)!r} now points elsewhere than when the save began")
    replace_directory(tmp, target)


def resolve_save_path(path: str | os.PathLike[str]) -> str:
    """Where a checkpoint saved at `path` goes, after checking nothing else is lost there.

    Symlinks are followed (a ``latest -> run1`` link keeps pointing at ``run1``, which is
    replaced). The resolved directory may be missing, empty, or a lowbit checkpoint: holding
    nothing but ``manifest.json`` (of this format, a version this library knows) and
    ``model.safetensors`` or per-process shard files, all regular files.

    Returns:
      The resolved absolute path to write.
    Raises:
      ValueError: naming the path and what is in the way, if it is anything else.
    """
    given = os.fspath(path)
    target = os.path.realpath(given)
    shown = repr(given) if os.path.abspath(given) == target else f"{given!r} (-> {target!r})"
    if not os.path.lexists(target):
        return target
    if not os.path.isdir(target):
        problem = "is not a directory"
    else:
        problem = _not_a_checkpoint(target)
    if problem:
        raise ValueError(
            f"{shown} {problem}, so it is not a lowbit checkpoint; refusing to replace it. "
            "Save to a new or empty directory, or remove this one yourself."
        )
    return target


def _not_a_checkpoint(directory: str) -> str | None:
    """Why `directory` may not be replaced, or None if it is empty or one of ours."""
    names = sorted(os.listdir(directory))
    if not names:
        return None
    for name in names:
        if name not in CHECKPOINT_FILES and not is_shard_file(name):
            return f"holds {name!r}, which a checkpoint does not"
        if not os.path.isfile(os.path.join(directory, name)) or os.path.islink(
            os.path.join(directory, name)
        ):
            return f"holds {name!r}, which is not a regular file"
    if MANIFEST_FILE not in names:
        return f"has no {MANIFEST_FILE}"
    file = os.path.join(directory, MANIFEST_FILE)
    if os.path.getsize(file) > MAX_MANIFEST_BYTES:
        return f"has a {MANIFEST_FILE} larger than {MAX_MANIFEST_BYTES >> 20} MiB"
    with open(file, "rb") as f:
        raw = f.read()
    try:
        manifest = load_json(raw, file)
    except ValueError:  # also a manifest nested too deeply for the parser
        return f"has a {MANIFEST_FILE} that is not JSON"
    if not isinstance(manifest, dict):
        return f"has a {MANIFEST_FILE} that is not a JSON object"
    version = manifest.get("format_version")
    known = isinstance(version, int) and not isinstance(version, bool)
    if manifest.get("format") != FORMAT_NAME or not (known and version in READABLE_VERSIONS):
        return (
            f"has a {MANIFEST_FILE} of format {manifest.get('format')!r} version {version!r}, "
            f"not {FORMAT_NAME!r} {min(READABLE_VERSIONS)}..{max(READABLE_VERSIONS)}"
        )
    return None


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One checkpoint directory's files, opened from the same directory.

    Attributes:
      manifest: the manifest file's bytes.
      tensors: the tensor file, open for binary reading, or None if the directory lacks it.
      shards: the per-process shard files it holds, by name, open for binary reading.
    """

    manifest: bytes
    tensors: BinaryIO | None
    shards: dict[str, BinaryIO] = dataclasses.field(default_factory=dict)

    def close(self) -> None:
        for f in (self.tensors, *self.shards.values()):
            if f is not None:
                f.close()


@contextlib.contextmanager
def open_checkpoint(path: str) -> Iterator[Snapshot]:
    """Reads the manifest and opens the tensor file of the checkpoint at `path`, consistently.

    Raises:
      CheckpointError: if there is no manifest at `path`.
    """
    snapshot = _snapshot(path)
    try:
        yield snapshot
    finally:
        snapshot.close()


def _snapshot(path: str) -> Snapshot:
    manifest_file = os.path.join(path, MANIFEST_FILE)
    missing = CheckpointError(f"{manifest_file}: no checkpoint manifest at {path!r}")
    if not _DIR_FD:  # no descriptor-relative opens here: read by path
        try:
            with open_regular(manifest_file, CheckpointError) as f:
                manifest = f.read(MAX_MANIFEST_BYTES + 1)
        except (FileNotFoundError, NotADirectoryError):
            raise missing from None
        shards = {}
        for name in _shard_names(os.listdir(path)):
            f = _open_or_none(os.path.join(path, name))
            if f is not None:
                shards[name] = f
        return Snapshot(manifest, _open_or_none(os.path.join(path, TENSORS_FILE)), shards)
    for _ in range(_ATTEMPTS):
        try:
            directory = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            raise missing from None
        try:
            snapshot = _read_directory(path, directory)
            if snapshot is not None:
                return snapshot
            if same_directory(path, directory):
                raise missing
        finally:
            os.close(directory)
        # A save swapped the directory (and removed the old one) between our opens: again.
    raise CheckpointError(f"{path}: replaced by other saves {_ATTEMPTS} times while opening it")


def _read_directory(path: str, directory: int) -> Snapshot | None:
    """The snapshot of the open `directory`; None if it has no manifest (or lost it)."""
    try:
        manifest_file = open_regular(
            MANIFEST_FILE,
            CheckpointError,
            dir_fd=directory,
            shown=os.path.join(path, MANIFEST_FILE),
        )
    except FileNotFoundError:
        return None
    with manifest_file as f:
        manifest = f.read(MAX_MANIFEST_BYTES + 1)
    tensors = _open_or_none(os.path.join(path, TENSORS_FILE), directory)
    snapshot = Snapshot(manifest, tensors)
    for name in _shard_names(os.listdir(directory)):
        f = _open_or_none(os.path.join(path, name), directory)
        if f is not None:
            snapshot.shards[name] = f
        elif not same_directory(path, directory):
            snapshot.close()
            return None  # removed by the save that replaced it: read the new one
    if tensors is None and not snapshot.shards and not same_directory(path, directory):
        return None  # removed by the save that replaced it: read the new one
    return snapshot


def _shard_names(names: list[str]) -> list[str]:
    return sorted(n for n in names if is_shard_file(n))


def _open_or_none(name: str, directory: int | None = None) -> BinaryIO | None:
    """The regular file `name` (its base name relative to `directory` if given), or None."""
    try:
        if directory is None:
            return open_regular(name, CheckpointError)
        return open_regular(os.path.basename(name), CheckpointError, dir_fd=directory, shown=name)
    except FileNotFoundError:
        return None
