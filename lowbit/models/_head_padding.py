"""Zero attention heads appended to a decoder, so that its key/value heads divide over a
tensor-parallel axis (SmolLM2's 3 kv heads over 2 devices become 4).

Query head ``h`` reads key/value head ``h // group`` (``group = n_heads / n_kv_heads``), so
appending ``extra`` kv heads and ``extra * group`` query heads at the end keeps every real
head's pairing. The new heads' q/k/v columns (and biases) are zero, so their values are zero
and so is their attention output, whatever the softmax: o_proj's new rows meet zero inputs,
and the model computes exactly what it computed before, at the cost of the extra heads'
work. The rest of the model does not see the heads.

Quantized weights are padded in their stored form: codes of zero bytes, and along the padded
axis zero scales (zero points, per-axis input scales of one) wherever the scale varies along
it. A v_proj whose scale does not vary along its columns (one scale for the whole tensor)
could not give zero columns that way and is refused, naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from lowbit.ops import PreparedQArray
from lowbit.qarray import QArray
from lowbit.recipes import path_string

# Projection (``layers/<i>/attn/<name>``) -> (the kernel's padded axis, whether its width
# counts query heads or kv heads).
_PADDED = {
    "q_proj": (1, "q"),
    "k_proj": (1, "kv"),
    "v_proj": (1, "kv"),
    "o_proj": (0, "q"),
}


def padded_kv_heads(config: Any, tp: int) -> int:
    """The kv heads `config` runs with over `tp` devices: its own, rounded up to a multiple."""
    return -(-config.n_kv_heads // tp) * tp


def with_kv_heads(config: Any, kv_heads: int) -> Any:
    """`config` with `kv_heads` key/value heads and the query heads that go with them."""
    if kv_heads == config.n_kv_heads:
        return config
    group = config.n_heads // config.n_kv_heads
    return dataclasses.replace(config, n_kv_heads=kv_heads, n_heads=kv_heads * group)


def pad_heads(params: Any, config: Any, kv_heads: int) -> Any:
    """`params` of a decoder of `config` with zero heads appended up to `kv_heads` kv heads
    (see the module docstring); weights already that wide are left as they are.

    Args:
      params: the decoder's params (nested dicts or an NNX `State`; float arrays, `QArray`s
        or `PreparedQArray`s, which come back logical where padded).
      config: the `DecoderConfig` the params were made for.
      kv_heads: kv heads after padding (>= ``config.n_kv_heads``).
    Raises:
      ValueError: naming the weight, for a format that cannot be padded (scales inside the
        codes, or a v_proj with one scale over its columns).
    """
    padded = with_kv_heads(config, kv_heads)
    width = {
        "q": (config.n_heads * config.head_dim, padded.n_heads * config.head_dim),
        "kv": (config.n_kv_heads * config.head_dim, kv_heads * config.head_dim),
    }

    def pad(key_path: tuple, x: Any) -> Any:
        path = path_string(key_path)
        parts = path.split("/")
        if len(parts) < 3 or parts[-3] != "attn" or parts[-2] not in _PADDED:
            return x
        axis, heads = _PADDED[parts[-2]]
        if parts[-1] == "bias":
            axis = 0
        elif parts[-1] != "kernel":
            return x
        before, after = width[heads]
        if x.shape[axis] != before:
            return x  # padded already (or not this model's: the placement checks sizes)
        if isinstance(x, PreparedQArray):  # a kernel layout of the unpadded weight
            x = x.logical()
        if isinstance(x, QArray):
            return _pad_qarray(x, axis, after - before, path, exact=parts[-2] == "v_proj")
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, after - before)
        return jnp.pad(x, widths)

    leaf = lambda x: isinstance(x, QArray | PreparedQArray)
    return jax.tree_util.tree_map_with_path(pad, params, is_leaf=leaf)


def _pad_qarray(q: QArray, axis: int, count: int, path: str, *, exact: bool) -> QArray:
    """`q` with `count` zero entries appended along `axis` (see the module docstring)."""
    if q.fmt.scales_in_codes or q.codes.ndim != q.ndim:
        raise ValueError(
            f"{path}: a {q.format} weight keeps its scales inside the codes, which cannot be "
            "padded with zero heads; requantize it with a lowbit recipe (e.g. int4w_g32_asym) "
            "or use a model axis that divides the kv heads"
        )
    block = q.block_shape[axis]
    if q.scale.shape[axis] > 1 and count % block:
        raise ValueError(
            f"{path}: {count} padded entries along axis {axis} are not whole groups of {block}"
        )
    if exact and q.scale.shape[axis] == 1:
        raise ValueError(
            f"{path}: one {q.format} scale over all its columns cannot give the padded heads "
            "zero values; quantize with per-channel or grouped scales, or use a model axis "
            "that divides the kv heads"
        )

    def append(a: jax.Array | None, entries: int, value: float) -> jax.Array | None:
        if a is None or a.shape[axis] == 1:
            return a
        widths = [(0, 0)] * a.ndim
        widths[axis] = (0, entries)
        return jnp.pad(a, widths, constant_values=value)

    shape = list(q.shape)
    shape[axis] += count
    codes = [(0, 0)] * q.codes.ndim
    if q.packed_axis == axis:  # bytes of codes: the new length's, past the old
        codes[axis] = (0, q.fmt.packed_length(shape[axis]) - q.codes.shape[axis])
    else:
        codes[axis] = (0, count)
    return dataclasses.replace(
        q,
        codes=jnp.pad(q.codes, codes),
        scale=append(q.scale, count // block, 0),
        zero_point=append(q.zero_point, count // block, 0),
        input_scale=append(q.input_scale, count, 1),
        shape=tuple(shape),
    )
