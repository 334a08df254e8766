"""Parameter trees as flat ``{"layers/3/attn/q_proj/kernel": leaf}`` maps, and their sizes."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.ops import PreparedQArray
from lowbit.qarray import QArray


def is_quantized_leaf(x: Any) -> bool:
    """A quantized weight, logical (`QArray`) or laid out for the kernels (`PreparedQArray`)."""
    return isinstance(x, QArray | PreparedQArray)


# Attribute keys that wrap a value (an NNX `Variable`'s `.value`) rather than name a parameter.
_WRAPPER_KEYS = frozenset({"value", "raw_value"})


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def named_leaves(tree: Any) -> dict[str, Any]:
    """Leaves of a parameter pytree by slash-joined path; a `QArray` is one leaf.

    Args:
      tree: nested dicts/lists, an `nnx.State`, or any pytree; QArrays stay whole.
    Returns:
      ``{path: leaf}`` in flattening order, e.g. ``{"layers/0/mlp/up_proj/kernel": QArray}``.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_quantized_leaf)
    named = {}
    for path, leaf in flat:
        parts = [_key_name(k) for k in path]
        while len(parts) > 1 and parts[-1] in _WRAPPER_KEYS:
            parts.pop()
        named["/".join(parts)] = leaf
    return named


def leaf_bytes(leaf: Any) -> int:
    """Bytes a leaf stores: `QArray.nbytes` (codes, scales, zero points) or the array's size."""
    if is_quantized_leaf(leaf):
        return leaf.nbytes
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
    return 0


def param_bytes(tree: Any) -> int:
    """Bytes stored by all array leaves of a parameter pytree (QArrays at their packed size)."""
    return sum(leaf_bytes(leaf) for leaf in named_leaves(tree).values())


def float32_bytes(tree: Any) -> int:
    """Bytes the same parameters take as float32 (4 bytes per logical element)."""
    total = 0
    for leaf in named_leaves(tree).values():
        if is_quantized_leaf(leaf):
            total += 4 * int(np.prod(leaf.shape))
        elif hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            if jnp.issubdtype(leaf.dtype, jnp.floating):
                total += 4 * int(np.prod(leaf.shape))
            else:
                total += leaf_bytes(leaf)
    return total
