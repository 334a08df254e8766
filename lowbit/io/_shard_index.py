"""Where each piece of a tensor lies, for checkpoints written by several processes.

A tensor of a per-process checkpoint is stored as shards: boxes of its global index space,
``((start, stop), ...)`` per axis, each in one process's file. The shards of a tensor tile it
exactly (every element in one shard), which `decode_shards` checks before any data is read;
`overlaps` says which stored shards a target piece needs and where each part goes, so a
process reads only the shards its own pieces lie in.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from lowbit.io._manifest import CheckpointError

Box = tuple[tuple[int, int], ...]

# One file per writing process; the names are fixed so a directory's contents can be checked.
_PREFIX, _SUFFIX = "process-", ".safetensors"


def is_shard_file(name: str) -> bool:
    """Whether `name` is a shard file's name, ``process-NNNNN.safetensors``."""
    digits = name[len(_PREFIX) : -len(_SUFFIX)]
    return (
        name.startswith(_PREFIX)
        and name.endswith(_SUFFIX)
        and len(digits) >= 5
        and digits.isascii()
        and digits.isdigit()
    )


def shard_file_name(process: int) -> str:
    """The file process `process` writes its shards into."""
    return f"{_PREFIX}{process:05d}{_SUFFIX}"


@dataclasses.dataclass(frozen=True)
class Shard:
    """One stored piece of a tensor.

    Attributes:
      file: the shard file's name in the checkpoint directory.
      key: the tensor name inside that file.
      box: ``((start, stop), ...)``, one pair per axis of the global tensor.
      sha256: hex digest of the piece's stored bytes.
    """

    file: str
    key: str
    box: Box
    sha256: str

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.box)


def box_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    """A device's ``tuple[slice]`` index (as `jax.Array.addressable_shards` give) as a box."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    box = []
    for s, n in zip(index, shape, strict=True):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"a shard index with step {step} is not a box")
        box.append((start, max(start, stop)))
    return tuple(box)


def key_of(name: str, box: Box) -> str:
    """The tensor name of one shard inside its file, e.g. ``up/kernel:codes@0:256,64:128``."""
    return f"{name}@" + ",".join(f"{a}:{b}" for a, b in box)


def slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def overlaps(region: Box, shards: list[Shard]) -> list[tuple[Shard, tuple, tuple]]:
    """The stored shards that `region` needs.

    Returns:
      ``(shard, source, target)`` per shard that meets `region`: `source` slices the shard's
      data, `target` the region's array, for the elements both hold.
    """
    found = []
    for shard in shards:
        source, target = [], []
        for (r0, r1), (s0, s1) in zip(region, shard.box, strict=True):
            lo, hi = max(r0, s0), min(r1, s1)
            if lo >= hi:
                break
            source.append(slice(lo - s0, hi - s0))
            target.append(slice(lo - r0, hi - r0))
        else:
            found.append((shard, tuple(source), tuple(target)))
    return found


def decode_shards(info: Any, shape: tuple[int, ...], files: set[str], at: str) -> list[Shard]:
    """Checks one tensor's ``"shards"`` list from the manifest.

    Args:
      info: the list from the manifest's tensor entry.
      shape: the tensor's global shape.
      files: the shard files the manifest lists.
      at: where, for errors (the manifest's file and the tensor).
    Raises:
      CheckpointError: naming the tensor, for a malformed entry, a box outside the tensor, a
        file the manifest does not list, a key used twice in one file, or shards that do not
        tile the tensor (overlap or leave elements out).
    """
    if not isinstance(info, list) or not info:
        raise CheckpointError(f"{at}: 'shards' is not a non-empty list")
    shards = []
    for entry in info:
        if not isinstance(entry, Mapping) or set(entry) != {"file", "key", "box", "sha256"}:
            raise CheckpointError(f"{at}: shard entry {entry!r} is not {{file, key, box, sha256}}")
        file, key, sha256 = entry["file"], entry["key"], entry["sha256"]
        if file not in files:
            raise CheckpointError(f"{at}: shard in file {file!r}, which the manifest lacks")
        if not isinstance(key, str) or not isinstance(sha256, str):
            raise CheckpointError(f"{at}: shard key {key!r} or sha256 is not a string")
        shards.append(Shard(file, key, _box(entry["box"], shape, at), sha256))
    keys = [(s.file, s.key) for s in shards]
    if len(set(keys)) != len(keys):
        raise CheckpointError(f"{at}: two shards share one key in one file")
    check_tiling([s.box for s in shards], shape, at)
    return shards


def _box(value: Any, shape: tuple[int, ...], at: str) -> Box:
    ok = isinstance(value, list) and len(value) == len(shape)
    box = []
    for pair, n in zip(value if ok else [], shape, strict=False):
        if not (isinstance(pair, list) and len(pair) == 2):
            ok = False
            break
        a, b = pair
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in pair) or not (
            0 <= a <= b <= n
        ):
            ok = False
            break
        box.append((a, b))
    if not ok:
        raise CheckpointError(f"{at}: shard box {value!r} is not inside shape {list(shape)}")
    return tuple(box)


def check_tiling(boxes: list[Box], shape: tuple[int, ...], at: str) -> None:
    """Raises unless `boxes` cover `shape` exactly, each element once.

    Raises:
      CheckpointError: naming `at` and the boxes that overlap, or the count of elements
        missing.
    """
    if not shape and len(boxes) != 1:
        raise CheckpointError(f"{at}: a scalar stored as {len(boxes)} shards")
    ordered = sorted(boxes)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if b[0][0] >= a[0][1]:
                break  # sorted by the first axis: no later box meets `a`
            if all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a, b, strict=True)):
                raise CheckpointError(f"{at}: shards {list(a)} and {list(b)} overlap")
    covered = sum(math.prod(hi - lo for lo, hi in box) for box in boxes)
    if covered != math.prod(shape):
        raise CheckpointError(
            f"{at}: the shards hold {covered} of the tensor's {math.prod(shape)} elements"
        )
