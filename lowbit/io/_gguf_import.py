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

The K-quants (Q2_K .. Q8_K), Q5_0, Q5_1, IQ4_NL, TQ1_0 and TQ2_0 keep their GGUF blocks as they
are: a QArray of the matching `lowbit.formats.GGUFBlockFormat` (``q4_k``, ...) whose codes are
the file's bytes, decoded bit-identically to llama.cpp. Other storage types (F32, F16, BF16,
IQ2_XXS, ...) are dequantized to float32 by `lowbit.models.GGUFTensor.dequantize`, which gives
the same values as `gguf.quants.dequantize`.

Files are read by `lowbit.models.read_gguf`: metadata as Python values, each tensor's stored
bytes as a read-only memory-mapped ``uint8 [*shape[:-1], row_bytes]`` view (NumPy shape order).
"""

from __future__ import annotations

import functools
import mmap
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.formats import GGUF_BLOCK_FORMATS, get_format
from lowbit.gguf import decode as gguf_decode
from lowbit.io._placement import NameMap, Placement, nest, resolve
from lowbit.models import GGUFTensor, read_gguf, swap_last, unpermute_rope_rows
from lowbit.ops import prepare_leaves
from lowbit.qarray import QArray, is_qarray

DIRECT_TYPES = ("Q8_0", "Q4_0", "Q4_1")
BLOCK_TYPES = tuple(f.ggml_type for f in GGUF_BLOCK_FORMATS)
"""GGUF types imported as `GGUFBlockFormat` QArrays (their blocks kept as stored)."""

GGUFTensorData = GGUFTensor
"""One tensor read from a GGUF file: `lowbit.models.GGUFTensor` (name, ggml_type, shape, raw)."""


def read_gguf_file(
    path: str | os.PathLike[str],
) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """Reads a GGUF file's metadata and tensor table (`lowbit.models.read_gguf`, as a pair).

    Returns:
      ``(metadata, tensors)``: key -> Python value; name -> `lowbit.models.GGUFTensor`, in
      file order.
    Raises:
      ValueError: for a path that is not a GGUF file, an unsupported version, an unknown value
        or tensor type, a row length that is not a whole number of blocks, or a file that ends
        inside the header or a tensor.
    """
    gguf_file = read_gguf(path)
    return gguf_file.metadata, gguf_file.tensors


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 field at byte `start` of every block: [..., n_blocks] float16."""
    return np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0]


def _nibbles(blocks: np.ndarray) -> np.ndarray:
    """GGML 4-bit block bytes [..., n_blocks, 16] -> codes [..., n_blocks * 32] uint8."""
    codes = np.concatenate([blocks & 0x0F, blocks >> 4], axis=-1)
    return codes.reshape(*blocks.shape[:-2], -1)


