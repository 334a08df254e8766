"""Hugging Face safetensors import: float weights into a params tree by a name map."""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit._untrusted import open_regular
from lowbit.io._placement import NameMap, Placement, nest, resolve
from lowbit.io._safetensors_file import read_header, read_tensor
from lowbit.models import swap_last, unpermute_rope_rows


def import_safetensors(
    path: str | os.PathLike[str],
    name_map: NameMap,
    *,
    dtype: Any = None,
) -> dict[Any, Any]:
    """Reads a safetensors file into nested dicts of arrays, placed by `name_map`.

    Args:
      path: the ``.safetensors`` file.
      name_map: file tensor name -> where it goes (see `lowbit.io.Placement`): None skips the
        tensor, a path places it as stored, a Placement may also transpose it (a Linear weight
        ``[out, in]`` -> a Flax kernel ``[in, out]``) and un-interleave RoPE rows.
      dtype: optional float dtype to cast floating tensors to; default: as stored.
    Returns:
      Nested dicts (keys from the paths) of jax arrays, e.g.
      ``{"layers": {0: {"attn": {"query": {"kernel": [384, 384] float32}}}}}``.
    Raises:
      ValueError: naming the file and tensor for a malformed or truncated file, or two tensors
        mapped to one path.
      TypeError: if `name_map` returns something other than the accepted kinds.
    """
    path = os.fspath(path)
    entries = read_header(path)
    placed = []
    with open_regular(path) as f:
        for name, entry in entries.items():
            placement = resolve(name, name_map(name))
            if placement is None:
                continue
            placed.append((placement.path, place_array(read_tensor(f, entry), placement, dtype)))
    return nest(placed)


def place_array(value: np.ndarray, placement: Placement, dtype: Any = None) -> jax.Array:
    """One file tensor laid out as `placement` says (rows un-interleaved, then transposed),
    floats cast to `dtype` if given, as a jax array."""
    if placement.unpermute_heads is not None:
        value = unpermute_rope_rows(value, placement.unpermute_heads)
    if placement.transpose:
        value = np.ascontiguousarray(swap_last(value))
    if dtype is not None and np.issubdtype(value.dtype, np.floating):
        value = value.astype(dtype)
    return jnp.asarray(value)
