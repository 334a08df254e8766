"""A checkpoint's leaves by path, read one at a time: for streaming it into another format.

`load_checkpoint` builds the whole tree; `checkpoint_leaves` checks the checkpoint the same
way (manifest sealed by the tensor file, every tensor's sha256 streamed once) and then reads
a leaf only when it is looked up, so an export holds one leaf at a time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

import jax

from lowbit.io._checkpoint import (
    _check_tensor_file,
    _TensorReader,
    _verified_manifest,
    _verify,
    is_sharded,
    piece_reader,
)
from lowbit.io._checkpoint_dir import MANIFEST_FILE, TENSORS_FILE, open_checkpoint
from lowbit.io._manifest import Plan, build_tree, decode_tree
from lowbit.io._tree import Path


class _Leaf:
    """A plan over one leaf's node, for `build_tree` (which reads only ``tree``)."""

    def __init__(self, node: Mapping[str, Any]):
        self.tree = node


def _leaves(node: Mapping[str, Any], path: Path, out: dict[Path, Mapping[str, Any]]) -> None:
    kind = node["kind"]
    if kind == "dict":
        for key, child in node["items"]:
            _leaves(child, (*path, key), out)
    elif kind in ("list", "tuple"):
        for i, child in enumerate(node["items"]):
            _leaves(child, (*path, i), out)
    elif kind != "none":
        out[path] = node


class CheckpointLeaves(Mapping):
    """{leaf path tuple: leaf} of an open checkpoint, each read when looked up.

    ``abstract(path)`` gives the leaf with shape structs for arrays, reading nothing, so a
    writer can plan (e.g. `export_gguf`) before it reads.
    """

    def __init__(self, plan: Plan, reader: Mapping[str, Any]):
        self._plan, self._reader = plan, reader
        self._nodes: dict[Path, Mapping[str, Any]] = {}
        _leaves(plan.tree, (), self._nodes)
        self._shapes = {
            name: jax.ShapeDtypeStruct(shape, dtype)
            for name, (dtype, shape) in plan.tensors.items()
        }

    def __getitem__(self, path: Path) -> Any:
        return build_tree(_Leaf(self._nodes[tuple(path)]), self._reader)

    def abstract(self, path: Path) -> Any:
        """The leaf at `path` with `jax.ShapeDtypeStruct`s for its arrays."""
        return build_tree(_Leaf(self._nodes[tuple(path)]), self._shapes)

    def __iter__(self) -> Iterator[Path]:
        return iter(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)


@contextlib.contextmanager
def checkpoint_leaves(path: str | os.PathLike[str]) -> Iterator[CheckpointLeaves]:
    """Opens the checkpoint at `path` for reading leaf by leaf.

    Example:
      >>> import tempfile
      >>> import jax.numpy as jnp
      >>> from lowbit.io import save_checkpoint
      >>> tmp = tempfile.TemporaryDirectory()
      >>> save_checkpoint(tmp.name + "/ck", {"layers": {0: {"kernel": jnp.ones((4, 2))}}})
      >>> with checkpoint_leaves(tmp.name + "/ck") as leaves:
      ...     list(leaves), leaves.abstract(("layers", 0, "kernel")).shape
      ([('layers', 0, 'kernel')], (4, 2))
      >>> tmp.cleanup()

    Raises:
      CheckpointError: as `load_checkpoint`, before anything is yielded.
    """
    path = os.fspath(path)
    data_file = os.path.join(path, TENSORS_FILE)
    with open_checkpoint(path) as snapshot:
        manifest, header = _verified_manifest(snapshot, path)
        sharded = is_sharded(manifest)
        file = os.path.join(path, MANIFEST_FILE)
        plan = decode_tree(manifest["tree"], manifest["tensors"], file, sharded=sharded)
        if sharded:  # written by several processes: each leaf assembled from its shards
            yield CheckpointLeaves(
                plan,
                piece_reader(snapshot, manifest, plan, header, dict.fromkeys(plan.tensors), path),
            )
            return
        entries = _check_tensor_file(plan, header, data_file)
        digests = {name: info["sha256"] for name, info in manifest["tensors"].items()}
        for name, entry in entries.items():
            _verify(snapshot.tensors, entry, digests[name], data_file)
        reader = _TensorReader(snapshot.tensors, plan, entries, digests, None, data_file)
        yield CheckpointLeaves(plan, reader)
