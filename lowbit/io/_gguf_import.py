"""GGUF import: quantized tensors become QArrays directly, with no requantization.

GGML's blocks hold 32 consecutive elements of a row (the last NumPy axis) and an fp16 scale
``d`` (Q4_1 also an fp16 minimum ``m``). They map onto `QArray` blocks of ``1 x 32``:

  * Q8_0 ``x = d * q``: ``int8`` codes ``q``, scale ``d``. Exact.
  * Q4_0 ``x = d * (q - 8)``: ``int4`` codes ``q - 8`` (symmetric, so integer matmul paths
    apply), scale ``d``. Exact.
  * Q4_1 ``x = d * q + m``: ``uint4`` codes ``q``, scale ``d``, float32 zero point
    ``-m / d`` in code units, so ``x = (q - zero_point) * d``. The zero point's float32 rounding
    costs at most about ``2**-24 * |m|`` per element. A block with ``d == 0`` stands for
    ``x = m`` everywhere and its codes carry nothing: it becomes codes 0, scale ``|m|`` and zero
    point ``-sign(m)``, which reproduces ``m`` exactly.

The 4-bit codes are taken out of GGML's nibble order (byte ``j`` of a block holds element
``j`` low and ``j + 16`` high) and packed in this library's order (element ``2k`` low,
``2k + 1`` high); the values are untouched.

The other types of `lowbit.gguf.BLOCK_TYPES` (the K-quants Q2_K .. Q8_K, Q5_0, Q5_1, IQ4_NL,
IQ4_XS, TQ1_0 and TQ2_0) keep their GGUF blocks as they are: a QArray of the matching
`lowbit.formats.GGUFBlockFormat` (``q4_k``, ...) whose codes are the file's bytes, decoded
bit-identically to llama.cpp. Other storage types (F32, F16, BF16, IQ2_XXS, ...) are
dequantized to float32 by `lowbit.gguf.GGUFTensor.dequantize`, which gives the same values as
`gguf.quants.dequantize`.

Files are read by `lowbit.gguf.read_gguf`: metadata as Python values, each tensor's stored
bytes as a read-only memory-mapped ``uint8 [*shape[:-1], row_bytes]`` view (NumPy shape order).
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit import kernels
from lowbit.formats import GGUF_ELEMENT_FORMATS, get_format
from lowbit.gguf import BLOCK_TYPES, GGUFFile, GGUFTensor, read_gguf, split
from lowbit.io._placement import NameMap, Placement, nest, resolve
from lowbit.models import swap_last, unpermute_rope_rows
from lowbit.ops import gguf_twin_tiles, prepare_leaves, prepare_transposed, prepare_weight
from lowbit.qarray import QArray, is_qarray


def gguf_tensor_to_qarray(tensor: GGUFTensor) -> QArray:
    """A quantized GGUF tensor as a `QArray` in its GGUF layout (blocks along the last axis).

    Args:
      tensor: a tensor read from a GGUF file, shape ``[*lead, n]``.
    Returns:
      QArray of shape ``[*lead, n]``, logical dtype float32. Q8_0 / Q4_0 / Q4_1: scale
      ``[*lead, n / 32]`` float16, 4-bit codes packed along the last axis. Every other type of
      `lowbit.gguf.BLOCK_TYPES`: the stored blocks as codes (packed along the last axis) and a
      unit scale ``[1, ..., 1]``.
    Raises:
      ValueError: for any other storage type.
    """
    kind = tensor.type_name
    if kind not in BLOCK_TYPES:
        raise ValueError(
            f"tensor {tensor.name!r} has type {kind}; direct import accepts "
            f"{', '.join(BLOCK_TYPES)}"
        )
    if kind not in GGUF_ELEMENT_FORMATS:
        return _blocks_qarray(tensor, _owned_copy(tensor.raw))
    d32, m32, codes = split(kind, tensor.raw)
    d = d32.astype(np.float16)  # float16 values, exactly
    if kind == "Q8_0":
        return _qarray(tensor, "int8", codes, d, None)
    if kind == "Q4_0":
        # q - 8 in 4-bit two's complement is q with its top bit flipped.
        return _qarray(tensor, "int4", codes ^ 0x08, d, None)
    m = m32.astype(np.float16)
    flat = d == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        zero_point = np.where(flat, -np.sign(m32), -m32 / d32).astype(np.float32)
    scale = np.where(flat, np.where(m == 0, np.float16(1), np.abs(m)), d).astype(np.float16)
    if flat.any():
        codes.reshape(*flat.shape, -1)[flat] = 0
    return _qarray(tensor, "uint4", codes, scale, zero_point)


def _owned_copy(host: np.ndarray) -> jax.Array:
    """`host` copied into a buffer of JAX's own, the copy done when this returns.

    Never an alias: `jax.device_put(host, may_alias=False)` still aliases a 64-byte aligned
    NumPy array on CPU (JAX 0.12). For a tensor of a mapped file that alias kept reading the
    file's pages, resident again after `drop_mapped_pages` (1.2 GB more at the end of a
    Llama-3-8B-shaped Q4_K_M file's load: its Q6_K tensors lay on such addresses), and its
    layout could not be written over it; an alias of `_Staging`'s buffer would be overwritten
    by the next weight. One pass over the bytes either way (`jnp.array(host, copy=True)` makes
    two where `device_put` copies). Done on return, so the caller may then drop the pages or
    reuse the buffer."""
    host = np.ascontiguousarray(host)
    array = jax.device_put(host, may_alias=False)
    if array.unsafe_buffer_pointer() == host.ctypes.data:  # aliased after all
        array = array.copy()
    return array.block_until_ready()


def _blocks_qarray(tensor: GGUFTensor, codes: jax.Array) -> QArray:
    """The QArray of a type kept as its blocks (not in `GGUF_ELEMENT_FORMATS`) whose stored
    bytes are `codes` (``uint8``, the shape of ``tensor.raw``)."""
    return QArray(
        codes=codes,
        scale=jnp.ones((1,) * len(tensor.shape), jnp.uint8),
        zero_point=None,
        tensor_scale=None,
        format=tensor.type_name.lower(),
        shape=tensor.shape,
        dtype=np.float32,
        packed_axis=len(tensor.shape) - 1,
    ).check()


@functools.partial(jax.jit, static_argnames=("name", "axis"))
def _pack(codes: jax.Array, name: str, axis: int) -> jax.Array:
    # One compiled program per shape instead of one per eager op: imports see few shapes.
    return get_format(name).pack(codes, axis)


def _qarray(tensor, name, codes, scale, zero_point) -> QArray:
    axis = len(tensor.shape) - 1
    codes = jnp.asarray(codes)
    packed = None
    if get_format(name).bits < 8:
        codes, packed = _pack(codes, name, axis), axis
    return QArray(
        codes=codes,
        scale=jnp.asarray(scale),
        zero_point=None if zero_point is None else jnp.asarray(zero_point),
        tensor_scale=None,
        format=name,
        shape=tensor.shape,
        dtype=np.float32,
        packed_axis=packed,
    ).check()


def place_tensor(tensor: GGUFTensor, placement: Placement, quantized: bool) -> Any:
    """One GGUF tensor laid out as `placement` says: a `QArray` of its blocks (`quantized` and
    a type kept as stored), else float32 values."""
    if placement.unpermute_heads is not None:
        # Whole rows move, so each row's blocks stay intact.
        raw = unpermute_rope_rows(tensor.raw, placement.unpermute_heads)
        tensor = GGUFTensor(tensor.name, tensor.ggml_type, tensor.shape, raw)
    if quantized and tensor.type_name in BLOCK_TYPES:
        value = gguf_tensor_to_qarray(tensor)
        return swap_last(value) if placement.transpose else value
    value = tensor.dequantize()
    return jnp.asarray(swap_last(value) if placement.transpose else value)


def drop_mapped_pages(view: np.ndarray) -> None:
    """Takes the pages of a memory-mapped tensor out of this process's resident memory once
    its bytes have been copied: they still count in the resident set while the file stays
    mapped (for its metadata), so a model read whole would be resident twice at its peak, in
    the file's pages and in its own buffers. The pages stay in the page cache, and a later read
    of the view maps them back. Views of other memory are left alone."""
    base = view  # down to the array over the whole mapping (whose base is the mmap itself)
    while isinstance(base, np.ndarray) and not isinstance(base.base, mmap.mmap):
        base = base.base
    if not isinstance(base, np.memmap) or not hasattr(mmap, "MADV_DONTNEED"):
        return
    mapped = base.base
    start = view.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    first = start // mmap.PAGESIZE * mmap.PAGESIZE
    mapped.madvise(mmap.MADV_DONTNEED, first, start + view.nbytes - first)


def import_gguf(
    path: str | os.PathLike[str] | GGUFFile,
    *,
    name_map: NameMap | None = None,
    quantized: bool = True,
    kernel_axes: Any = None,
    int8_activations: bool = False,
) -> tuple[dict[Any, Any], dict[str, Any]]:
    """Reads a GGUF file into a params tree, keeping quantized tensors quantized as stored.

    Args:
      path: the ``.gguf`` file, or one already read (`lowbit.gguf.read_gguf`: its header is
        not parsed again).
      name_map: GGUF tensor name -> where it goes (see `lowbit.io.Placement`: None skips the
        tensor, a path places it as stored, a Placement may also transpose it ``[out, in]`` ->
        ``[in, out]`` and un-interleave RoPE rows). Without one, the result is flat and keyed
        by GGUF name, in GGUF layout.
      quantized: False dequantizes every tensor to float32 instead.
      kernel_axes: lay the weights out for the CPU kernels (`lowbit.ops.prepare_weights`):
        {key path: contraction axis}, or a function of the placed (logical) tree's shapes
        and dtypes (`jax.ShapeDtypeStruct` leaves, QArrays of them) returning one, e.g.
        ``lambda p: lowbit.api.kernel_axes_of(fn, p, tokens)``; the layouts replace the
        codes, laid out from the file's bytes (a weight it stores transposed is not
        transposed first). None (default): logical QArrays.
      int8_activations: with `kernel_axes`, the weights will multiply on int8 activations
        (`lowbit.ops.with_int8_activations`, the ``gguf`` recipe): Q8_0 / Q4_0 tensors
        (int8 / int4) are then laid out at once as the tiles that moves them to
        (`lowbit.ops.gguf_twin_tiles`), written over a copy of their rows, not as int8 /
        int4 layouts first. The same tree as `with_int8_activations` gives, before its
        flags are set.
    Returns:
      ``(params, metadata)``: nested dicts of `QArray`s (the types of
      `lowbit.gguf.BLOCK_TYPES`) and float32 arrays (other types); the file's key/value
      metadata.
    Raises:
      ValueError: for a malformed file, an undecodable tensor type, or two tensors mapped to
        one path.
      TypeError: if `name_map` returns something other than the accepted kinds.
    """
    gguf_file = path if isinstance(path, GGUFFile) else read_gguf(path)
    placed = []
    for name, tensor in gguf_file.tensors.items():
        placement = Placement(path=(name,)) if name_map is None else resolve(name, name_map(name))
        if placement is None:
            continue
        if kernel_axes is not None and _staged(tensor, quantized, int8_activations):
            # Read when laid out (`_lay_out_staged`), its pages dropped then.
            staged = _Staged(tensor, placement.unpermute_heads, placement.transpose)
            placed.append((placement.path, staged))
            continue
        if kernel_axes is not None and _lay_out_as_stored(tensor, placement, quantized):
            stored = dataclasses.replace(placement, transpose=False)
            placed.append((placement.path, _AsStored(place_tensor(tensor, stored, quantized))))
        else:
            placed.append((placement.path, place_tensor(tensor, placement, quantized)))
        drop_mapped_pages(tensor.raw)
    params = nest(placed)
    del placed
    if kernel_axes is None:
        return params, gguf_file.metadata
    flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_qarray)
    del params
    if callable(kernel_axes):
        kernel_axes = kernel_axes(
            jax.tree_util.tree_unflatten(treedef, [_abstract(v) for _, v in flat])
        )
    lookup = kernel_axes.get if isinstance(kernel_axes, Mapping) else kernel_axes
    staging = _Staging()
    for i, (keys, leaf) in enumerate(flat):
        if isinstance(leaf, _Staged):
            flat[i] = (keys, _lay_out_staged(leaf, lookup(tuple(keys)), staging))
    del staging
    transposed = {i for i, (_, leaf) in enumerate(flat) if isinstance(leaf, _AsStored)}
    for i in transposed:
        flat[i] = (flat[i][0], flat[i][1].stored)
    # `flat` holds the only reference to the QArrays made above: their codes may be overwritten.
    prepare_leaves(flat, kernel_axes, transposed, donate=True)
    return jax.tree_util.tree_unflatten(treedef, [leaf for _, leaf in flat]), gguf_file.metadata


@dataclasses.dataclass(frozen=True)
class _AsStored:
    """A 2-D quantized tensor placed as the file stores it (``[out, in]``) where the params
    hold its transpose: laid out from these bytes once the contraction axes are known
    (`lowbit.ops.prepare_leaves`' ``transposed``), so its codes are not transposed there and
    back (two copies of every weight, most of a load's layout time)."""

    stored: QArray


@dataclasses.dataclass(frozen=True)
class _Staged:
    """A 2-D quantized tensor, not yet read, laid out once the contraction axes are known
    (`_lay_out_staged`; placed as stored, or transposed without a transposed copy, as an
    `_AsStored` one) from its rows copied (un-interleaved as `unpermute_heads` says) into
    `_Staging`'s buffer:

      * a block type whose tiles are larger than its rows (`_tiled_from_staging`: Q3_K,
        Q4_K, Q5_K) is tiled from the buffer itself, so the weight is written into fresh
        memory once (its tiles), not twice (a copy of its rows, then its tiles). On a 2-core
        EPYC a Llama-3-8B-shaped Q4_K_M file's Q4_K weights (3.7 GB) took 2.8-4.6 s to lay
        out so, against 5.9-10.8 s from a copy of each;
      * Q8_0 / Q4_0 for int8 activations (`_twin_tiled`) are tiled over one copy of their
        rows (`lowbit.ops.gguf_twin_tiles`), not split into int8 / int4 codes and scales,
        laid out as those and then moved onto their tiles."""

    tensor: GGUFTensor
    unpermute_heads: int | None
    transposed: bool = True  # placed as the transpose of its stored [out, in]


def _staged(tensor: GGUFTensor, quantized: bool, int8: bool) -> bool:
    """Whether `tensor` is laid out as a `_Staged` one (`int8`: for int8 activations)."""
    if not quantized:
        return False
    return _tiled_from_staging(tensor) or (int8 and _twin_tiled(tensor))


class _Staging:
    """One host buffer, 64-byte aligned, reused for every `_Staged` tensor's rows: a JAX CPU
    array made from it aliases it (no copy), and its pages are written once, not once per
    weight. Each use must be done with (its layout computed) before the next `load`."""

    def __init__(self) -> None:
        self._buffer = np.empty(0, np.uint8)

    def load(self, staged: _Staged, *, copy: bool = False) -> jax.Array:
        """The rows of `staged` ``uint8 [N, row_bytes]`` in the buffer, as a JAX array; with
        `copy`, in a JAX buffer of their own (one to donate), through the buffer only when
        they are un-interleaved on the way."""
        raw = staged.tensor.raw
        if copy and staged.unpermute_heads is None:
            return _owned_copy(raw)
        if self._buffer.nbytes < raw.nbytes:
            self._buffer = np.empty(0, np.uint8)  # the old one freed first
            spare = np.empty(raw.nbytes + 64, np.uint8)
            start = -spare.ctypes.data % 64
            self._buffer = spare[start : start + raw.nbytes]
        rows = self._buffer[: raw.nbytes].reshape(raw.shape)
        if staged.unpermute_heads is None:
            np.copyto(rows, raw)
        else:
            unpermute_rope_rows(raw, staged.unpermute_heads, out=rows)
        return _owned_copy(rows) if copy else jax.device_put(rows, may_alias=True)

    def holds(self, tree: Any) -> bool:
        """Whether an array of `tree` lies in the buffer (a result that kept the rows)."""
        start, end = self._buffer.ctypes.data, self._buffer.ctypes.data + self._buffer.nbytes
        for leaf in jax.tree.leaves(tree):
            devices = leaf.devices() if isinstance(leaf, jax.Array) else ()
            if len(devices) == 1 and next(iter(devices)).platform == "cpu":
                if start <= leaf.unsafe_buffer_pointer() < end:
                    return True
        return False


def _tiled_from_staging(tensor: GGUFTensor) -> bool:
    """Whether `tensor`'s kernel layout is tiles larger than its rows (a new buffer), so it is
    laid out from `_Staging` (e.g. Q4_K; not Q6_K, whose tiles are written over its rows)."""
    kind = tensor.type_name
    if len(tensor.shape) != 2 or kind in GGUF_ELEMENT_FORMATS or kind in kernels.TILES_OVER_ROWS:
        return False
    n, k = tensor.shape
    return kernels.gguf_tileable(kind, k, n)


# The GGUF types that import as an element format int8 activations move onto the type's own
# tiles (`gguf_tensor_to_qarray`'s Q8_0 -> int8, Q4_0 -> int4; `lowbit.ops.gguf_twin_tiles`).
_TWINS = {"Q8_0": "int8", "Q4_0": "int4"}


def _twin_tiled(tensor: GGUFTensor) -> bool:
    """Whether `tensor` imports as int8 / int4 that int8 activations move onto its own tiles
    (`lowbit.ops.gguf_twin_tiles`): a 2-D Q8_0 / Q4_0 tensor."""
    return len(tensor.shape) == 2 and tensor.type_name in _TWINS


def _twin_abstract(tensor: GGUFTensor) -> QArray:
    """The shapes of the int8 / int4 QArray a Q8_0 / Q4_0 `tensor` imports as
    (`gguf_tensor_to_qarray`), without its bytes: `jax.ShapeDtypeStruct` leaves."""
    n, k = tensor.shape
    name = _TWINS[tensor.type_name]
    codes = jax.ShapeDtypeStruct((n, k), np.int8 if name == "int8" else np.uint8)
    if name == "int4":
        codes = jax.eval_shape(functools.partial(_pack, name=name, axis=1), codes)
    return QArray(
        codes=codes,
        scale=jax.ShapeDtypeStruct((n, k // 32), np.float16),
        zero_point=None,
        tensor_scale=None,
        format=name,
        shape=tensor.shape,
        dtype=np.float32,
        packed_axis=1 if name == "int4" else None,
    ).check()


def _lay_out_staged(staged: _Staged, axis: int | None, staging: _Staging) -> Any:
    """The weight of `staged` (its stored ``[out, in]``, transposed if `staged.transposed`):
    laid out for contraction over `axis` from the staging buffer; `axis` None (no kernel
    use): the QArray. Its mapped pages are dropped once read."""
    tensor = staged.tensor
    flip = staged.transposed
    prepare = prepare_transposed if flip else prepare_weight

    def copied() -> QArray:  # the stored QArray in a buffer of its own
        raw = tensor.raw
        if staged.unpermute_heads is not None:
            raw = unpermute_rope_rows(raw, staged.unpermute_heads)
        return gguf_tensor_to_qarray(GGUFTensor(tensor.name, tensor.ggml_type, tensor.shape, raw))

    if axis is None:
        weight = copied().T if flip else copied()
    elif _twin_tiled(tensor):
        rows = staging.load(staged, copy=True)
        weight = gguf_twin_tiles(_twin_abstract(tensor), rows, axis, transposed=flip)
        if weight is None:  # not onto the twin's tiles: as without `int8_activations`
            weight = prepare(copied(), axis, donate=True)
    else:
        weight = prepare(_blocks_qarray(tensor, staging.load(staged)), axis)
        jax.block_until_ready(weight)  # done with the buffer before it is loaded again
        if staging.holds(weight):  # no new layout (no kernel for it here): a copy of its own
            weight = prepare(copied(), axis, donate=True)
    drop_mapped_pages(tensor.raw)
    return weight


def _lay_out_as_stored(tensor: GGUFTensor, placement: Placement, quantized: bool) -> bool:
    return (
        quantized
        and placement.transpose
        and tensor.type_name in BLOCK_TYPES
        and len(tensor.shape) == 2
    )


def _abstract(leaf: Any) -> Any:
    """The shapes and dtypes of a placed leaf (`jax.ShapeDtypeStruct`s), transposed for an
    `_AsStored` or `_Staged` one: what the params will hold, without computing it."""
    if isinstance(leaf, _AsStored):
        return jax.eval_shape(_transposed, leaf.stored)
    if isinstance(leaf, _Staged) and _twin_tiled(leaf.tensor):
        twin = _twin_abstract(leaf.tensor)
        return jax.eval_shape(_transposed, twin) if leaf.transposed else twin
    if isinstance(leaf, _Staged):
        rows = jax.ShapeDtypeStruct(leaf.tensor.raw.shape, np.uint8)
        blocks = _blocks_qarray(leaf.tensor, rows)
        if leaf.transposed:
            return jax.eval_shape(_transposed, blocks)
        leaf = blocks
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), leaf)


def _transposed(q: QArray) -> QArray:
    # One function for every weight: `jax.eval_shape` traces it once per shape and format.
    return q.T