def gguf_tensor_to_qarray(tensor: GGUFTensor) -> QArray:
    """A quantized GGUF tensor as a `QArray` in its GGUF layout (blocks along the last axis).

    Args:
      tensor: a tensor read from a GGUF file, shape ``[*lead, n]``.
    Returns:
      QArray of shape ``[*lead, n]``, logical dtype float32. Q8_0 / Q4_0 / Q4_1: scale
      ``[*lead, n / 32]`` float16, 4-bit codes packed along the last axis. `BLOCK_TYPES`: the
      stored blocks as codes (packed along the last axis) and a unit scale ``[1, ..., 1]``.
    Raises:
      ValueError: for any other storage type.
    """
    kind = tensor.ggml_type.name
    if kind in BLOCK_TYPES:
        return QArray(
            codes=jnp.asarray(np.ascontiguousarray(tensor.raw)),
            scale=jnp.ones((1,) * len(tensor.shape), jnp.uint8),
            zero_point=None,
            tensor_scale=None,
            format=kind.lower(),
            shape=tensor.shape,
            dtype=np.float32,
            packed_axis=len(tensor.shape) - 1,
        ).check()
    if kind not in DIRECT_TYPES:
        raise ValueError(
            f"tensor {tensor.name!r} has type {kind}; direct import accepts "
            f"{DIRECT_TYPES + BLOCK_TYPES}"
        )
    blocks = tensor.blocks()
    d = _half(blocks, 0)
    zero_point = None
    if kind == "Q8_0":
        codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(tensor.shape)
        return _qarray(tensor, "int8", codes, d, None)
    if kind == "Q4_0":
        # q - 8 in 4-bit two's complement is q with its top bit flipped.
        return _qarray(tensor, "int4", _nibbles(blocks[..., 2:]) ^ 0x08, d, None)
    m = _half(blocks, 2)
    codes = _nibbles(blocks[..., 4:])
    d32, m32 = d.astype(np.float32), m.astype(np.float32)
    flat = d == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        zero_point = np.where(flat, -np.sign(m32), -m32 / d32).astype(np.float32)
    scale = np.where(flat, np.where(m == 0, np.float16(1), np.abs(m)), d).astype(np.float16)
    if flat.any():
        block_view = codes.reshape(*flat.shape, -1)
        block_view[flat] = 0
    return _qarray(tensor, "uint4", codes, scale, zero_point)


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
    if quantized and tensor.ggml_type.name in DIRECT_TYPES + BLOCK_TYPES:
        value = gguf_tensor_to_qarray(tensor)
        return swap_last(value) if placement.transpose else value
    if tensor.ggml_type.name in BLOCK_TYPES:
        # This library's decoder: the same values as gguf's, faster, and it knows Q8_K.
        value = gguf_decode(tensor.ggml_type.name, tensor.raw).reshape(tensor.shape)
    else:
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
    path: str | os.PathLike[str],
    *,
    name_map: NameMap | None = None,
    quantized: bool = True,
    kernel_axes: Any = None,
) -> tuple[dict[Any, Any], dict[str, Any]]:
    """Reads a GGUF file into a params tree, keeping quantized tensors quantized as stored.

    Args:
      path: the ``.gguf`` file.
      name_map: GGUF tensor name -> where it goes (see `lowbit.io.Placement`: None skips the
        tensor, a path places it as stored, a Placement may also transpose it ``[out, in]`` ->
        ``[in, out]`` and un-interleave RoPE rows). Without one, the result is flat and keyed
        by GGUF name, in GGUF layout.
      quantized: False dequantizes every tensor to float32 instead.
      kernel_axes: lay the weights out for the CPU kernels (`lowbit.ops.prepare_weights`):
        {key path: contraction axis}, or a function of the placed (logical) tree returning
        one, e.g. ``lambda p: lowbit.api.kernel_axes_of(fn, p, tokens)``; the layouts
        replace the codes. None (default): logical QArrays.
    Returns:
      ``(params, metadata)``: nested dicts of `QArray`s (`DIRECT_TYPES` and `BLOCK_TYPES`)
      and float32 arrays (other types); the file's key/value metadata.
    Raises:
      ValueError: for a malformed file, an undecodable tensor type, or two tensors mapped to
        one path.
      TypeError: if `name_map` returns something other than the accepted kinds.
    """
    gguf_file = read_gguf(path)
    placed = []
    for name, tensor in gguf_file.tensors.items():
        placement = Placement(path=(name,)) if name_map is None else resolve(name, name_map(name))
        if placement is not None:
            placed.append((placement.path, place_tensor(tensor, placement, quantized)))
            drop_mapped_pages(tensor.raw)
    params = nest(placed)
    del placed
    if kernel_axes is None:
        return params, gguf_file.metadata
    if callable(kernel_axes):
        kernel_axes = kernel_axes(params)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_qarray)
    del params
    prepare_leaves(flat, kernel_axes)
    return jax.tree_util.tree_unflatten(treedef, [leaf for _, leaf in flat]), gguf_file.metadata
