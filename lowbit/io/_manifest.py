"""The checkpoint manifest: the pytree's structure and every stored tensor, as JSON.

A params tree is stored as a tree of JSON nodes, one per container or leaf:

  ``{"kind": "dict", "items": [[key, node], ...]}``  (keys: strings or ints, in order)
  ``{"kind": "list" | "tuple", "items": [node, ...]}``
  ``{"kind": "none"}``
  ``{"kind": "scalar", "value": 1.5}``  (a Python bool, int or float leaf)
  ``{"kind": "array", "tensor": name}``
  ``{"kind": "qarray", "tensors": {role: name}, "format": ..., "shape": [...], "dtype": ...,
    "packed_axis": ..., "scale_encoding": ..., "activation": {QuantConfig dict} | null,
    "kernel_axis": 0 | 1 (optional: saved in the kernel layout for that contraction axis)}``

and each tensor the file holds gets ``{"path", "role", "dtype", "shape", "sha256"}``. Decoding
checks every node, name and number against fixed tables, so a manifest can describe a tree but
cannot make the loader construct anything else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.formats import get_format
from lowbit.io._config_dict import quant_config_from_dict
from lowbit.io._safetensors_file import DTYPES, dtype_from_name
from lowbit.io._tree import KERNEL_AXIS, QARRAY_ROLES, Key, Path, path_name
from lowbit.models import CheckpointError
from lowbit.qarray import META_FIELDS, NMSparse, QArray, meta_bits

FORMAT_NAME = "lowbit.checkpoint"
# The tensor file's header records the sha256 of the manifest's bytes under this key, so the
# manifest (tree, formats, dtypes, shapes, per-tensor digests, recipe, metadata: every field,
# however the manifest lists them) is covered by the same integrity check as the tensors.
# Every shard file of a checkpoint written by several processes carries it too.
MANIFEST_DIGEST_KEY = "lowbit.manifest_sha256"
# 2: the tensor file's header carries the manifest's sha256 (version 1 files lack it).
FORMAT_VERSION = 2
# 3: written by several processes: one shard file per process, each tensor a list of shards
# (`lowbit.io._shard_index`) instead of one sha256. One process still writes version 2.
SHARDED_FORMAT_VERSION = 3
# Version 1 checkpoints load with a warning (their manifest is not sealed).
READABLE_VERSIONS = (1, 2, 3)
_SCALE_ENCODINGS = ("float", "e8m0", "e4m3")
# Containers nested deeper than this are refused: real params trees are a few levels deep, and
# the limit keeps a hostile manifest from exhausting the interpreter's recursion (and so keeps
# every walk of the tree, here and when building it, far from Python's recursion limit).
MAX_TREE_DEPTH = 100


class Plan:
    """A decoded, checked tree: how to build params once its tensors are read.

    Attributes:
      tree: the manifest's root node.
      tensors: tensor name -> (dtype, shape) the manifest promises.
      shapes: leaf path -> logical shape (QArrays: their `shape`), for `like=` checks.
      places: tensor name -> (leaf path, role: ``"value"`` or a QArray field).
    """

    def __init__(self, tree: dict[str, Any], tensors: dict[str, tuple[np.dtype, tuple]]):
        self.tree = tree
        self.tensors = tensors
        self.shapes: dict[Path, tuple[int, ...]] = {}
        self.places: dict[str, tuple[Path, str]] = {}


def decode_tree(
    tree: Any, tensors: Mapping[str, Any], where: str, *, sharded: bool = False
) -> Plan:
    """Checks a manifest's tree against its tensor table without reading any data.

    Args:
      tree: the manifest's ``"tree"`` node.
      tensors: the manifest's ``"tensors"`` table.
      where: the manifest's file name, for errors.
      sharded: the entries list ``"shards"`` (version 3, checked by the caller) instead of a
        ``"sha256"``.
    Returns:
      A `Plan`.
    Raises:
      CheckpointError: naming the path and problem: unknown node kinds, format names, dtypes,
        scale encodings or activation configs, duplicate keys, tensors referenced twice or
        never, a tensor the table lacks, or containers nested deeper than `MAX_TREE_DEPTH`.
    """
    table: dict[str, tuple[np.dtype, tuple]] = {}
    if not isinstance(tensors, Mapping):
        raise CheckpointError(f"{where}: 'tensors' is not an object")
    for name, info in tensors.items():
        digest = "shards" if sharded else "sha256"
        if not isinstance(info, Mapping) or not isinstance(
            info.get(digest), list if sharded else str
        ):
            raise CheckpointError(f"{where}: tensor {name!r} entry lacks a {digest}")
        try:
            dtype = dtype_from_name(info.get("dtype"), f"tensor {name!r}")
        except ValueError as err:
            raise CheckpointError(f"{where}: {err}") from None
        table[name] = (dtype, _shape(info.get("shape"), f"{where}: tensor {name!r}"))
    plan = Plan(tree, table)
    used: set[str] = set()

    def ref(name: Any, path: Path, role: str) -> str:
        if not isinstance(name, str) or name not in table:
            raise CheckpointError(
                f"{where}: leaf {path_name(path)!r} refers to tensor {name!r}, which the "
                "manifest's tensor table lacks"
            )
        if name in used:
            raise CheckpointError(f"{where}: tensor {name!r} is referenced twice")
        used.add(name)
        plan.places[name] = (path, role)
        return name

    def walk(node: Any, path: Path) -> None:
        kind = node.get("kind") if isinstance(node, Mapping) else None
        at = f"{where}: node {path_name(path)!r}"
        if len(path) > MAX_TREE_DEPTH:
            raise CheckpointError(
                f"{where}: the tree nests deeper than {MAX_TREE_DEPTH} levels (under "
                f"{path_name(path[:3])!r})"
            )
        if kind in ("none", "scalar"):
            if kind == "scalar" and isinstance(node.get("value"), bool | int | float):
                plan.shapes[path] = ()
            elif kind == "scalar":
                raise CheckpointError(f"{at}: scalar value {node.get('value')!r} is not a number")
        elif kind == "dict":
            keys = [_item_key(item, at) for item in _items(node, at)]
            if len(set(keys)) != len(keys):
                raise CheckpointError(f"{at}: duplicate dict keys")
            for item, key in zip(node["items"], keys, strict=True):
                walk(item[1], (*path, key))
        elif kind in ("list", "tuple"):
            for i, child in enumerate(_items(node, at)):
                walk(child, (*path, i))
        elif kind == "array":
            name = ref(node.get("tensor"), path, "value")
            plan.shapes[path] = table[name][1]
        elif kind == "nm_sparse":
            _check_nm_sparse(node, at)
            walk(node["values"], (*path, "values"))
            plan.shapes.pop((*path, "values"), None)
            ref(node["meta"], path, "meta")
            plan.shapes[path] = tuple(node["shape"])
        elif kind == "qarray":
            _check_qarray(node, at)
            roles = node["tensors"]
            for role in roles:
                ref(roles[role], path, role)
            plan.shapes[path] = tuple(node["shape"])
        else:
            raise CheckpointError(
                f"{at}: kind {kind!r}; accepted: dict, list, tuple, none, scalar, array, qarray, "
                "nm_sparse"
            )

    walk(tree, ())
    unused = sorted(set(table) - used)
    if unused:
        raise CheckpointError(f"{where}: tensor {unused[0]!r} is in no leaf of the tree")
    return plan


def _checked(fn: Callable[[], Any], where: str) -> Any:
    try:
        return fn()
    except ValueError as err:
        raise CheckpointError(f"{where}: {err}") from None


def _shape(value: Any, at: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    ):
        raise CheckpointError(f"{at}: shape {value!r} is not a list of non-negative ints")
    return tuple(value)


def _items(node: Mapping[str, Any], at: str) -> list[Any]:
    items = node.get("items")
    if not isinstance(items, list):
        raise CheckpointError(f"{at}: 'items' is not a list")
    return items


def _item_key(item: Any, at: str) -> Key:
    if not (isinstance(item, list) and len(item) == 2):
        raise CheckpointError(f"{at}: dict item {item!r} is not [key, node]")
    key = item[0]
    if isinstance(key, bool) or not isinstance(key, str | int):
        raise CheckpointError(f"{at}: dict key {key!r} is neither a string nor an int")
    return key


def _check_qarray(node: Mapping[str, Any], at: str) -> None:
    expected = {"kind", "tensors", *META_FIELDS}
    if set(node) - {KERNEL_AXIS} != expected:
        raise CheckpointError(
            f"{at}: qarray keys {sorted(node)} != {sorted(expected)} (and optionally "
            f"{KERNEL_AXIS!r})"
        )
    if not isinstance(node["format"], str):
        raise CheckpointError(f"{at}: format {node['format']!r} is not a name")
    _checked(lambda: get_format(node["format"]), at)
    shape = _shape(node["shape"], at)
    dtype = _checked(lambda: dtype_from_name(node["dtype"], "logical dtype"), at)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise CheckpointError(f"{at}: logical dtype {dtype.name} is not a float dtype")
    axis = node["packed_axis"]
    if axis is not None and not (isinstance(axis, int) and 0 <= axis < max(len(shape), 1)):
        raise CheckpointError(f"{at}: packed_axis {axis!r} is out of range for shape {shape}")
    kernel_axis = node.get(KERNEL_AXIS)
    if KERNEL_AXIS in node and (
        type(kernel_axis) is not int or len(shape) != 2 or kernel_axis not in (0, 1)
    ):
        raise CheckpointError(
            f"{at}: {KERNEL_AXIS} {kernel_axis!r} for shape {shape}; accepted: 0 or 1, for a "
            "2-D weight"
        )
    if node["scale_encoding"] not in _SCALE_ENCODINGS:
        raise CheckpointError(
            f"{at}: scale_encoding {node['scale_encoding']!r}; accepted: {_SCALE_ENCODINGS}"
        )
    if node["activation"] is not None:
        _checked(lambda: quant_config_from_dict(node["activation"]), at)
    roles = node["tensors"]
    if not isinstance(roles, Mapping) or not {"codes", "scale"} <= set(roles) <= set(QARRAY_ROLES):
        raise CheckpointError(
            f"{at}: tensor roles {sorted(roles) if isinstance(roles, Mapping) else roles!r}; "
            f"needs codes and scale, accepted: {QARRAY_ROLES}"
        )


def _check_nm_sparse(node: Mapping[str, Any], at: str) -> None:
    expected = {"kind", "shape", "dtype", "axis", "n", "m", "values", "meta"}
    if set(node) != expected:
        raise CheckpointError(f"{at}: nm_sparse keys {sorted(node)} != {sorted(expected)}")
    shape = _shape(node["shape"], at)
    _checked(lambda: dtype_from_name(node["dtype"], "logical dtype"), at)
    n, m, axis = node["n"], node["m"], node["axis"]
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (n, m, axis))
    if not ints or not 1 <= n < m or not 0 <= axis < len(shape) or shape[axis] % m:
        raise CheckpointError(f"{at}: N:M pattern n={n!r} m={m!r} axis={axis!r} for {shape}")
    if not isinstance(node["values"], Mapping) or node["values"].get("kind") not in (
        "array",
        "qarray",
    ):
        raise CheckpointError(f"{at}: nm_sparse values must be an array or a qarray node")


def _build_nm_sparse(node: Mapping[str, Any], values: Any, meta: Any, path: Path) -> NMSparse:
    shape, axis, n, m = tuple(node["shape"]), node["axis"], node["n"], node["m"]
    kept = list(shape)
    kept[axis] = shape[axis] * n // m
    groups = shape[axis] // m
    meta_len = -(-groups * meta_bits(n, m) // 8)
    if tuple(values.shape) != tuple(kept) or meta.shape[axis] < meta_len:
        raise CheckpointError(
            f"nm_sparse {path_name(path)!r}: values {tuple(values.shape)} / metadata "
            f"{tuple(meta.shape)} do not fit the logical shape {shape} at {n}:{m}"
        )
    return NMSparse(
        values=values, meta=meta, shape=shape, dtype=DTYPES[node["dtype"]], axis=axis, n=n, m=m
    )


def build_tree(
    plan: Plan,
    arrays: Mapping[str, Any],
    on_qarray: Callable[[tuple[Any, ...], QArray, int | None], Any] | None = None,
) -> Any:
    """Builds the params tree of a checked `plan` from its tensors (by name).

    The tree is walked in order and each tensor looked up once, so `arrays` may read tensors
    on demand: with `on_qarray` replacing each QArray as soon as it is built (e.g. by its
    kernel layout), the tree never holds every weight in two forms.

    Args:
      plan: from `decode_tree`.
      arrays: tensor name -> array (looked up once per tensor, in tree order).
      on_qarray: ``(key path, qarray, kernel axis saved or None) -> leaf``, the key path as
        `jax.tree_util.tree_flatten_with_path` gives it for the built tree (QArrays as
        leaves); the leaf it returns takes the QArray's place.
    Raises:
      CheckpointError: if a rebuilt QArray breaks its invariants (`QArray.check`).
    """

    def walk(node: Mapping[str, Any], path: Path, keys: tuple[Any, ...] | None) -> Any:
        kind = node["kind"]
        if kind == "none":
            return None
        if kind == "scalar":
            return node["value"]
        if kind == "dict":
            return {
                key: walk(child, (*path, key), (*keys, jax.tree_util.DictKey(key)))
                for key, child in node["items"]
            }
        if kind in ("list", "tuple"):
            items = [
                walk(child, (*path, i), (*keys, jax.tree_util.SequenceKey(i)))
                for i, child in enumerate(node["items"])
            ]
            return items if kind == "list" else tuple(items)
        if kind == "array":
            return arrays[node["tensor"]]
        if kind == "nm_sparse":
            values = walk(node["values"], (*path, "values"), None)  # part of one leaf
            return _build_nm_sparse(node, values, arrays[node["meta"]], path)
        roles = node["tensors"]
        q = QArray.from_manifest(
            node, {role: arrays[name] for role, name in roles.items()}, quant_config_from_dict
        )
        try:
            q.check()
        except ValueError as err:
            raise CheckpointError(f"qarray {path_name(path)!r}: {err}") from None
        if q.shape != tuple(node["shape"]) or q.packed_axis != node["packed_axis"]:
            raise CheckpointError(
                f"qarray {path_name(path)!r}: codes of shape {tuple(q.codes.shape)} do not fit "
                f"the logical shape {tuple(node['shape'])}"
            )
        if on_qarray is None or keys is None:
            return q
        return on_qarray(keys, q, node.get(KERNEL_AXIS))

    return walk(plan.tree, (), ())
