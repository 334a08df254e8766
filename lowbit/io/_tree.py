"""Params trees to the manifest's JSON structure and a table of arrays (the writing side).

The node kinds are described in `lowbit.io._manifest`, which reads them back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from lowbit.io._config_dict import quant_config_to_dict
from lowbit.io._safetensors_file import DTYPES
from lowbit.ops import PreparedQArray
from lowbit.qarray import DATA_FIELDS, NMSparse, QArray

# A QArray's tensor roles are its data fields; its metadata is its own manifest encoding.
QARRAY_ROLES = DATA_FIELDS
# A qarray node's optional key: the axis the weight was laid out for the kernels over when it
# was saved (a `PreparedQArray`'s), so that `load_checkpoint` lays it out again by default.
KERNEL_AXIS = "kernel_axis"

Key = str | int
Path = tuple[Key, ...]


def path_name(path: Path) -> str:
    """``("layers", 0, "kernel")`` -> ``"layers/0/kernel"``; the root is ``"."``."""
    return "/".join(str(k) for k in path) or "."


def encode_tree(
    params: Any, prefix: Path = (), *, split: bool = False
) -> tuple[dict[str, Any], dict[str, tuple[Path, str, Any]]]:
    """Splits a params tree into its JSON structure and its arrays.

    Args:
      params: nested dicts (any Mapping, e.g. ``nnx.State``; str or int keys), lists, tuples,
        None, `QArray`s, arrays (jax or numpy), ``nnx.Variable``s (their value is stored) and
        Python scalars.
      prefix: the path of `params` in a larger tree (tensor names and paths start with it).
      split: keep `jax.Array`s as they are (each process writes its own pieces, also of
        arrays split over processes) instead of reading them whole into numpy arrays.
    Returns:
      ``(tree, tensors)``: the JSON node of the root, and tensor name -> (path, role, array).
    Raises:
      TypeError: naming the path of a leaf or container that cannot be stored (abstract
        arrays, NamedTuples, custom classes, keys that are neither str nor int).
      ValueError: if two paths map to the same tensor name, or (unless `split`) for an array
        split over processes (this process cannot read it whole).
    """
    tensors: dict[str, tuple[Path, str, Any]] = {}

    def add(path: Path, role: str, array: Any) -> str:
        name = path_name(path) + ("" if role == "value" else f":{role}")
        if name in tensors:
            raise ValueError(f"two leaves are both stored as tensor {name!r}; rename a key")
        if split and isinstance(array, jax.Array):
            tensors[name] = (path, role, array)
            return name
        if isinstance(array, jax.Array) and not array.is_fully_addressable:
            raise ValueError(
                f"process {jax.process_index()}: tensor {name!r} is split over "
                f"{jax.process_count()} processes and this process holds only its pieces, so "
                "it cannot be read whole here. Save it with save_checkpoint called in every "
                "process (each writes its own pieces; see docs/sharding.md)"
            )
        tensors[name] = (path, role, np.asarray(array))
        return name

    def walk(node: Any, path: Path) -> dict[str, Any]:
        if isinstance(node, nnx.Variable):
            node = node.get_value()
        if node is None:
            return {"kind": "none"}
        kernel_axis = None
        if isinstance(node, PreparedQArray):
            # Checkpoints hold the logical form only: recovered from the kernel layout here.
            # The axis it was laid out for is kept, so that loading lays it out again.
            kernel_axis, node = node.axis, node.logical()
        if isinstance(node, NMSparse):
            return {
                "kind": "nm_sparse",
                "shape": list(node.shape),
                "dtype": np.dtype(node.dtype).name,
                "axis": node.axis,
                "n": node.n,
                "m": node.m,
                "values": walk(node.values, (*path, "values")),
                "meta": add(path, "meta", node.meta),
            }
        if isinstance(node, QArray):
            meta = {"kind": "qarray", **node.manifest_metadata(quant_config_to_dict)}
            if kernel_axis is not None:
                meta[KERNEL_AXIS] = kernel_axis
            meta["tensors"] = {
                role: add(path, role, array) for role, array in node.manifest_tensors().items()
            }
            return meta
        if isinstance(node, Mapping):
            items = []
            for key, child in node.items():
                if isinstance(key, bool) or not isinstance(key, str | int):
                    raise TypeError(
                        f"params at {path_name(path)!r} has key {key!r} of type "
                        f"{type(key).__name__}; accepted key types: str, int"
                    )
                items.append([key, walk(child, (*path, key))])
            return {"kind": "dict", "items": items}
        if type(node) in (list, tuple):
            kind = "list" if type(node) is list else "tuple"
            return {"kind": kind, "items": [walk(c, (*path, i)) for i, c in enumerate(node)]}
        if isinstance(node, bool | int | float) and not isinstance(node, np.generic):
            if isinstance(node, float) and not math.isfinite(node):
                raise TypeError(f"params at {path_name(path)!r} is the non-finite float {node}")
            return {"kind": "scalar", "value": node}
        if isinstance(node, jax.Array | np.ndarray | np.generic) and not isinstance(
            node, jax.core.Tracer
        ):
            if np.dtype(node.dtype).name not in DTYPES:
                raise TypeError(
                    f"params at {path_name(path)!r} has dtype {node.dtype}; accepted: "
                    f"{', '.join(sorted(DTYPES))}"
                )
            return {"kind": "array", "tensor": add(path, "value", node)}
        raise TypeError(
            f"params at {path_name(path)!r} is a {type(node).__name__}, which a checkpoint "
            "cannot store; accepted: dicts, lists, tuples, None, QArrays, concrete arrays and "
            "Python scalars (convert NamedTuples and custom nodes to dicts first)"
        )

    return walk(params, tuple(prefix)), tensors


def leaf_shapes(like: Any) -> dict[Path, tuple[int, ...] | None]:
    """Leaf path -> shape of a params tree or abstract tree (None for None leaves).

    Accepts what `encode_tree` accepts, with `jax.ShapeDtypeStruct` (or anything with a
    `.shape`) as leaves.
    """
    out: dict[Path, tuple[int, ...] | None] = {}

    def walk(node: Any, path: Path) -> None:
        if isinstance(node, nnx.Variable):
            node = node.get_value()
        if node is None:
            return
        if isinstance(node, QArray | PreparedQArray):
            out[path] = tuple(node.shape)
        elif isinstance(node, Mapping):
            for key, child in node.items():
                walk(child, (*path, key))
        elif type(node) in (list, tuple):
            for i, child in enumerate(node):
                walk(child, (*path, i))
        elif hasattr(node, "shape"):
            out[path] = tuple(int(d) for d in node.shape)
        else:
            out[path] = ()

    walk(like, ())
    return out
