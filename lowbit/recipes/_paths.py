"""Parameter paths: the '/'-joined keys that rules match against."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from lowbit.ops import PreparedQArray, QatWeight
from lowbit.qarray import QArray


def path_string(keys: tuple[Any, ...]) -> str:
    """Joins a pytree key path with '/': dict keys and attribute names as text, sequence
    indices as numbers. A trailing ``value`` attribute (how NNX `Variable`s expose their array)
    is dropped, so NNX state and plain dict params give the same paths.

    Args:
      keys: a key path from `jax.tree_util.tree_flatten_with_path`.
    Returns:
      e.g. ``"layers/0/mlp/up/kernel"``.
    """
    parts = []
    for i, key in enumerate(keys):
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            if key.name == "value" and i == len(keys) - 1 and i > 0:
                continue
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            parts.append(str(key.key))
        else:
            parts.append(str(key))
    return "/".join(parts)


def is_param_leaf(x: Any) -> bool:
    """Leaves rules look at: arrays, and values already quantized (kept whole)."""
    return isinstance(x, QArray | PreparedQArray | QatWeight)


def map_params(fn: Callable[[str, Any], Any], params: Any) -> Any:
    """Maps `fn(path, leaf)` over a params pytree, treating QArrays as leaves."""
    return jax.tree_util.tree_map_with_path(
        lambda keys, leaf: fn(path_string(keys), leaf), params, is_leaf=is_param_leaf
    )


def param_leaves(params: Any) -> list[tuple[str, Any]]:
    """(path, leaf) pairs of a params pytree in flattening order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_param_leaf)
    return [(path_string(keys), leaf) for keys, leaf in flat]
