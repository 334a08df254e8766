"""Checkpoint-name -> module-path mappings and putting loaded arrays into an NNX module."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

ParamPath = tuple[str | int, ...]


def path_str(path: ParamPath) -> str:
    """``("layers", 3, "attn", "q_proj", "kernel")`` -> ``"layers/3/attn/q_proj/kernel"``."""
    return "/".join(str(p) for p in path)


def unpermute_rope_rows(w: np.ndarray, n_heads: int, out: np.ndarray | None = None) -> np.ndarray:
    """Undo llama.cpp's interleaving of query/key projection rows.

    llama.cpp's converter reorders each head's output rows from Hugging Face's "two halves"
    rotary layout to an interleaved one (row pairs ``(2i, 2i+1)`` rotate together). This maps
    back: within each head, row ``2i`` goes to ``i`` and row ``2i+1`` to ``i + head_dim/2``.

    w: ``[n_heads * head_dim, ...]``: any array whose leading axis is the output row, so it
    works both on float weights ``[out, in]`` and on raw quantized block bytes
    ``[out, row_bytes]`` (blocks run along the input axis, so whole rows move intact).

    out: a contiguous array of `w`'s shape and dtype to write the rows into (and return)
    instead of a new one: a loader's reused buffer.
    """
    if w.shape[0] % (2 * n_heads):
        raise ValueError(f"w has {w.shape[0]} rows, not a multiple of 2 * n_heads={2 * n_heads}")
    half = w.shape[0] // n_heads // 2
    moved = w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2)
    if out is None:
        return moved.reshape(w.shape)
    np.copyto(out.reshape(moved.shape), moved)
    return out


@dataclasses.dataclass(frozen=True)
class ParamMapping:
    """Where one checkpoint tensor goes in a module, and how it is laid out there.

    Attributes:
      path: module parameter path, e.g. ``("layers", 3, "attn", "q_proj", "kernel")``.
      transpose: the checkpoint stores ``[..., out, in]`` and the NNX kernel is
        ``[..., in, out]`` (the last two axes swap: a linear weight, or stacked experts).
      unpermute_heads: if set, first apply `unpermute_rope_rows` with this many heads.
      offset: added to every value after the layout change (Gemma's checkpoints store a
        norm's factor as ``1 + w``'s ``w``).
      expert: the tensor is one expert's slice, index `expert` along the leading axis, of a
        stacked ``[n_experts, in, out]`` parameter (checkpoints that store experts one by
        one); None for a whole parameter.
      part: ``(i, n)``: the tensor holds `n` parameters side by side along its output axis
        (the last axis after the layout change) and this mapping takes the `i`-th equal
        slice (a fused gate/up projection); None for all of it.
    """

    path: ParamPath
    transpose: bool = False
    unpermute_heads: int | None = None
    offset: float = 0.0
    expert: int | None = None
    part: tuple[int, int] | None = None

    def apply(self, w: np.ndarray) -> np.ndarray:
        """Checkpoint array (NumPy order) -> array in the module's layout."""
        if self.unpermute_heads is not None:
            w = unpermute_rope_rows(w, self.unpermute_heads)
        w = swap_last(w) if self.transpose else w
        if self.part is not None:
            i, n = self.part
            if w.shape[-1] % n:
                raise ValueError(
                    f"a tensor of shape {w.shape} cannot be split into {n} equal parts along "
                    "its last axis"
                )
            size = w.shape[-1] // n
            w = w[..., i * size : (i + 1) * size]
        if self.offset:
            w = np.asarray(w, np.float32) + np.float32(self.offset)
        return w


def swap_last(w: Any) -> Any:
    """`w` with its last two axes swapped (a NumPy/JAX array or a QArray); 1-D as is."""
    if w.ndim < 2:
        return w
    axes = (*range(w.ndim - 2), w.ndim - 1, w.ndim - 2)
    return w.transpose(axes)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded or does not fit the module: the message names the
    file, tensor and problem. `tensor` is the checkpoint name at fault (None when a parameter
    has no tensor), so a loader can name the file holding it. The one class for every
    checkpoint the library reads (`lowbit.io`'s too)."""

    def __init__(self, message: str, tensor: str | None = None):
        super().__init__(message)
        self.tensor = tensor


def _variable_at(module: nnx.Module, path: ParamPath) -> nnx.Variable:
    node: Any = module
    for part in path:
        try:
            node = node[part] if isinstance(part, int) else getattr(node, part)
        except (AttributeError, IndexError, TypeError):
            node = None
            break
    if not isinstance(node, nnx.Variable):
        raise ValueError(f"module has no parameter at path {path_str(path)!r}")
    return node


def assign_params(
    module: nnx.Module,
    arrays: Mapping[str, np.ndarray],
    mapping: Mapping[str, ParamMapping | tuple[ParamMapping, ...]],
    dtype: Any,
) -> nnx.Module:
    """Fill `module`'s parameters from checkpoint `arrays` (by checkpoint name) via `mapping`.

    A name may map to several parameters (a tuple: one fused tensor split with
    `ParamMapping.part`), and several names to one stacked parameter (`ParamMapping.expert`:
    each fills one expert's slice of a buffer the size of that parameter).

    `arrays` is read one name at a time, so a lazy mapping keeps only one float tensor alive
    besides the module's parameters.

    Every mapped name must be present and every parameter of `module` must be filled; the
    `CheckpointError` (a ValueError) names the first tensor or parameter that is missing or
    mis-shaped.
    """
    filled = set()
    stacks: dict[ParamPath, np.ndarray] = {}
    experts: dict[ParamPath, set[int]] = {}
    for name, targets in mapping.items():
        if name not in arrays:
            raise CheckpointError(f"checkpoint has no tensor named {name!r}", name)
        array = np.asarray(arrays[name])
        for m in targets if isinstance(targets, tuple) else (targets,):
            value = m.apply(array)
            var = _variable_at(module, m.path)
            want = tuple(var.shape) if m.expert is None else tuple(var.shape[1:])
            if tuple(value.shape) != want or (m.expert is not None and m.expert >= var.shape[0]):
                where = "" if m.expert is None else f" (expert {m.expert} of {var.shape[0]})"
                raise CheckpointError(
                    f"tensor {name!r} has shape {value.shape} after layout mapping, but "
                    f"{path_str(m.path)!r}{where} expects {want}",
                    name,
                )
            if m.expert is None:
                var.set_value(jnp.asarray(value, dtype=dtype))
                filled.add(m.path)
            else:
                if m.path not in stacks:
                    stacks[m.path] = np.zeros(var.shape, np.dtype(dtype))
                stacks[m.path][m.expert] = value
                experts.setdefault(m.path, set()).add(m.expert)
    for path, stack in stacks.items():
        if len(experts[path]) != stack.shape[0]:
            absent = min(set(range(stack.shape[0])) - experts[path])
            raise CheckpointError(
                f"no checkpoint tensor maps to expert {absent} of {path_str(path)!r}"
            )
        _variable_at(module, path).set_value(jnp.asarray(stack, dtype=dtype))
        filled.add(path)
    params = nnx.to_flat_state(nnx.state(module, nnx.Param))
    missing = [path_str(tuple(path)) for path, _ in params if tuple(path) not in filled]
    if missing:
        raise CheckpointError(f"no checkpoint tensor maps to parameter {missing[0]!r}")
    return module
