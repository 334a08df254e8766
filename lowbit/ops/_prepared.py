"""Serving weights in the CPU kernels' layout, in place of their codes.

`prepare_weights(tree, axes)` is the one place that builds kernel layouts: every 2-D `QArray`
that `axes` names (its contraction axis, taken from a traced use, see
`lowbit.engine.kernel_axes`) and that a kernel runs becomes a `PreparedQArray`, which holds the
kernel's packed layout (`lowbit.kernels.pack`) *instead of* the codes and scales. The logical
`QArray` is recovered exactly from it (`PreparedQArray.logical()`, through
`lowbit.kernels.prepared_to_logical`) for checkpoints, dequantization and any op other than the
linear layer it was prepared for; only the few scale or zero-point values the layout's float32
headers cannot return bit for bit (e.g. an asymmetric int4 zero point moved by 8) are kept
beside it, checked when the weight is prepared.

So a served weight is resident once: as kernel layout, or as logical codes, never both.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit import kernels
from lowbit._host_memory import release_free_memory
from lowbit.formats import get_format
from lowbit.gguf import block_type
from lowbit.ops._cpu_kernels import KernelRoute, gguf_rows, prepare_layout, weight_route
from lowbit.ops._operand import quantized
from lowbit.qarray import META_FIELDS, ArrayBacked, EngineValue, NoRule, QArray


@dataclasses.dataclass(frozen=True)
class LogicalMeta:
    """Static description of the QArray a `PreparedQArray` stands for (hashable): the
    QArray's own static fields (`META_FIELDS`), then its scale's and zero point's shapes."""

    format: str
    shape: tuple[int, ...]
    dtype: np.dtype
    packed_axis: int | None
    scale_encoding: str
    activation: Any
    scale_shape: tuple[int, ...]
    scale_dtype: np.dtype
    zero_shape: tuple[int, ...] | None
    zero_dtype: np.dtype | None

    @classmethod
    def of(cls, q: QArray) -> LogicalMeta:
        zero = q.zero_point
        return cls(
            **{name: getattr(q, name) for name in META_FIELDS},
            scale_shape=tuple(q.scale.shape),
            scale_dtype=np.dtype(q.scale.dtype),
            zero_shape=None if zero is None else tuple(zero.shape),
            zero_dtype=None if zero is None else np.dtype(zero.dtype),
        )

    def qarray_fields(self, **changed: Any) -> dict[str, Any]:
        """The QArray's static fields (`META_FIELDS`), with `changed` ones replaced."""
        return {name: getattr(self, name) for name in META_FIELDS} | changed


