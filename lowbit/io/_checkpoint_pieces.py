"""The reading side of sharded loads: each process reads only the stored shards its pieces need.

Used for checkpoints written by several processes (format version 3: one shard file per
process) and for any load whose target sharding spans processes (a one-file checkpoint is then
one shard per tensor). For every tensor, the target sharding says which boxes of the global
array this process's devices hold; the stored shards that meet them are checked (sha256
against the manifest) and read, and the pieces are assembled and placed on their devices
(`jax.make_array_from_single_device_arrays`), so no process reads or holds another's pieces
beyond the stored shards they share.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping
from typing import Any, BinaryIO

import jax
import numpy as np

from lowbit.io._manifest import CheckpointError, Plan
from lowbit.io._safetensors_file import TensorEntry, is_native, read_file_header, read_tensor
from lowbit.io._shard_index import (
    Box,
    Shard,
    box_of,
    decode_shards,
    is_shard_file,
    overlaps,
)
from lowbit.io._tree import Path, path_name
from lowbit.qarray import check_tiles_within_shards


@dataclasses.dataclass(frozen=True)
class Stored:
    """A shard and where its bytes are: the open file and its header entry."""

    shard: Shard
    f: BinaryIO
    entry: TensorEntry


def resolve_targets(sharding: Any, plan: Plan) -> dict[str, Any]:
    """tensor name -> where it goes: `load_checkpoint`'s `sharding` resolved for each tensor
    (a function is called once per tensor, in the manifest's order)."""
    if callable(sharding) and not isinstance(sharding, jax.sharding.Sharding):
        return {name: sharding(*plan.places[name], plan.tensors[name][1]) for name in plan.tensors}
    return dict.fromkeys(plan.tensors, sharding)


def _spans(target: Any) -> bool:
    return isinstance(target, jax.sharding.Sharding) and not target.is_fully_addressable


def spans_processes(targets: Mapping[str, Any]) -> bool:
    """Whether any tensor's target sharding spans several processes."""
    return any(_spans(target) for target in targets.values())


def whole_shards(f: BinaryIO, entries: dict[str, TensorEntry], digests: dict[str, str], plan):
    """A one-file checkpoint's tensors as one shard each."""
    return {
        name: [
            Stored(
                Shard(os.path.basename(f.name), name, tuple((0, n) for n in shape), digests[name]),
                f,
                entries[name],
            )
        ]
        for name, (_, shape) in plan.tensors.items()
    }


def shard_headers(
    snapshot: Any, manifest: dict[str, Any], path: str, seal: tuple[str, str]
) -> dict[str, dict[str, TensorEntry]]:
    """Checks the shard files of a version-3 checkpoint: present, sealed with its manifest.

    Args:
      seal: (header key, expected value): the manifest's sha256 every file must carry.
    Returns:
      shard file name -> its header entries.
    Raises:
      CheckpointError: naming the file: listed but missing, present but not listed, a
        malformed header, or a header not sealed with this manifest.
    """
    where = os.path.join(path, "manifest.json")
    files = manifest.get("files")
    if not isinstance(files, list) or not all(
        isinstance(f, str) and is_shard_file(f) for f in files
    ):
        raise CheckpointError(f"{where}: 'files' is not a list of process-NNNNN.safetensors names")
    extra = sorted(set(snapshot.shards) - set(files))
    if extra:
        raise CheckpointError(f"{os.path.join(path, extra[0])}: a shard file the manifest lacks")
    headers = {}
    for name in files:
        file = os.path.join(path, name)
        if name not in snapshot.shards:
            raise CheckpointError(f"{file}: missing (the manifest lists it)")
        try:
            entries, meta = read_file_header(snapshot.shards[name])
        except ValueError as err:
            raise CheckpointError(str(err)) from None
        if meta.get(seal[0]) != seal[1]:
            raise CheckpointError(
                f"{file}: not written with this {os.path.basename(where)} (its header's manifest "
                "digest differs): edited, replaced or from another save"
            )
        headers[name] = entries
    return headers


def sharded_files(
    snapshot: Any, manifest: dict[str, Any], plan: Plan, path: str, headers: dict[str, Any]
) -> dict[str, list[Stored]]:
    """Checks a version-3 checkpoint's shards against its manifest (headers only).

    Args:
      headers: from `shard_headers`.
    Returns:
      tensor name -> its stored shards.
    Raises:
      CheckpointError: naming the file and problem: a malformed or overlapping shard list, a
        missing or extra shard, or a shard stored with another dtype or shape than its box.
    """
    where = os.path.join(path, "manifest.json")
    files = set(headers)
    stored: dict[str, list[Stored]] = {}
    used: set[tuple[str, str]] = set()
    for name, info in manifest["tensors"].items():
        dtype, shape = plan.tensors[name]
        shards = decode_shards(info["shards"], shape, files, f"{where}: tensor {name!r}")
        stored[name] = []
        for shard in shards:
            file = os.path.join(path, shard.file)
            entry = headers[shard.file].get(shard.key)
            if (shard.file, shard.key) in used:
                raise CheckpointError(f"{file}: shard {shard.key!r} is referenced twice")
            if entry is None:
                raise CheckpointError(f"{file}: missing shard {shard.key!r}")
            count = int(np.prod(shard.shape))
            expected = (dtype, shard.shape) if is_native(dtype) else (np.dtype(np.uint8), None)
            if (
                entry.dtype != expected[0]
                or entry.nbytes != count * dtype.itemsize
                or (expected[1] is not None and entry.shape != expected[1])
            ):
                raise CheckpointError(
                    f"{file}: shard {shard.key!r} is stored as {entry.dtype.name} {entry.shape}, "
                    f"the manifest says {dtype.name} {shard.shape}"
                )
            used.add((shard.file, shard.key))
            stored[name].append(Stored(shard, snapshot.shards[shard.file], entry))
    for name, entries in headers.items():
        unused = sorted(k for k in entries if (name, k) not in used)
        if unused:
            raise CheckpointError(
                f"{os.path.join(path, name)}: extra tensor {unused[0]!r} the manifest lacks"
            )
    return stored


def check_groups(plan: Plan, targets: Mapping[str, Any], file: str) -> None:
    """Refuses a target sharding that would split a quantization group of a QArray.

    Raises:
      CheckpointError: naming the process, the leaf, the sharding and the fix.
    """

    def walk(node: Mapping[str, Any], path: Path) -> None:
        kind = node["kind"]
        if kind == "dict":
            for key, child in node["items"]:
                walk(child, (*path, key))
        elif kind in ("list", "tuple"):
            for i, child in enumerate(node["items"]):
                walk(child, (*path, i))
        elif kind == "qarray":
            _check_qarray(node, path)

    def _check_qarray(node: Mapping[str, Any], path: Path) -> None:
        codes, scale = node["tensors"]["codes"], node["tensors"]["scale"]
        target = targets[codes]
        if not isinstance(target, jax.sharding.NamedSharding):
            return
        shape, scale_shape = tuple(node["shape"]), plan.tensors[scale][1]
        if len(scale_shape) != len(shape) or not all(scale_shape):
            return  # scales not laid out per block (checked when the QArray is built)
        block = tuple(n // s for n, s in zip(shape, scale_shape, strict=True))
        logical = jax.ShapeDtypeStruct(shape, np.float32, sharding=target)
        try:
            check_tiles_within_shards(logical, block)
        except ValueError as err:
            raise CheckpointError(
                f"process {jax.process_index()}: {file}: qarray {path_name(path)!r} (shape "
                f"{shape}, blocks of {block}) cannot be loaded onto sharding {target.spec} of "
                f"mesh {dict(target.mesh.shape)}: {err} (through load_checkpoint's sharding=)"
            ) from None

    walk(plan.tree, ())


def _read(stored: Stored, dtype: np.dtype, file: str) -> np.ndarray:
    try:
        host = read_tensor(stored.f, stored.entry)
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    data = np.require(host, requirements="C").reshape(-1).view(np.uint8)
    if hashlib.sha256(data).hexdigest() != stored.shard.sha256:
        raise CheckpointError(f"{file}: shard {stored.shard.key!r} changed while loading")
    return data.view(dtype).reshape(stored.shard.shape)


class PieceReader(Mapping):
    """tensor name -> global `jax.Array`, each process reading only the shards it needs.

    Args:
      stored: tensor name -> its stored shards.
      plan: the decoded manifest.
      targets: tensor name -> where it goes (`resolve_targets`).
      path: the checkpoint directory, for errors.
    """

    def __init__(self, stored: dict[str, list[Stored]], plan: Plan, targets: Any, path: str):
        self._stored, self._plan, self._targets, self._path = stored, plan, targets, path

    def __len__(self) -> int:
        return len(self._stored)

    def __iter__(self):
        return iter(self._stored)

    def regions(self, name: str) -> tuple[Any, dict[Any, Box] | None]:
        """The target and, where it spans processes, each local device's box (else None:
        the whole tensor, placed by `jax.device_put`)."""
        target = self._targets[name]
        if not _spans(target):
            return target, None
        shape = self._plan.tensors[name][1]
        return target, {
            device: box_of(index, shape)
            for device, index in target.addressable_devices_indices_map(shape).items()
        }

    def needed(self, name: str) -> list[Stored]:
        """The stored shards of `name` this process reads."""
        _, boxes = self.regions(name)
        shards = self._stored[name]
        if boxes is None:
            return shards
        keys = {s.shard.key for box in boxes.values() for s, _, _ in _meet(box, shards)}
        return [s for s in shards if s.shard.key in keys]

    def __getitem__(self, name: str) -> jax.Array:
        dtype, shape = self._plan.tensors[name]
        target, boxes = self.regions(name)
        cache: dict[str, np.ndarray] = {}
        if boxes is None:
            host = self._assemble(name, tuple((0, n) for n in shape), dtype, cache)
            return jax.device_put(host, target).block_until_ready()
        pieces = [
            jax.device_put(self._assemble(name, box, dtype, cache), device)
            for device, box in boxes.items()
        ]
        return jax.make_array_from_single_device_arrays(shape, target, pieces)

    def _assemble(self, name: str, box: Box, dtype: np.dtype, cache: dict) -> np.ndarray:
        out = np.empty(tuple(b - a for a, b in box), dtype)
        if out.size == 0:
            return out
        for stored, source, target in _meet(box, self._stored[name]):
            key = stored.shard.key
            if key not in cache:
                cache[key] = _read(stored, dtype, os.path.join(self._path, stored.shard.file))
            out[target] = cache[key][source]
        return out


def _meet(box: Box, shards: list[Stored]) -> list[tuple[Stored, tuple, tuple]]:
    by_key = {s.shard.key: s for s in shards}
    return [(by_key[s.key], src, dst) for s, src, dst in overlaps(box, [s.shard for s in shards])]
