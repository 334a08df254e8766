"""The writing side of a checkpoint saved by several processes: each writes its own pieces.

Every process runs the same save. Process 0 creates the temporary directory beside the target
(`lowbit._atomic`) and tells the others its name; each process writes the pieces it owns
(of every array split over processes, the device pieces whose ``replica_id`` is 0 and that
live on its devices; every other array, whole, by process 0) into its own
``process-NNNNN.safetensors`` there. Then the processes agree on the manifest: each sends its
table of pieces (tensor, box of the global index space, sha256), process 0 checks that the
pieces of every tensor tile it exactly (processes that saved different trees are caught here)
and sends the manifest's sha256, each process seals its file's header with it, and once every
process has sealed its file, process 0 writes ``manifest.json`` and swaps the directory in.

A process that fails or dies before that swap leaves the old checkpoint in place: the others
raise an error naming it (`lowbit.io._processes`), and process 0 removes the temporary.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any

import jax
import numpy as np

from lowbit._atomic import (
    make_temporary,
    release_temporary,
    remove_stale_temporaries,
)
from lowbit.io._checkpoint_dir import publish_checkpoint, resolve_save_path
from lowbit.io._manifest import MANIFEST_DIGEST_KEY, CheckpointError
from lowbit.io._processes import Exchange
from lowbit.io._safetensors_file import storage_view
from lowbit.io._safetensors_writer import TensorFileWriter
from lowbit.io._shard_index import (
    box_of,
    check_tiling,
    is_shard_file,
    key_of,
    shard_file_name,
)

# The messages of one save, in order (see `Exchange`).
_STEPS = ("directory", "pieces", "manifest", "sealed", "published")
SPOOL_SUFFIX = ".spool"
# Records which process wrote a shard file, beside the manifest digest, in its header.
PROCESS_KEY = "lowbit.process"


class WriterFiles:
    """What a temporary directory of a save may hold (for `remove_stale_temporaries`)."""

    def __init__(self, names: frozenset[str]):
        self._names = names

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        return name in self._names or bool(is_shard_file(name.removesuffix(SPOOL_SUFFIX)))


class ProcessParts:
    """This process's part of a save by several processes.

    Args:
      given: the checkpoint path as the caller gave it.
      writer_files: what a writer's temporary directory may hold.
      timeout: seconds to wait for each other process at each step.
    Raises:
      ValueError: as `resolve_save_path`. ProcessError: if process 0 could not create the
        temporary directory, or did not say where it is within `timeout`.
    """

    def __init__(self, given: str | os.PathLike[str], writer_files: Any, timeout: float):
        self._given = given
        self._exchange = x = Exchange(repr(os.fspath(given)), timeout)
        self._tmp: str | None = None
        self._lock: int | None = None
        self._file: TensorFileWriter | None = None
        self._writer_files = writer_files
        self.file_name = shard_file_name(x.process)
        self._pieces: dict[str, list[dict[str, Any]]] = {}
        try:
            self._target = resolve_save_path(given)
            parent = os.path.dirname(self._target)
            if x.process == 0:
                os.makedirs(parent, exist_ok=True)
                if os.path.isdir(self._target):
                    remove_stale_temporaries(self._target, writer_files)
                self._tmp, self._lock = make_temporary(self._target)
                x.send("directory", [self._target, os.path.basename(self._tmp)])
            else:
                target, name = x.receive("directory", 0)
                if target != self._target:
                    raise ValueError(
                        f"process {x.process} saves to {self._target!r} but process 0 to "
                        f"{target!r}: every process must save to the same checkpoint path"
                    )
                self._tmp = os.path.join(parent, os.path.basename(name))
            file = os.path.join(self._tmp, self.file_name)
            self._file = TensorFileWriter(file, file + SPOOL_SUFFIX)
        except BaseException as err:
            self.abort(err)
            raise

    def add(self, name: str, array: Any) -> None:
        """Writes this process's pieces of one tensor: of an array split over processes, the
        pieces it owns; any other array, by process 0 alone: its device pieces if it is split
        over this process's devices, else all of it."""
        shape = tuple(array.shape)
        split = isinstance(array, jax.Array) and not array.sharding.is_fully_replicated
        if split and (not array.is_fully_addressable or self._exchange.process == 0):
            pieces = [
                (box_of(s.index, shape), s.data)
                for s in array.addressable_shards
                if s.replica_id == 0
            ]
        elif self._exchange.process == 0:
            pieces = [(tuple((0, n) for n in shape), array)]
        else:
            pieces = []
        for box, data in pieces:
            key = key_of(name, box)
            sha256 = self._file.add(key, storage_view(np.asarray(data)))
            self._pieces.setdefault(name, []).append(
                {
                    "file": self.file_name,
                    "key": key,
                    "box": [list(b) for b in box],
                    "sha256": sha256,
                }
            )

    def close(self, head: dict[str, Any], tensors: dict[str, dict[str, Any]]) -> None:
        """Agrees on the manifest with the other processes and publishes the checkpoint.

        Args:
          head: the manifest's fields but ``files`` and ``tensors``.
          tensors: tensor name -> its manifest entry but ``shards`` (the same in every
            process).
        Raises:
          ProcessError: naming the process that failed, died or did not answer in time.
          CheckpointError: if the processes' pieces of a tensor do not tile it (the processes
            saved different trees or shardings).
        """
        x = self._exchange
        try:
            x.send("pieces", self._pieces)
            if x.process == 0:
                manifest = _manifest(head, tensors, x.receive_all("pieces"), x.count)
                manifest_bytes = json.dumps(manifest, indent=1, allow_nan=False).encode("utf-8")
                x.send("manifest", hashlib.sha256(manifest_bytes).hexdigest())
            digest = x.receive("manifest", 0)
            self._file.finish({MANIFEST_DIGEST_KEY: digest, PROCESS_KEY: str(x.process)})
            x.send("sealed", True)
            if x.process != 0:
                x.receive("published", 0)  # process 0 has read every table: drop ours
                x.forget("pieces")
                return
            x.receive_all("sealed")
            publish_checkpoint(self._tmp, manifest_bytes, self._given, self._target)
            x.send("published", True)
            x.forget("pieces")
        except BaseException as err:
            self.abort(err)
            raise
        # After the swap the temporary holds the previous checkpoint.
        self._remove()
        remove_stale_temporaries(self._target, self._writer_files)

    def abort(self, err: BaseException | None = None) -> None:
        """Discards this process's part; process 0 removes the temporary directory. The other
        processes are told, so they stop waiting."""
        reason = "aborted" if err is None else f"{type(err).__name__}: {err}"
        self._exchange.fail(_STEPS, f"process {self._exchange.process}: {reason}")
        if self._file is not None:
            self._file.discard()
            self._file = None
        if self._exchange.process == 0:
            self._remove()

    def _remove(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
        release_temporary(self._lock)
        self._tmp, self._lock = None, None


def _manifest(
    head: dict[str, Any], tensors: dict[str, dict[str, Any]], tables: list[Any], count: int
) -> dict[str, Any]:
    """The manifest of a save by `count` processes, from each process's table of pieces."""
    entries = {}
    for name, info in tensors.items():
        pieces = [piece for table in tables for piece in table.get(name, [])]
        boxes = [tuple(tuple(b) for b in piece["box"]) for piece in pieces]
        check_tiling(boxes, tuple(info["shape"]), f"tensor {name!r} as saved by the processes")
        entries[name] = {**info, "shards": sorted(pieces, key=lambda p: p["box"])}
    for process, table in enumerate(tables):
        extra = sorted(set(table) - set(tensors))
        if extra:
            raise CheckpointError(
                f"process {process} saved tensor {extra[0]!r}, which process 0's tree lacks: "
                "every process must save the same params tree"
            )
    files = [shard_file_name(p) for p in range(count)]
    return {**head, "files": files, "tensors": entries}