@typing.final
@dataclasses.dataclass(frozen=True, eq=False)
class PreparedQArray(ArrayBacked):
    """A 2-D quantized weight held in the CPU kernels' layout only.

    Attributes:
      weight: `lowbit.kernels.PreparedWeight` of the weight oriented `[K, N]` (contracted over
        its axis 0).
      scale, zero_point: the logical QArray's, kept only when the layout cannot return them
        exactly (else None).
      tensor_scale: the logical QArray's (one element), or None.
      axis: the logical axis the weight is contracted over (0: stored `[K, N]`, 1: `[N, K]`).
      route: the kernel route it was prepared for.
      meta: the logical QArray's static metadata.
      input_scale: the logical QArray's `input_scale` (applied to the other operand of a dot
        before the kernel runs), or None.
    """

    weight: kernels.PreparedWeight
    scale: jax.Array | None
    zero_point: jax.Array | None
    tensor_scale: jax.Array | None
    axis: int
    route: KernelRoute
    meta: LogicalMeta
    input_scale: jax.Array | None = None

    # --- array-like surface (the logical array's) -------------------------------------------
    backing = "meta"  # shape and dtype are those of the logical QArray (`meta`)

    @property
    def format(self) -> str:
        return self.meta.format

    @property
    def activation(self) -> Any:
        return self.meta.activation

    @property
    def nbytes(self) -> int:
        """Bytes of the logical QArray (what a checkpoint stores), as `QArray.nbytes`."""
        return _logical_nbytes(self.meta, self.tensor_scale, self.input_scale)

    @property
    def resident_nbytes(self) -> int:
        """Bytes actually held: the kernel layout plus any kept scale / zero point."""
        return sum(
            int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(self)
        )

    @property
    def T(self) -> PreparedQArray:  # noqa: N802 - mirrors jax.Array.T
        return self.transpose((1, 0))

    def __repr__(self) -> str:
        return (
            f"PreparedQArray({self.format}, shape={self.shape}, "
            f"dtype={np.dtype(self.dtype).name}, kernel={self.route.kind}, axis={self.axis})"
        )

    # --- cheap layout changes: the kernel layout stays ----------------------------------------
    def transpose(self, axes: tuple[int, ...]) -> PreparedQArray:
        axes = tuple(int(a) % 2 for a in axes)
        if axes == (0, 1):
            return self
        if axes != (1, 0):
            raise ValueError(f"axes must be a permutation of range(2), got {axes}")
        m = self.meta
        flip = lambda s: None if s is None else tuple(reversed(s))
        meta = dataclasses.replace(
            m,
            shape=flip(m.shape),
            packed_axis=None if m.packed_axis is None else 1 - m.packed_axis,
            scale_shape=flip(m.scale_shape),
            zero_shape=flip(m.zero_shape),
        )
        t = lambda a: None if a is None else a.T
        return dataclasses.replace(
            self,
            scale=t(self.scale),
            zero_point=t(self.zero_point),
            input_scale=t(self.input_scale),
            axis=1 - self.axis,
            route=dataclasses.replace(self.route, transposed=self.axis == 0),
            meta=meta,
        )

    def astype(self, dtype: Any) -> PreparedQArray:
        return dataclasses.replace(self, meta=dataclasses.replace(self.meta, dtype=np.dtype(dtype)))

    # --- back to the logical form ---------------------------------------------------------------
    def logical(self) -> QArray:
        """The QArray this weight was prepared from, bit for bit (a full pass over the layout)."""
        return _logical(self)

    def dequantize(self, dtype: Any = None) -> jax.Array:
        """The float array it stands for: [*shape] in `dtype` (default the logical dtype)."""
        return self.logical().dequantize(dtype)

    # --- the engine's protocol (`EngineValue`) -------------------------------------------------
    def map_layout(self, qarray_fn: Any, float_fn: Any) -> Any:
        """Only ops that leave the weight the same weight (transpose, float cast, copy) reach
        here: `qarray_fn` implements them on the layout (`transpose`, `astype`); the engine
        makes the weight logical for any other layout op."""
        return qarray_fn(self)

    def describe(self) -> str:
        return f"PreparedQArray({self.format}, shape={tuple(self.shape)})"

    def dot_general(self, lhs: Any, rhs: Any, dimension_numbers: Any, **kwargs: Any) -> Any:
        return NotImplemented  # `lowbit.ops.dot_general` runs the kernel it was laid out for

    def shard_parts(self, spec: Any, qarray_parts: Any) -> Any:
        """Whole on every device (a spec that splits nothing): enters a `shard_map` in its
        layout. Split: as its logical `QArray`, whose pieces are then laid out inside every
        call (`PreparedPieces` holds pieces laid out once)."""
        if any(entry is not None for entry in spec):
            return self.logical().shard_parts(spec, qarray_parts)
        leaves, treedef = jax.tree.flatten(self)
        specs = [jax.sharding.PartitionSpec()] * len(leaves)
        return leaves, specs, lambda local: jax.tree.unflatten(treedef, local)

    @property
    def gathers_rows(self) -> bool:
        """Whether `rows` can read rows straight from the layout."""
        return self.scale is None and self.zero_point is None and self.input_scale is None

    def rows(self, ids: jax.Array) -> QArray:
        """Rows of the logical array along its non-contracted axis, as a small QArray.

        Reads only the kernel panels holding those rows (an embedding lookup on a tied
        embedding prepared as the output projection), never the whole layout.

        Only when `gathers_rows` (no scale or zero point kept beside the layout).

        Args:
          ids: [M] int indices along axis `1 - axis`, in range.
        Returns:
          QArray [M, K] (the contracted axis last, as logical rows of a `[N, K]` weight).
        """
        if self.route.kind in kernels.GGUF_KINDS:
            # Whole block rows: the gathered rows are a QArray of the same format.
            rows = _gguf_take(self.weight, ids)
            if holds_as_gguf_tiles(self):
                shape = (int(ids.shape[0]), self.weight.k)
                packed = 1 if self.meta.packed_axis is not None else None
                return _logical_of_twin(self, rows, shape, axis=1, packed_axis=packed)
            return dataclasses.replace(
                _gguf_qarray(self, rows, (int(ids.shape[0]), self.weight.k)), packed_axis=1
            )
        cols = kernels.prepared_columns(self.weight, ids)
        return _assemble(self, cols, rows=True)


