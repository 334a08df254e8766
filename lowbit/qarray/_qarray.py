"""`QArray`: a quantized array as a pytree value.

A `QArray` stands for the float array

    x = (decode(codes) - zero_point) * scale * tensor_scale * input_scale

with `zero_point`, `tensor_scale` and `input_scale` optional. Its invariants, checked by
`QArray.check`:

  * `shape`, `dtype`, `format`, `packed_axis`, `scale_encoding` are static metadata (part of the
    treedef, never traced), so jit caches key on them;
  * `scale.ndim == len(shape)` and `scale.shape[i]` divides `shape[i]`: the block (tile) along
    axis `i` is `shape[i] // scale.shape[i]`, so per-tensor, per-channel, per-group, 2-D blocks
    and per-token scales are one mechanism, and layout ops (transpose, reshape of untouched axes,
    slicing whole blocks) apply to codes and scales alike;
  * `zero_point`, if present, has the shape of `scale` and is in code units;
  * `tensor_scale`, if present, has shape `(1,) * ndim` (a second-level scale, as in NVFP4);
  * `input_scale`, if present, has `ndim` axes, each 1 or the full axis: a per-input-channel
    factor that a dot applies to its *other* operand before the product (SmoothQuant's scale
    where no layer can absorb it: ``x @ W == (x * s) @ (W / s)``, with `W / s` the codes);
  * `codes` has the logical shape, except along `packed_axis` (sub-byte formats), where it holds
    `packed_length(shape[packed_axis], bits)` bytes.

Fields are declared once, in the class body, as data (`_data()`: arrays, pytree leaves) or
metadata (`_meta(...)`: static, part of the treedef); `DATA_FIELDS` and `META_FIELDS` are read
off the declarations, and so are the pytree registration and the checkpoint manifest encoding
(`manifest_metadata` / `from_manifest`), so a new field cannot be left out of either.

A `QArray` is logical only: kernels that want another layout keep it in their own value type
(`lowbit.ops.PreparedQArray`), never beside the codes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.formats import Format, get_format
from lowbit.qarray._value import EngineValue

# How `scale` is stored: as a float array, as E8M0 exponents (uint8, value 2**(e - 127), the MX
# block scale), or as float8_e4m3fn (the NVFP4 block scale).
SCALE_ENCODINGS = ("float", "e8m0", "e4m3")


def _data(**kwargs: Any) -> Any:
    """A data field: an array (or None), a pytree leaf, stored as a checkpoint tensor."""
    return dataclasses.field(metadata={"role": "data"}, **kwargs)


def _meta(codec: Any = None, **kwargs: Any) -> Any:
    """A static metadata field (part of the treedef).

    codec: how the checkpoint manifest stores it: None for a JSON value as is, a pair
    ``(encode, decode)``, or ``"config"`` for a `QuantConfig` (whose text form the caller of
    `manifest_metadata` / `from_manifest` supplies).
    """
    return dataclasses.field(metadata={"role": "meta", "codec": codec}, **kwargs)


@typing.final
@dataclasses.dataclass(frozen=True, eq=False)
class QArray(EngineValue):
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
      input_scale: [*shape with 1 on the axes it does not vary along] float32, or None: the
        ops multiply the float operand of a dot by it (along the contracted axes) before
        quantizing it, and `dequantize` folds it in, so the QArray still stands for the
        weight the float model had.
    """

    codes: jax.Array = _data()
    scale: jax.Array = _data()
    zero_point: jax.Array | None = _data()
    tensor_scale: jax.Array | None = _data()
    format: str = _meta(codec=(str, str))
    shape: tuple[int, ...] = _meta(codec=(list, tuple))
    dtype: np.dtype = _meta(codec=(lambda d: np.dtype(d).name, lambda n: np.dtype(jnp.dtype(n))))
    packed_axis: int | None = _meta(default=None)
    scale_encoding: str = _meta(default="float")
    activation: Any = _meta(default=None, codec="config")
    activation_bounds: jax.Array | None = _data(default=None)
    input_scale: jax.Array | None = _data(default=None)

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
        if isinstance(codes_ndim, int) and codes_ndim == len(shape):
            shape = self._local_shape(shape)
        object.__setattr__(self, "shape", shape)

    def _local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        # `shard_map` (and any transform that splits leaves) hands the body one device's piece
        # of the codes under the global static shape: follow the codes' own shape, counting
        # whole byte groups along the packed axis.
        codes_shape = tuple(self.codes.shape)
        if codes_shape == shape:
            return shape
        local = list(shape)
        for axis, (n, stored) in enumerate(zip(shape, codes_shape, strict=True)):
            if axis == self.packed_axis:
                full = get_format(self.format).packed_length(n)
                # `full` 0 (an empty logical axis) has no pieces: `check` refuses the codes.
                if stored != full and stored and full and full % stored == 0:
                    local[axis] = n // (full // stored)
            elif stored != n and stored and n % stored == 0:
                local[axis] = stored
        return tuple(local)

    # --- array-like surface -------------------------------------------------------------------
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
        """Bytes actually stored: packed codes plus every scale and zero point (for formats
        whose codes carry their scales, GGUF blocks, the codes alone)."""
        leaves = (
            self.codes,
            None if self.fmt.scales_in_codes else self.scale,
            self.zero_point,
            self.tensor_scale,
            self.activation_bounds,
            self.input_scale,
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
        if self.input_scale is not None:
            extra.append("input_scale")
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
        n, axis = self.shape[self.packed_axis], self.packed_axis
        if isinstance(self.codes, jax.core.Tracer):
            return _unpacked(self.codes, self.format, n, axis)
        return _unpacked_compiled(self.codes, self.format, n, axis)

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
        dtype = np.dtype(self.dtype if dtype is None else dtype)
        if isinstance(self.codes, jax.core.Tracer):
            return _dequantize(self, dtype)
        return _dequantize_compiled(self, dtype)

    def astype(self, dtype: Any) -> QArray:
        """Same codes, another logical dtype."""
        return dataclasses.replace(self, dtype=np.dtype(dtype))

    # --- the engine's protocol (`EngineValue`) -------------------------------------------------
    def map_layout(self, qarray_fn: Any, float_fn: Any) -> QArray:
        return qarray_fn(self)

    def describe(self) -> str:
        return f"QArray({self.format}, shape={tuple(self.shape)})"

    # `lowbit.ops`' dot_general, conv_general_dilated and ragged_dot_general take a QArray as
    # an operand as it is.
    def dot_general(self, lhs: Any, rhs: Any, dimension_numbers: Any, **kwargs: Any) -> Any:
        return NotImplemented

    def conv_general_dilated(self, lhs: Any, rhs: Any, **params: Any) -> Any:
        return NotImplemented

    def ragged_dot_general(self, lhs: Any, rhs: Any, group_sizes: Any, **params: Any) -> Any:
        return NotImplemented

    def scan_parts(self, qarray_parts: Any) -> Any:
        return qarray_parts(self)

    def scan_output_parts(self, qarray_parts: Any) -> Any:
        return qarray_parts(self)

    def shard_parts(self, spec: Any, qarray_parts: Any) -> Any:
        return qarray_parts(self, spec)

    # --- layout ops -----------------------------------------------------------------------------
    def transpose(self, axes: tuple[int, ...]) -> QArray:
        """Permutes the logical axes (codes, scales and zero points alike)."""
        axes = tuple(int(a) % self.ndim for a in axes)
        if sorted(axes) != list(range(self.ndim)):
            raise ValueError(f"axes must be a permutation of range({self.ndim}), got {axes}")
        perm = lambda a: None if a is None else jnp.transpose(a, axes)
        return dataclasses.replace(
            self,
            codes=jnp.transpose(self.codes, axes),
            scale=perm(self.scale),
            zero_point=perm(self.zero_point),
            tensor_scale=perm(self.tensor_scale),
            input_scale=perm(self.input_scale),
            shape=tuple(self.shape[a] for a in axes),
            packed_axis=None if self.packed_axis is None else axes.index(self.packed_axis),
        )

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
        if self.input_scale is not None and (
            self.input_scale.ndim != nd
            or any(s not in (1, n) for n, s in zip(self.shape, self.input_scale.shape, strict=True))
        ):
            raise ValueError(
                f"input_scale shape {tuple(self.input_scale.shape)} must have one entry per axis "
                f"of {self.shape}, each 1 or the full axis"
            )
        expected = list(self.shape)
        if self.packed_axis is not None:
            if not 0 <= self.packed_axis < nd:
                raise ValueError(f"packed_axis={self.packed_axis} out of range for ndim {nd}")
            expected[self.packed_axis] = fmt.packed_length(self.shape[self.packed_axis])
        if tuple(self.codes.shape) != tuple(expected):
            raise ValueError(f"codes shape {tuple(self.codes.shape)} != expected {tuple(expected)}")
        return self

    # --- checkpoint manifest ----------------------------------------------------------------
    def manifest_metadata(self, encode_config: Any) -> dict[str, Any]:
        """The static metadata as a JSON-ready dict, one key per metadata field.

        Args:
          encode_config: `QuantConfig` -> JSON-ready dict (the recipes' text forms).
        """
        return {name: _encode(self, name, encode_config) for name in field_roles(type(self))[1]}

    def manifest_tensors(self) -> dict[str, jax.Array]:
        """The data fields that are set, by field name (the checkpoint's tensor roles)."""
        data = field_roles(type(self))[0]
        return {name: getattr(self, name) for name in data if getattr(self, name) is not None}

    @classmethod
    def from_manifest(
        cls, metadata: dict[str, Any], tensors: dict[str, Any], decode_config: Any
    ) -> QArray:
        """Inverse of `manifest_metadata` / `manifest_tensors` (no checks: see `check`).

        Args:
          metadata: one entry per metadata field.
          tensors: the set data fields by name (absent ones are None).
          decode_config: JSON dict -> `QuantConfig`.
        """
        data, meta = field_roles(cls)
        values = {name: _decode(name, metadata[name], decode_config) for name in meta}
        return cls(**{name: tensors.get(name) for name in data}, **values)


@functools.cache
def field_roles(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(data fields, metadata fields) of `QArray` (or a subclass), in declaration order.

    Raises:
      TypeError: for a field declared without `_data()` / `_meta()`, which neither the pytree
        nor a checkpoint would know how to carry.
    """
    data, meta = [], []
    for f in dataclasses.fields(cls):
        role = f.metadata.get("role")
        if role not in ("data", "meta"):
            raise TypeError(
                f"{cls.__name__}.{f.name} is declared without _data() or _meta(): say whether "
                "it is an array (a pytree leaf and checkpoint tensor) or static metadata"
            )
        (data if role == "data" else meta).append(f.name)
    return tuple(data), tuple(meta)


DATA_FIELDS, META_FIELDS = field_roles(QArray)
"""QArray's array fields (pytree children, checkpoint tensor roles) and static metadata fields
(treedef, checkpoint manifest keys), in declaration order."""
_CODECS = {f.name: f.metadata.get("codec") for f in dataclasses.fields(QArray)}


def _encode(q: QArray, name: str, encode_config: Any) -> Any:
    value, codec = getattr(q, name), _CODECS.get(name)
    if value is None or codec is None:
        return value
    return encode_config(value) if codec == "config" else codec[0](value)


def _decode(name: str, value: Any, decode_config: Any) -> Any:
    codec = _CODECS.get(name)
    if value is None or codec is None:
        return value
    return decode_config(value) if codec == "config" else codec[1](value)


# Registered from the declarations above (a C++ flatten: this runs for every QArray on every
# jit dispatch and engine trace).
jax.tree_util.register_dataclass(
    QArray, data_fields=list(DATA_FIELDS), meta_fields=list(META_FIELDS)
)


def _unpacked(codes: jax.Array, name: str, n: int, axis: int) -> jax.Array:
    """`QArray.unpacked_codes` of packed `codes` in format `name`: `n` codes along `axis`."""
    return get_format(name).unpack(codes, n, axis)


# As `_dequantize_compiled`, for the codes alone (a GGUF export reads every weight's codes:
# op by op, SmolLM2's took 2.1 s of a 10 s `lowbit export`).
_unpacked_compiled = jax.jit(_unpacked, static_argnums=(1, 2, 3))


def _dequantize(q: QArray, dtype: np.dtype) -> jax.Array:
    """`QArray.dequantize`'s values: decoded codes, less the zero point, times the scale."""
    values = q.fmt.decode(q.unpacked_codes())
    if q.zero_point is not None:
        values = values - broadcast_blocks(q.zero_point.astype(jnp.float32), q.shape)
    values = values * broadcast_blocks(q.scale_values(), q.shape)
    if q.input_scale is not None:
        values = values * q.input_scale.astype(jnp.float32)
    return values.astype(dtype)


# A concrete QArray's dequantization as one program a (layout, dtype): op by op, a new shape
# compiled about ten small programs (0.5 s for a 576 x 1536 int4 weight) and every call
# dispatched each of them. A traced QArray takes `_dequantize` inline, in its caller's program.
_dequantize_compiled = jax.jit(_dequantize, static_argnums=1)


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
