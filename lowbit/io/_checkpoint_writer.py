"""`CheckpointWriter`: a checkpoint written one leaf at a time, published atomically.

The checkpoint is the one `save_checkpoint` writes (which is this writer given the whole tree
at once): the same manifest and the same tensor file. Each leaf's tensors go to disk (and
their sha256 into the manifest's table) when the leaf is added, so the writer holds one leaf
at a time and a model larger than memory can be converted tensor by tensor. Everything is
written into a temporary directory beside the target (`lowbit._atomic`) and swapped in by
`close`; until then, and after any failure, the target is untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from lowbit._atomic import (
    make_temporary,
    release_temporary,
    remove_stale_temporaries,
)
from lowbit._version import __version__
from lowbit.io._checkpoint_dir import (
    CHECKPOINT_FILES,
    TENSORS_FILE,
    publish_checkpoint,
    resolve_save_path,
)
from lowbit.io._checkpoint_parts import ProcessParts, WriterFiles
from lowbit.io._manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_DIGEST_KEY,
    SHARDED_FORMAT_VERSION,
)
from lowbit.io._safetensors_file import storage_view
from lowbit.io._safetensors_writer import TensorFileWriter
from lowbit.io._tree import Path, encode_tree, path_name

# The tensor bytes wait here (inside the temporary directory) until the header can be written.
SPOOL_FILE = f"{TENSORS_FILE}.spool"
# What a writer's temporary directory may hold, so a killed writer's is recognised as stale
# (the per-process shard files and their spools included).
WRITER_FILES = WriterFiles(CHECKPOINT_FILES | {SPOOL_FILE})


def recipe_json(recipe: Any) -> str | None:
    """The JSON text a checkpoint stores for `recipe` (a Recipe, its JSON, or None).

    Raises:
      TypeError: for anything else; ValueError: for text that is not JSON.
    """
    if recipe is None:
        return None
    if isinstance(recipe, str):
        text = recipe
    elif callable(getattr(recipe, "to_json", None)):
        text = recipe.to_json()
    else:
        raise TypeError(
            f"recipe must be a Recipe (anything with to_json()) or its JSON text, got "
            f"{type(recipe).__name__}"
        )
    try:
        json.loads(text)
    except (TypeError, json.JSONDecodeError) as err:
        raise ValueError(f"recipe JSON does not parse: {err}") from None
    return text


# Whether to write one shard file per process (format version 3); None: when there are
# several processes. Tests set it to write that layout from one process.
PER_PROCESS_FILES: bool | None = None


class _Branch(dict):
    """A dict node still being filled by `CheckpointWriter.add`."""


def _keys(path: Any) -> Path:
    if isinstance(path, str):
        return tuple(int(p) if p.isdigit() else p for p in path.split("/")) if path else ()
    keys = tuple(path)
    for key in keys:
        if isinstance(key, bool) or not isinstance(key, str | int):
            raise TypeError(
                f"CheckpointWriter.add: path {path!r} has key {key!r} of type "
                f"{type(key).__name__}; accepted: str and int keys, or a 'a/b/0' string"
            )
    return keys


def _node(branch: Any) -> dict[str, Any]:
    if not isinstance(branch, _Branch):
        return branch
    return {"kind": "dict", "items": [[key, _node(child)] for key, child in branch.items()]}


class CheckpointWriter:
    """Writes a checkpoint leaf by leaf; `close` publishes it atomically.

    Use it as a context manager: leaving the block normally publishes the checkpoint, leaving
    it by an exception discards everything written (the target is never touched until then).

    With several JAX processes (``jax.process_count() > 1``) every process must run the same
    writer with the same leaves, in the same order: each writes only the pieces it owns of
    arrays split over processes (`lowbit.io._checkpoint_parts`), into its own file, and
    `close` publishes the whole checkpoint once every process has written its part.

    Args:
      path: the checkpoint directory, as in `save_checkpoint`: missing, empty or a lowbit
        checkpoint (replaced whole); a symlink is followed.
      recipe: the `Recipe` the params were quantized with (or its JSON text), stored.
      metadata: JSON-serialisable user metadata, stored as is.
      timeout: several processes only: seconds to wait for the other processes at each step
        of the save before raising an error that names the one missing.
    Raises:
      ValueError: naming the path, if it exists and is neither empty nor a lowbit checkpoint;
        or if `metadata` is not JSON. TypeError: for a bad `recipe`.

    Example:
      >>> import tempfile
      >>> import jax.numpy as jnp
      >>> from lowbit.io import load_checkpoint
      >>> tmp = tempfile.TemporaryDirectory()
      >>> with CheckpointWriter(tmp.name + "/ckpt", metadata={"step": 1}) as writer:
      ...     writer.add("layers/0/kernel", jnp.ones((4, 2)))
      ...     writer.add(("norm", "scale"), jnp.ones(2))
      >>> sorted(load_checkpoint(tmp.name + "/ckpt")["layers"][0])
      ['kernel']
      >>> tmp.cleanup()
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        recipe: Any = None,
        metadata: Mapping[str, Any] | None = None,
        timeout: float = 600.0,
    ):
        self._given = path
        try:
            json.dumps(metadata, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise ValueError(f"metadata must be JSON-serialisable: {err}") from None
        self._recipe, self._metadata = recipe_json(recipe), metadata
        self._root: Any = _Branch()
        self._whole = False  # the root was given as one tree
        self._entries: dict[str, dict[str, Any]] = {}
        self._parts: ProcessParts | None = None
        if PER_PROCESS_FILES or (PER_PROCESS_FILES is None and jax.process_count() > 1):
            self._parts = ProcessParts(path, WRITER_FILES, timeout)
            self._open = True
            return
        self._target = resolve_save_path(path)
        os.makedirs(os.path.dirname(self._target), exist_ok=True)
        if os.path.isdir(self._target):
            # Only while a checkpoint is in place: after a crash in the non-atomic fallback
            # swap, the temporaries hold the only copies.
            remove_stale_temporaries(self._target, WRITER_FILES)
        self._tmp, self._lock = make_temporary(self._target)
        try:
            self._file = TensorFileWriter(
                os.path.join(self._tmp, TENSORS_FILE), os.path.join(self._tmp, SPOOL_FILE)
            )
        except BaseException:
            self._cleanup()
            raise
        self._open = True

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if not self._open:
            return
        if kind is None:
            self.close()
        elif self._parts is not None:
            self._open = False
            self._parts.abort(value)  # the other processes learn why
        else:
            self.abort()

    def add(self, path: Any, leaf: Any) -> None:
        """Writes one leaf (or a subtree) at `path`.

        Args:
          path: a key tuple (``("layers", 0, "attn", "q_proj", "kernel")``) or a
            ``"layers/0/attn/q_proj/kernel"`` string (digit parts become ints); ``()`` or
            ``""`` makes `leaf` the whole tree (then nothing else may be added).
          leaf: a float array, `QArray`, `NMSparse`, scalar or None, or a subtree of them
            (whatever `save_checkpoint` stores). Its bytes are on disk when this returns.
        Raises:
          ValueError: if the path was added already, passes through a leaf, or the writer is
            closed. TypeError: as `save_checkpoint`, naming the path, for what cannot be
            stored.
        """
        if not self._open:
            raise ValueError("CheckpointWriter.add: the writer is closed")
        keys = _keys(path)
        node, tensors = encode_tree(leaf, keys, split=self._parts is not None)
        parent = self._parent(keys)
        for name in tensors:
            if name in self._entries:
                raise ValueError(f"two leaves are both stored as tensor {name!r}; rename a key")
        try:
            for name, (leaf_path, role, array) in tensors.items():
                if self._parts is not None:
                    self._entries[name] = {
                        "path": list(leaf_path),
                        "role": role,
                        "dtype": np.dtype(array.dtype).name,
                        "shape": list(array.shape),
                    }
                    self._parts.add(name, array)
                    continue
                view = storage_view(array)
                self._entries[name] = {
                    "path": list(leaf_path),
                    "role": role,
                    "dtype": array.dtype.name,
                    "shape": list(array.shape),
                    "sha256": self._file.add(name, view),
                }
                del view, array
        except BaseException:
            self.abort()  # the spool no longer matches the table
            raise
        if parent is None:
            self._root, self._whole = node, True
        else:
            parent[keys[-1]] = node

    def _parent(self, keys: Path) -> _Branch | None:
        """The branch the leaf at `keys` goes into (None: the root itself), checked free."""
        if self._whole or (not keys and self._root):
            raise ValueError(
                "CheckpointWriter.add: a whole tree was added at () (or leaves were added "
                "before it); give either one tree at () or leaves at their paths"
            )
        if not keys:
            return None
        branch = self._root
        for i, key in enumerate(keys[:-1]):
            child = branch.setdefault(key, _Branch())
            if not isinstance(child, _Branch):
                raise ValueError(
                    f"CheckpointWriter.add: path {path_name(keys)!r} passes through the leaf "
                    f"{path_name(keys[: i + 1])!r}"
                )
            branch = child
        if keys[-1] in branch:
            raise ValueError(f"CheckpointWriter.add: {path_name(keys)!r} was added already")
        return branch

    def close(self) -> None:
        """Writes the manifest and the tensor file's header and publishes the checkpoint in
        one atomic step (`save_checkpoint`'s rules).

        Raises:
          ValueError: if the path now points elsewhere than when the writer was opened.
        """
        if not self._open:
            raise ValueError("CheckpointWriter.close: the writer is closed")
        self._open = False
        head = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "library_version": __version__,
            "recipe": self._recipe,
            "metadata": self._metadata,
            "tree": _node(self._root),
        }
        if self._parts is not None:
            head["format_version"] = SHARDED_FORMAT_VERSION
            self._parts.close(head, self._entries)
            return
        try:
            manifest = {**head, "tensors": self._entries}
            manifest_bytes = json.dumps(manifest, indent=1, allow_nan=False).encode("utf-8")
            digest = hashlib.sha256(manifest_bytes).hexdigest()
            self._file.finish({MANIFEST_DIGEST_KEY: digest})
            publish_checkpoint(self._tmp, manifest_bytes, self._given, self._target)
        finally:
            # After a swap the temporary holds the previous checkpoint; after a failure, the
            # partial one.
            self._cleanup()
        remove_stale_temporaries(self._target, WRITER_FILES)

    def abort(self) -> None:
        """Discards everything written; the target stays as it was."""
        self._open = False
        if self._parts is not None:
            self._parts.abort()
            return
        self._cleanup()

    def _cleanup(self) -> None:
        file = getattr(self, "_file", None)
        if file is not None:
            file.discard()
        shutil.rmtree(self._tmp, ignore_errors=True)
        release_temporary(self._lock)
        self._lock = None