jax.tree_util.register_dataclass(
    PreparedQArray,
    data_fields=["weight", "scale", "zero_point", "tensor_scale", "input_scale"],
    meta_fields=["axis", "route", "meta"],
)


@dataclasses.dataclass(frozen=True)
class PreparedPieces(EngineValue):
    """A 2-D weight split along one axis over a mesh axis, each device's piece held in the CPU
    kernels' layout, laid out once (`lowbit.models.shard_for_generation` builds them).

    Inside a `shard_map` whose spec splits the weight the same way, each device gets its own
    piece as a `PreparedQArray` and runs the kernel on it. Anywhere else it is its logical
    `QArray`, the pieces joined (`logical`; counted by the engine like any dequantization).

    Attributes:
      pieces: one `PreparedQArray` for every piece, each array with a leading axis of one
        entry per piece, split over `mesh_axis` (each device holds its own piece only).
      mesh_axis: the mesh axis the pieces lie along.
      axis: the logical axis the weight is split along.
      shape, dtype: the whole weight's logical shape and dtype.
    """

    pieces: PreparedQArray
    mesh_axis: str
    axis: int
    shape: tuple[int, ...]
    dtype: Any

    @property
    def format(self) -> str:
        return self.pieces.format

    @property
    def count(self) -> int:
        """How many pieces."""
        return int(self.pieces.weight.data.shape[0])

    def piece(self, i: int) -> PreparedQArray:
        return jax.tree.map(lambda a: a[i], self.pieces)

    def logical(self) -> QArray:
        """The whole weight's `QArray`: each piece's, joined along `axis`."""
        return _join([self.piece(i).logical() for i in range(self.count)], self.axis)

    def dequantize(self, dtype: Any = None) -> jax.Array:
        return self.logical().dequantize(dtype)

    def map_layout(self, qarray_fn: Any, float_fn: Any) -> Any:
        raise NoRule(f"is split in pieces over mesh axis {self.mesh_axis!r}")

    def describe(self) -> str:
        return (
            f"PreparedPieces({self.format}, shape={self.shape}, {self.count} pieces along "
            f"axis {self.axis} over {self.mesh_axis!r})"
        )

    def shard_parts(self, spec: Any, qarray_parts: Any) -> Any:
        """Each device's piece in its layout, when `spec` splits `axis` over `mesh_axis` and
        nothing else; any other spec splits the logical `QArray` (laid out per call)."""
        names = [spec[a] if a < len(spec) else None for a in range(len(self.shape))]
        names = [n[0] if isinstance(n, tuple) and len(n) == 1 else n for n in names]
        wanted = [self.mesh_axis if a == self.axis else None for a in range(len(self.shape))]
        if names != wanted:
            return self.logical().shard_parts(spec, qarray_parts)
        leaves, treedef = jax.tree.flatten(self.pieces)
        specs = [jax.sharding.PartitionSpec(self.mesh_axis)] * len(leaves)
        return leaves, specs, lambda local: jax.tree.unflatten(treedef, [a[0] for a in local])


jax.tree_util.register_dataclass(
    PreparedPieces,
    data_fields=["pieces"],
    meta_fields=["mesh_axis", "axis", "shape", "dtype"],
)


def _join(qs: list[QArray], axis: int) -> QArray:
    """QArrays of the same format joined along `axis` (each filling whole bytes there); the
    arrays with one entry along `axis` (a scale over the whole axis) are the pieces' common
    one."""
    first = qs[0]

    def joined(name: str) -> Any:
        a = getattr(first, name)
        if a is None or a.shape[axis] == 1:
            return a
        return jnp.concatenate([getattr(q, name) for q in qs], axis)

    shape = list(first.shape)
    shape[axis] = sum(q.shape[axis] for q in qs)
    return dataclasses.replace(
        first,
        codes=jnp.concatenate([q.codes for q in qs], axis),
        scale=joined("scale"),
        zero_point=joined("zero_point"),
        input_scale=joined("input_scale"),
        shape=tuple(shape),
    )


def is_prepared(x: Any, pieces: bool = False) -> bool:
    """Whether `x` is a weight in the CPU kernels' layout: a `PreparedQArray`, or with `pieces`
    also one split over a mesh (`PreparedPieces`). The one place `lowbit.ops` tells a layout
    from the other kinds of value."""
    return isinstance(x, (PreparedQArray, PreparedPieces) if pieces else PreparedQArray)


