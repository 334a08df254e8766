"""`QArray`: a quantized array as a pytree value.

A `QArray` stands for the float array

    x = (decode(codes) - zero_point) * scale * tensor_scale

with `zero_point` and `tensor_scale` optional. Its invariants, checked by `QArray.check`:

  * `shape`, `dtype`, `format`, `packed_axis`, `scale_encoding` are static metadata (part of the
    treedef, never traced), so jit caches key on them;
  * `scale.ndim == len(shape)` and `scale.shape[i]` divides `shape[i]`: the block (tile) along
    axis `i` is `shape[i] // scale.shape[i]`, so per-tensor, per-channel, per-group, 2-D blocks
    and per-token scales are one mechanism, and layout ops (transpose, reshape of untouched axes,
    slicing whole blocks) apply to codes and scales alike;
  * `zero_point`, if present, has the shape of `scale` and is in code units;
  * `tensor_scale`, if present, has shape `(1,) * ndim` (a second-level scale, as in NVFP4);
  * `codes` has the logical shape, except along `packed_axis` (sub-byte formats), where it holds
    `packed_length(shape[packed_axis], bits)` bytes.

A 2-D `QArray` may also carry `kernel`: the same weight in the layout a compiled matmul kernel
reads (built once by `lowbit.ops.attach_kernel_layout` at quantize or load time, opaque here),
with `kernel_axis`, the logical axis it contracts over. It is a cache of the codes, never the
only copy: it is not an `__init__` field, so every `dataclasses.replace` (all layout ops except
`transpose` and `astype`, which keep it valid) drops it, and a reshaped, sliced or re-quantized
array can never be paired with a stale layout.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.formats import Format, get_format

# How `scale` is stored: as a float array, as E8M0 exponents (uint8, value 2**(e - 127), the MX
# block scale), or as float8_e4m3fn (the NVFP4 block scale).
SCALE_ENCODINGS = ("float", "e8m0", "e4m3")


@dataclasses.dataclass(frozen=True, eq=False)
class QArray:
    """A quantized array: packed codes, scales and static format metadata.

    Attributes:
      codes: packed storage (see module docstring).
      scale: [s_0, ..., s_{n-1}] with s_i dividing shape[i].
      zero_point: like `scale`, in code units, or None (symmetric).
      tensor_scale: [1, ..., 1] float32, or None.
      format: registry name of the element format.
      shape: logical shape.
      dtype: logical dtype (what `dequantize` returns).
      packed_axis: logical axis along which sub-byte codes are packed, or None.
      scale_encoding: one of SCALE_ENCODINGS.
      activation: how ops that consume this array (as a weight) quantize their other operand,
        or None for weight-only. A `lowbit.qarray.QuantConfig`; static.
      activation_bounds: [2] float32 `(lo, hi)` static (calibrated) bounds for that operand, or
        None to compute them per call (dynamic quantization).
    """

    codes: jax.Array
    scale: jax.Array
    zero_point: jax.Array | None
    tensor_scale: jax.Array | None
    format: str
    shape: tuple[int, ...]
    dtype: np.dtype
    packed_axis: int | None = None
    scale_encoding: str = "float"
    activation: Any = None
    activation_bounds: jax.Array | None = None
    kernel: Any = dataclasses.field(default=None, init=False, repr=False)
    kernel_axis: int | None = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self):
        # Normalise static metadata so equal layouts give equal treedefs (jit cache keys).
        shape = tuple(int(n) for n in self.shape)
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        # `vmap` (and `scan` over stacked weights) rebuild a QArray from leaves that lost or
        # gained leading axes while the static metadata did not: re-derive the logical shape
        # from the leaves so the value stays self-consistent (leading axes are never packed).
        codes_ndim = getattr(self.codes, "ndim", None)
        extra = 0 if not isinstance(codes_ndim, int) else codes_ndim - len(shape)
        if extra > 0:
            shape = tuple(self.codes.shape[:extra]) + shape
        elif extra < 0:
            shape = shape[-extra:]
        if extra and self.packed_axis is not None:
            object.__setattr__(self, "packed_axis", self.packed_axis + extra)
        object.__setattr__(self, "shape", shape)

    # --- array-like surface -------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def fmt(self) -> Format:
        return get_format(self.format)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Elements per scale along each axis."""
        return tuple(n // s for n, s in zip(self.shape, self.scale.shape, strict=True))

    @property
    def nbytes(self) -> int:
        """Bytes actually stored: packed codes plus every scale and zero point."""
        leaves = (
            self.codes,
            self.scale,
            self.zero_point,
            self.tensor_scale,
            self.activation_bounds,
        )
        return sum(
            int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in leaves if a is not None
        )

    @property
    def T(self) -> QArray:  # noqa: N802 - mirrors jax.Array.T
        return self.transpose(tuple(reversed(range(self.ndim))))

    def __repr__(self) -> str:
        extra = []
        if self.zero_point is not None:
            extra.append("asymmetric")
        if self.tensor_scale is not None:
            extra.append("tensor_scale")
        if self.packed_axis is not None:
            extra.append(f"packed_axis={self.packed_axis}")
        if self.scale_encoding != "float":
            extra.append(f"scale={self.scale_encoding}")
        if self.kernel is not None:
            extra.append(f"kernel_layout(axis={self.kernel_axis})")
        blocks = "x".join(map(str, self.block_shape)) if hasattr(self.scale, "shape") else "?"
        tail = (", " + ", ".join(extra)) if extra else ""
        return (
            f"QArray({self.format}, shape={self.shape}, dtype={np.dtype(self.dtype).name}, "
            f"blocks={blocks}{tail})"
        )

    # --- values ---------------------------------------------------------------------------------
    def unpacked_codes(self) -> jax.Array:
        """Codes in the format's `code_dtype`, with the logical shape."""
        if self.packed_axis is None:
            return self.codes
        return self.fmt.unpack(self.codes, self.shape[self.packed_axis], self.packed_axis)

    def scale_values(self) -> jax.Array:
        """The scale as float32, tensor scale folded in: [s_0, ..., s_{n-1}]."""
        scale = decode_scale(self.scale, self.scale_encoding)
        if self.tensor_scale is not None:
            scale = scale * self.tensor_scale.astype(jnp.float32)
        return scale

    def dequantize(self, dtype: Any = None) -> jax.Array:
        """The float array this QArray stands for.

        Args:
          dtype: output dtype; defaults to the logical dtype.
        Returns:
          [*shape] in `dtype`.
        """
        values = self.fmt.decode(self.unpacked_codes())
        if self.zero_point is not None:
            values = values - broadcast_blocks(self.zero_point.astype(jnp.float32), self.shape)
        values = values * broadcast_blocks(self.scale_values(), self.shape)
        return values.astype(self.dtype if dtype is None else dtype)

    def astype(self, dtype: Any) -> QArray:
        """Same codes (and kernel layout), another logical dtype."""
        out = dataclasses.replace(self, dtype=np.dtype(dtype))
        return out.with_kernel(self.kernel, self.kernel_axis)

    # --- kernel layout cache --------------------------------------------------------------------
    def with_kernel(self, kernel: Any, axis: int | None) -> QArray:
        """A copy carrying `kernel` (a pytree) prepared for contraction over logical `axis`.

        `kernel=None` gives a copy without one. Only the ops layer builds and reads kernels.
        """
        out = dataclasses.replace(self)
        if kernel is not None:
            if axis is None or not 0 <= axis < self.ndim:
                raise ValueError(f"kernel axis={axis!r} must be an axis of shape {self.shape}")
            object.__setattr__(out, "kernel", kernel)
            object.__setattr__(out, "kernel_axis", int(axis))
        return out

    @property
    def kernel_nbytes(self) -> int:
        """Bytes of the kernel layout cache (0 without one); not part of `nbytes`."""
        return sum(
            int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
            for a in jax.tree_util.tree_leaves(self.kernel)
        )

    # --- layout ops -----------------------------------------------------------------------------
    def transpose(self, axes: tuple[int, ...]) -> QArray:
        """Permutes the logical axes (codes, scales and zero points alike)."""
        axes = tuple(int(a) % self.ndim for a in axes)
        if sorted(axes) != list(range(self.ndim)):
            raise ValueError(f"axes must be a permutation of range({self.ndim}), got {axes}")
        perm = lambda a: None if a is None else jnp.transpose(a, axes)
        out = dataclasses.replace(
            self,
            codes=jnp.transpose(self.codes, axes),
            scale=perm(self.scale),
            zero_point=perm(self.zero_point),
            tensor_scale=perm(self.tensor_scale),
            shape=tuple(self.shape[a] for a in axes),
            packed_axis=None if self.packed_axis is None else axes.index(self.packed_axis),
        )
        # A kernel layout names the axis it contracts over, so it survives any permutation.
        if self.kernel is None:
            return out
        return out.with_kernel(self.kernel, axes.index(self.kernel_axis))

    def check(self) -> QArray:
        """Checks the invariants in the module docstring; returns self.

        Raises:
          ValueError: naming the field that breaks an invariant.
        """
        fmt = self.fmt
        nd = len(self.shape)
        if self.scale_encoding not in SCALE_ENCODINGS:
            raise ValueError(f"scale_encoding={self.scale_encoding!r}; accepted: {SCALE_ENCODINGS}")
        if self.scale.ndim != nd or any(
            s == 0 or n % s for n, s in zip(self.shape, self.scale.shape, strict=True)
        ):
            raise ValueError(
                f"scale shape {tuple(self.scale.shape)} must have one entry per axis of "
                f"{self.shape} dividing it"
            )
        if self.zero_point is not None and self.zero_point.shape != self.scale.shape:
            raise ValueError(
                f"zero_point shape {tuple(self.zero_point.shape)} != scale shape "
                f"{tuple(self.scale.shape)}"
            )
        if self.tensor_scale is not None and tuple(self.tensor_scale.shape) != (1,) * nd:
            raise ValueError(f"tensor_scale shape {tuple(self.tensor_scale.shape)} != {(1,) * nd}")
        expected = list(self.shape)
        if self.packed_axis is not None:
            if not 0 <= self.packed_axis < nd:
                raise ValueError(f"packed_axis={self.packed_axis} out of range for ndim {nd}")
            expected[self.packed_axis] = fmt.packed_length(self.shape[self.packed_axis])
        if tuple(self.codes.shape) != tuple(expected):
            raise ValueError(f"codes shape {tuple(self.codes.shape)} != expected {tuple(expected)}")
        return self


_DATA_FIELDS = ("codes", "scale", "zero_point", "tensor_scale", "activation_bounds", "kernel")


def _flatten_with_keys(q: QArray):
    children = tuple((jax.tree_util.GetAttrKey(f), getattr(q, f)) for f in _DATA_FIELDS)
    return children, _flatten(q)[1]


def _flatten(q: QArray):
    # Spelled out: this runs for every QArray on every jit call (dispatch time).
    return (
        (q.codes, q.scale, q.zero_point, q.tensor_scale, q.activation_bounds, q.kernel),
        (q.format, q.shape, q.dtype, q.packed_axis, q.scale_encoding, q.activation, q.kernel_axis),
    )


def _unflatten(aux, children) -> QArray:
    fmt, shape, dtype, packed_axis, scale_encoding, activation, kernel_axis = aux
    codes, scale, zero_point, tensor_scale, activation_bounds, kernel = children
    q = QArray(
        codes=codes,
        scale=scale,
        zero_point=zero_point,
        tensor_scale=tensor_scale,
        format=fmt,
        shape=shape,
        dtype=dtype,
        packed_axis=packed_axis,
        scale_encoding=scale_encoding,
        activation=activation,
        activation_bounds=activation_bounds,
    )
    if kernel is None:
        return q
    # Every child comes back, whatever it is: tree utilities (e.g. Orbax naming each leaf)
    # unflatten with non-array leaves, and a dropped child would change the tree's structure.
    object.__setattr__(q, "kernel", kernel)
    if kernel_axis is not None:
        # `vmap` / `scan` may have added or removed leading axes (see `__post_init__`).
        object.__setattr__(q, "kernel_axis", kernel_axis + len(q.shape) - len(shape))
    return q


# Registered by hand rather than with `register_dataclass`: `kernel` is a leaf but not an
# `__init__` field.
jax.tree_util.register_pytree_with_keys(
    QArray, _flatten_with_keys, _unflatten, flatten_func=_flatten
)


def decode_scale(scale: jax.Array, encoding: str) -> jax.Array:
    """Stored scale to float32."""
    if encoding == "e8m0":
        # E8M0: 2**(e - 127); 255 is NaN in the OCP spec and never written by `quantize`.
        return jnp.ldexp(jnp.float32(1), scale.astype(jnp.int32) - 127)
    return scale.astype(jnp.float32)


def broadcast_blocks(blocks: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Expands per-block values to `shape` by repeating each along its block.

    Args:
      blocks: [s_0, ..., s_{n-1}], s_i dividing shape[i].
      shape: (n_0, ..., n_{n-1}).
    Returns:
      [n_0, ..., n_{n-1}].
    """
    if tuple(blocks.shape) == tuple(shape):
        return blocks
    interleaved = []
    for n, s in zip(shape, blocks.shape, strict=True):
        interleaved += [s, n // s]
    expanded = jnp.broadcast_to(
        blocks.reshape([d for s in blocks.shape for d in (s, 1)]), interleaved
    )
    return expanded.reshape(shape)


def is_qarray(x: Any) -> bool:
    return isinstance(x, QArray)
