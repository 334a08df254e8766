"""A model file's tensors as lazy params: placed by a name map, read one at a time.

Sources: a GGUF file (its quantized blocks kept as QArrays, as `import_gguf` keeps them), a
Hugging Face ``.safetensors`` file, or a directory of shards with their
``model.safetensors.index.json`` (or a single ``model.safetensors``). Looking a path up reads
that one tensor (GGUF tensors are memory-mapped; safetensors tensors are read into their own
buffer) and lays it out as `import_gguf` / `import_safetensors` would; nothing else is held.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

import jax
import numpy as np

from lowbit._untrusted import load_json, open_regular
from lowbit.gguf import BLOCK_TYPES, GGUFFile, read_gguf
from lowbit.io._gguf_import import place_tensor
from lowbit.io._hf_import import place_array
from lowbit.io._placement import NameMap, Placement, resolve
from lowbit.io._safetensors_file import TensorEntry, read_header, read_tensor
from lowbit.io._tree import Path, path_name

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclasses.dataclass(frozen=True)
class _Item:
    name: str  # the file's tensor name
    placement: Placement
    abstract: jax.ShapeDtypeStruct | None  # None: a quantized GGUF tensor kept as a QArray
    where: Any  # a GGUFTensor, or (file, TensorEntry)


def _swap(shape: tuple[int, ...], transpose: bool) -> tuple[int, ...]:
    return (*shape[:-2], shape[-1], shape[-2]) if transpose else shape


def safetensors_files(source: str) -> dict[str, dict[str, TensorEntry]]:
    """{file: its header entries} of a ``.safetensors`` file, an index JSON or a directory.

    Raises:
      ValueError: naming the file, for a directory with neither an index nor a single file,
        an index without a ``weight_map``, a tensor the index places in a file that lacks
        it, or one tensor name in two files.
    """
    if os.path.isdir(source):
        if os.path.isfile(os.path.join(source, INDEX_FILE)):
            source = os.path.join(source, INDEX_FILE)
        elif os.path.isfile(os.path.join(source, SINGLE_FILE)):
            source = os.path.join(source, SINGLE_FILE)
        else:
            raise ValueError(
                f"{source!r} holds neither {INDEX_FILE} nor {SINGLE_FILE}; give a .safetensors "
                "file or a directory of shards with their index"
            )
    if not source.endswith(".json"):
        return {source: read_header(source)}
    with open_regular(source) as f:
        index = load_json(f.read(), source)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{source}: no 'weight_map' object mapping tensor names to shard files")
    directory = os.path.dirname(source)
    files: dict[str, dict[str, TensorEntry]] = {}
    owner: dict[str, str] = {}
    for shard in sorted(set(weight_map.values()), key=str):
        if not isinstance(shard, str) or os.path.basename(shard) != shard:
            raise ValueError(f"{source}: weight_map names shard {shard!r}, not a file name")
        file = os.path.join(directory, shard)
        files[file] = read_header(file)
        for name in files[file]:
            if name in owner:
                raise ValueError(f"{file}: tensor {name!r} is also in {owner[name]}")
            owner[name] = file
    for name, shard in weight_map.items():
        if owner.get(name) != os.path.join(directory, shard):
            raise ValueError(f"{source}: weight_map puts {name!r} in {shard}, which lacks it")
    return files


def _check_free(
    items: Mapping[Path, _Item], above: dict[Path, Path], path: Path, name: str
) -> None:
    """Raises unless `path` is free: not taken, not inside another leaf or above one.

    `above` maps every proper prefix of a placed path to one path below it (updated here).
    """
    if not path:
        raise ValueError(f"name_map({name!r}) returned an empty path")
    if path in items:
        raise ValueError(f"two tensors map to path {path!r} ({items[path].name!r}, {name!r})")
    other = above.get(path)
    if other is None:
        other = next((path[:i] for i in range(1, len(path)) if path[:i] in items), None)
    if other is not None:
        raise ValueError(
            f"path {path_name(path)!r} of {name!r} and {path_name(other)!r} of "
            f"{items[other].name!r} nest into each other"
        )
    for i in range(1, len(path)):
        above.setdefault(path[:i], path)


class SourceParams(Mapping):
    """A model file's tensors by params path, read and placed when looked up.

    Keys are path tuples in the order `jax.tree_util` flattens the nested params (dict keys
    sorted at every level), which is the order `quantize_params` returns a tree in. Use it as
    a context manager (or call `close`) to close the files.

    Args:
      source: a ``.gguf`` file (or one already read, a `lowbit.gguf.GGUFFile`), a
        ``.safetensors`` file, a shard index JSON, or a directory holding
        ``model.safetensors.index.json`` or ``model.safetensors``.
      name_map: file tensor name -> where it goes (`lowbit.io.Placement`; None skips it).
      quantized: GGUF only: keep quantized tensors as QArrays (False: float32 values).
      dtype: safetensors only: cast floating tensors to this dtype (default: as stored).
    Raises:
      ValueError: for a malformed file, a source of another kind, or two tensors placed at
        one path (or one path inside another).
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | GGUFFile,
        name_map: NameMap,
        *,
        quantized: bool = True,
        dtype: Any = None,
    ):
        self.gguf = source if isinstance(source, GGUFFile) else None
        self.source = source.path if self.gguf is not None else os.fspath(source)
        self._quantized, self._dtype = quantized, dtype
        self._files: dict[str, BinaryIO] = {}
        items: dict[Path, _Item] = {}
        above: dict[Path, Path] = {}
        if self.gguf is None and self.source.endswith(".gguf"):
            self.gguf = read_gguf(self.source)
        if self.gguf is not None:
            found = [(name, t, t.shape, None) for name, t in self.gguf.tensors.items()]
        else:
            found = [
                (name, (file, entry), entry.shape, entry.dtype)
                for file, entries in safetensors_files(self.source).items()
                for name, entry in entries.items()
            ]
        for name, where, shape, stored in found:
            placement = resolve(name, name_map(name))
            if placement is None:
                continue
            abstract = self._abstract(where, shape, stored, placement)
            _check_free(items, above, placement.path, name)
            items[placement.path] = _Item(name, placement, abstract, where)
        self._items = dict(sorted(items.items(), key=lambda kv: kv[0]))

    def _abstract(self, where, shape, stored, placement) -> jax.ShapeDtypeStruct | None:
        shape = _swap(tuple(shape), placement.transpose)
        if stored is None:  # GGUF
            kept = where.type_name in BLOCK_TYPES
            return None if self._quantized and kept else jax.ShapeDtypeStruct(shape, np.float32)
        if self._dtype is not None and np.issubdtype(stored, np.floating):
            stored = np.dtype(self._dtype)
        return jax.ShapeDtypeStruct(shape, stored)

    def __getitem__(self, path: Path) -> Any:
        item = self._items[tuple(path)]
        if self.gguf is not None:
            return place_tensor(item.where, item.placement, self._quantized)
        file, entry = item.where
        if file not in self._files:
            self._files[file] = open_regular(file)  # closed by close()
        return place_array(read_tensor(self._files[file], entry), item.placement, self._dtype)

    def __iter__(self) -> Iterator[Path]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def abstract(self, path: Path) -> Any:
        """The leaf at `path` without reading it (a `jax.ShapeDtypeStruct`), or the leaf
        itself for a GGUF tensor kept quantized (a QArray over the memory-mapped blocks)."""
        item = self._items[tuple(path)]
        return self[path] if item.abstract is None else item.abstract

    def is_kept(self, path: Path) -> bool:
        """Whether the leaf at `path` is a GGUF tensor kept as stored (quantized)."""
        return self._items[tuple(path)].abstract is None

    def file_name(self, path: Path) -> str:
        """The file tensor name placed at `path`."""
        return self._items[tuple(path)].name

    def nbytes(self) -> int:
        """The source's size on disk, in bytes."""
        if self.gguf is not None:
            return os.path.getsize(self.source)
        return sum(os.path.getsize(f) for f in safetensors_files(self.source))

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> SourceParams:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