def _logical_nbytes(meta: LogicalMeta, tensor_scale: Any, input_scale: Any) -> int:

    fmt = get_format(meta.format)
    shape = list(meta.shape)
    if meta.packed_axis is None:
        codes = int(np.prod(shape)) * np.dtype(fmt.code_dtype).itemsize
    else:
        shape[meta.packed_axis] = fmt.packed_length(shape[meta.packed_axis])
        codes = int(np.prod(shape))
    total = codes + int(np.prod(meta.scale_shape)) * np.dtype(meta.scale_dtype).itemsize
    if meta.zero_shape is not None:
        total += int(np.prod(meta.zero_shape)) * np.dtype(meta.zero_dtype).itemsize
    for extra in (tensor_scale, input_scale):
        if extra is not None:
            total += int(np.prod(extra.shape)) * np.dtype(extra.dtype).itemsize
    return total


def _encode_scale(values: jax.Array, meta: LogicalMeta, tensor_scale: Any) -> jax.Array:
    """float32 group scales (tensor scale folded in) back to the stored encoding."""
    if tensor_scale is not None:
        values = values / tensor_scale.reshape(()).astype(jnp.float32)
    if meta.scale_encoding == "e8m0":
        _, exponent = jnp.frexp(values)
        return (exponent + 126).astype(jnp.uint8)
    if meta.scale_encoding == "e4m3":
        return values.astype(jnp.float8_e4m3fn)
    return values.astype(meta.scale_dtype)


def _assemble(p: PreparedQArray, parts: dict[str, Any], *, rows: bool = False) -> QArray:
    """A QArray from `prepared_to_logical`-style parts of the `[K, N]` oriented weight.

    `rows=False`: the whole weight, in the logical orientation. `rows=True`: the parts are
    `[K, M]` columns (rows of the `[N, K]` view), returned as a QArray `[M, K]`.
    """
    m = p.meta
    codes, scale, zero = parts["codes"], parts["scale"], parts["zero_point"]
    if p.route.shift_int4:
        codes = codes ^ jnp.uint8(8)
        zero = zero - 8.0
    oriented_scale = m.scale_shape if p.axis == 0 else m.scale_shape[::-1]
    oriented_zero = None
    if m.zero_shape is not None:
        oriented_zero = m.zero_shape if p.axis == 0 else m.zero_shape[::-1]
    if rows:
        # Columns [K, M]: the scale rows stay, the column entries are per column (or one).
        take_cols = lambda a, shape: a[: shape[0], :] if shape[1] != 1 else a[: shape[0], :1]
        codes, shape = codes.T, (codes.shape[1], codes.shape[0])
        scale = take_cols(scale, oriented_scale).T
        zero = None if oriented_zero is None else take_cols(zero, oriented_zero).T
        packed_axis = None  # a few rows: left unpacked (codes in `code_dtype`)
        kept_scale = kept_zero = None  # `gathers_rows` is False when leaves were kept
    else:
        scale = scale[: oriented_scale[0], : oriented_scale[1]]
        zero = None if oriented_zero is None else zero[: oriented_zero[0], : oriented_zero[1]]
        if p.axis == 1:
            codes, scale = codes.T, scale.T
            zero = None if zero is None else zero.T
        shape, packed_axis = m.shape, m.packed_axis
        kept_scale, kept_zero = p.scale, p.zero_point

    fmt = get_format(m.format)
    codes = codes.astype(fmt.code_dtype) if codes.dtype != fmt.code_dtype else codes
    if packed_axis is not None:
        codes = fmt.pack(codes, packed_axis)
    scale = kept_scale if kept_scale is not None else _encode_scale(scale, m, p.tensor_scale)
    if zero is not None:
        zero = kept_zero if kept_zero is not None else zero.astype(m.zero_dtype)
    ndim = len(shape)
    tensor_scale = None if p.tensor_scale is None else p.tensor_scale.reshape((1,) * ndim)
    return QArray(
        codes=codes,
        scale=scale,
        zero_point=zero,
        tensor_scale=tensor_scale,
        input_scale=None if rows else p.input_scale,
        **m.qarray_fields(shape=shape, packed_axis=packed_axis),
    )


@jax.jit
def _logical(p: PreparedQArray) -> QArray:
    if p.route.kind in kernels.GGUF_KINDS:
        rows = _gguf_block_rows(p.weight)
        if holds_as_gguf_tiles(p):
            return _logical_of_twin(
                p, rows, p.meta.shape, axis=p.axis, packed_axis=p.meta.packed_axis
            )
        return _gguf_qarray(p, rows if p.axis == 1 else rows.T, p.meta.shape)
    return _assemble(p, kernels.prepared_to_logical(p.weight))


# Laid out once: the types with tiles (`kernels.gguf_tileable`) as tiles, the others as rows;
# for a caller that gives the QArray up, written over its codes where they are the same size.
_gguf_layout = jax.jit(functools.partial(gguf_rows, tile=True), static_argnums=1)
_gguf_layout_over_codes = jax.jit(
    functools.partial(gguf_rows, tile=True, over_rows=True), static_argnums=1, donate_argnums=0
)


def _gguf_block_rows(w: kernels.PreparedWeight) -> jax.Array:
    """The block rows ``uint8 [N, row_bytes]`` of a GGUF layout (tiles read back)."""
    if kernels.is_tiled(w.data, w.n):
        return kernels.gguf_untile(w.data, w.kind.upper(), w.k)
    return w.data


def _gguf_take(w: kernels.PreparedWeight, ids: jax.Array) -> jax.Array:
    """Block rows `ids` ``[M]`` of a GGUF layout, ``uint8 [M, row_bytes]``: of tiles, the
    groups of 8 holding them read back and the rows picked."""
    if not kernels.is_tiled(w.data, w.n):
        return jnp.take(w.data, ids, axis=0)
    groups = kernels.gguf_untile(jnp.take(w.data, ids // 8, axis=0), w.kind.upper(), w.k)
    picked = jnp.arange(ids.shape[0]) * 8 + ids % 8
    return jnp.take(groups, picked, axis=0)


# Weight-only kinds whose groups of 32 along K with float16 scales are a GGUF type's blocks
# (a file's Q4_0 / Q8_0 tensor imports as int4 / int8): the same values on that type's tiles.
_GGUF_TWINS = {"int4": "q4_0", "int8": "q8_0"}


def holds_as_gguf_tiles(p: PreparedQArray) -> bool:
    """Whether `p` is an int4 / int8 weight held as Q4_0 / Q8_0 tiles (`as_gguf_tiles`)."""
    return _GGUF_TWINS.get(p.meta.format) == p.route.kind


def _logical_of_twin(
    p: PreparedQArray,
    rows: jax.Array,
    shape: tuple[int, ...],
    *,
    axis: int,
    packed_axis: int | None,
) -> QArray:
    """The int4 / int8 QArray of Q4_0 / Q8_0 block rows ``[N', K]``, shaped `shape` with its
    groups along `axis` (K) and its codes packed along `packed_axis` (int4)."""
    if p.route.kind == "q4_0":
        codes, d = kernels.q4_0_fields(rows)
    else:
        d, _, codes = block_type("Q8_0").split(rows)
        d = d.astype(jnp.float16)
    if axis == 0:
        codes, d = codes.T, d.T
    if packed_axis is not None:
        codes = get_format(p.meta.format).pack(codes, packed_axis)
    return QArray(
        codes=codes,
        scale=d.astype(p.meta.scale_dtype),
        zero_point=None,
        tensor_scale=None,
        input_scale=None,
        **p.meta.qarray_fields(shape=tuple(shape), packed_axis=packed_axis),
    )


def as_gguf_tiles(x: PreparedQArray) -> PreparedQArray | None:
    """An int4 / int8 weight in groups of 32 along K with float16 scales (a GGUF file's Q4_0 /
    Q8_0 tensor, imported as int4 / int8) laid out as Q4_0's / Q8_0's tiles, or None where
    that does not hold it exactly.

    The same values in fewer bytes (float16 scales, no column sums), and faster on int8
    activations than the int4 / int8 layouts: 1.2-1.3x for Q4_0 (2 AVX-512 VNNI cores,
    SmolLM2's and a 1.5B model's shapes, M = 1, 8 and 64), 1.1-1.4x for Q8_0 (4096 x 4096,
    M = 1 to 64, AVX2 and AVX-512 VNNI). On float activations the int4 layout is 2-4x faster,
    so only `with_int8_activations` moves a weight here (and a GGUF import made for it,
    which tiles the file's rows at once: `gguf_twin_tiles`).
    """
    route, meta = x.route, x.meta
    k, n = x.weight.k, x.weight.n
    twin = _GGUF_TWINS.get(route.kind)
    if (
        twin is None
        or route.group_size != 32
        or route.shift_int4
        or meta.format != route.kind
        or meta.activation is not None
        or meta.scale_encoding != "float"
        or meta.scale_dtype != np.dtype(jnp.float16)
        or any(a is not None for a in (x.scale, x.zero_point, x.tensor_scale, x.input_scale))
        or x.weight.data.ndim != 2  # one piece of `PreparedPieces` carries a leading axis
        or not kernels.gguf_tileable(twin.upper(), k, n)
    ):
        return None
    weight = _twin_layout(x.logical(), x.axis, twin)
    release_free_memory()
    tiled_route = KernelRoute(kind=twin, group_size=None, transposed=x.axis == 1)
    return dataclasses.replace(x, weight=weight, route=tiled_route)


def gguf_twin_tiles(
    q: QArray, rows: jax.Array, axis: int, *, transposed: bool = True
) -> PreparedQArray | None:
    """``as_gguf_tiles(prepare_transposed(q, axis))`` made from the file's bytes: `rows` are a
    GGUF file's Q4_0 / Q8_0 block rows ``uint8 [N, row_bytes]`` and `q` the int4 / int8
    QArray they import as, stored ``[N, K]`` (only its shapes and static fields are read:
    `jax.ShapeDtypeStruct` leaves will do). The tiles are written over `rows`, which the
    caller gives up, and no int4 / int8 layout is made first (that chain wrote the weight
    into fresh memory several times over: codes, their layout, read back, rows, tiles).
    `transposed=False`: of ``prepare_weight(q, axis)`` instead (the weight placed as
    stored). None where the chain would not end on the twin's tiles.
    """
    twin = _GGUF_TWINS.get(q.format)
    if twin is None or q.ndim != 2:
        return None
    stored_axis = 1 - axis if transposed else axis
    route = weight_route(q, stored_axis)
    n, k = q.shape
    if (
        route is None
        or route.kind != q.format
        or route.group_size != 32
        or route.shift_int4
        or q.activation is not None
        or q.scale_encoding != "float"
        or np.dtype(q.scale.dtype) != np.dtype(jnp.float16)
        or any(a is not None for a in (q.zero_point, q.tensor_scale, q.input_scale))
        or rows.shape != (n, k // 32 * block_type(twin.upper()).type_size)
        or not kernels.gguf_tileable(twin.upper(), k, n)
    ):
        return None
    tiles = _gguf_tiles_over_rows(rows, twin.upper())
    release_free_memory()
    weight = kernels.PreparedWeight(twin, k, n, None, 32, tiles)
    stored_route = KernelRoute(kind=twin, group_size=None, transposed=stored_axis == 1)
    stored = PreparedQArray(weight, None, None, None, stored_axis, stored_route, LogicalMeta.of(q))
    return stored.transpose((1, 0)) if transposed else stored


_gguf_tiles_over_rows = jax.jit(
    functools.partial(kernels.gguf_tile, over_rows=True), static_argnums=1, donate_argnums=0
)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _twin_layout(q: QArray, axis: int, twin: str) -> kernels.PreparedWeight:
    codes, scale = q.unpacked_codes(), q.scale
    if axis == 0:  # rows along N, blocks along K
        codes, scale = codes.T, scale.T
    n, k = codes.shape
    if twin == "q4_0":
        rows = kernels.q4_0_rows(codes, scale)
    else:
        rows = block_type("Q8_0").join(scale.astype(jnp.float32), None, codes)
    return kernels.PreparedWeight(twin, k, n, None, 32, kernels.gguf_tile(rows, twin.upper()))


def _gguf_qarray(p: PreparedQArray, codes: jax.Array, shape: tuple[int, ...]) -> QArray:
    """The QArray of GGUF block codes (blocks along axis `p.axis` of `shape`)."""
    return QArray(
        codes=codes,
        scale=jnp.ones(p.meta.scale_shape, p.meta.scale_dtype),
        zero_point=None,
        tensor_scale=None,
        input_scale=None,
        **p.meta.qarray_fields(shape=tuple(shape), packed_axis=p.axis),
    )


@functools.partial(jax.jit, static_argnums=1)
def _prepare_checked(q: QArray, p_static: Any):
    """The layout, and the scale and zero point it gives back (for the exactness check).

    One program per weight layout: compiling fewer programs at load time keeps the compiler's
    share of peak and retained memory down.
    """
    route, axis, meta = p_static
    weight = prepare_layout(q, route)
    tensor_scale = None if q.tensor_scale is None else q.tensor_scale.reshape(1)
    p = PreparedQArray(weight, None, None, tensor_scale, axis, route, meta)
    back = _assemble(p, kernels.prepared_to_logical(weight))
    return weight, back.scale, back.zero_point


def _same_bits(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def prepare_weight(q: QArray, axis: int, *, donate: bool = False) -> QArray | PreparedQArray:
    """`q` in the kernel layout for contraction over `axis`, or `q` if no kernel runs it.

    Args:
      q: a QArray (2-D to be prepared; anything else is returned as is).
      axis: the logical axis a traced use contracts it over (0 or 1).
      donate: the caller gives `q` up (nothing else holds its arrays): a GGUF weight's layout
        is then written over its codes where it is their size (the types of
        `kernels.TILES_OVER_ROWS`, e.g. Q6_K), which deletes them, so the weight is not held
        twice while it is laid out. A loader's own QArrays only.
    Returns:
      A `PreparedQArray` replacing `q`, or `q` unchanged (not 2-D, activation bounds set, or a
      format, scale layout, size or backend no kernel takes).
    """
    if not quantized(q) or q.ndim != 2 or q.activation_bounds is not None:
        return q
    if axis not in (0, 1):
        raise ValueError(f"axis={axis!r}: a 2-D weight is contracted over axis 0 or 1")
    route = weight_route(q, axis)
    if route is None:
        return q
    meta = LogicalMeta.of(q)
    if route.kind in kernels.GGUF_KINDS:
        # The block rows are the layout (a copy only when stored [K, N]), or for Q4_K / Q6_K
        # their tiles of 8 rows (Q4_K's 32 bytes a tile larger); the logical QArray comes back
        # from either exactly.
        over = donate and route.kind.upper() in kernels.TILES_OVER_ROWS
        weight = (_gguf_layout_over_codes if over else _gguf_layout)(q, route)
        # The tiling's temporaries, and the codes of the weight laid out before this one
        # (`prepare_leaves` drops them as it replaces each leaf), back to the system.
        release_free_memory()
        return PreparedQArray(weight, None, None, None, axis, route, meta)
    tensor_scale = None if q.tensor_scale is None else q.tensor_scale.reshape(1)
    weight, scale, zero = _prepare_checked(q, (route, axis, meta))
    kept_scale, kept_zero = q.scale, q.zero_point
    if not isinstance(q.scale, jax.core.Tracer):  # traced: keep them (cannot compare)
        kept_scale = None if _same_bits(scale, q.scale) else q.scale
        kept_zero = None if _same_bits(zero, q.zero_point) else q.zero_point
        del scale, zero
        release_free_memory()
    return PreparedQArray(
        weight, kept_scale, kept_zero, tensor_scale, axis, route, meta, q.input_scale
    )


def prepare_transposed(q: QArray, axis: int, *, donate: bool = False) -> QArray | PreparedQArray:
    """``prepare_weight(q.T, axis)`` without a transposed copy of `q`'s codes.

    A layout is always the weight oriented ``[K, N]``, whichever logical axis is contracted,
    so the layout of ``q.T`` over `axis` is ``q``'s over ``1 - axis``, its logical view
    transposed (`PreparedQArray.transpose`, no pass over the codes). A loader whose file
    stores weights ``[out, in]`` (GGUF) so lays each one out from its stored bytes, where
    transposing first would copy it twice (there and back).

    Args:
      q: a QArray, ``[N, K]`` when `axis` is 0 (one of another rank is transposed and
        returned as `prepare_weight` returns it).
      axis: the axis of ``q.T`` a traced use contracts.
      donate: the caller gives `q` up (`prepare_weight`'s).
    Returns:
      ``q.T``'s `PreparedQArray`, or ``q.T`` itself (a copy) where no kernel runs it.
    """
    if q.ndim == 2 and axis in (0, 1):
        prepared = prepare_weight(q, 1 - axis, donate=donate)
        if is_prepared(prepared):
            return prepared.transpose((1, 0))
    return prepare_weight(q.T, axis)  # no layout: the transpose itself, as before
