"""The key/value cache of a decoder: float (the model's dtype, or float16 / bfloat16), or
quantized on write (int8, int4, fp8).

A cache holds, per layer, the keys and values of every token slot written so far. A quantized
cache stores codes plus one scale per (token, head) — or per (token, head, channel group) — and
is read back by dequantizing; int8 keys can instead be read by an integer QKᵀ (`int8_scores`).

int4 caches store keys and values rotated by an orthogonal Hadamard matrix ``R`` along
head_dim (`lowbit.ops.hadamard_transform`, any even head_dim): a few outlier channels would
otherwise set every token's scale, and 15 levels leave the other channels almost nothing.
The rotation spreads them out. It costs nothing in the cache: ``q · k = (q R) · (k R)`` since
``R`` is orthogonal, so the attention rotates the new queries (`rotate`) and turns the output
back (``out Rᵀ``, `unrotate`), two small transforms per new token and head.

Quantized caches also store keys minus a per-(row, head) offset ``mu``: the mean key of the
first write (the prompt). Keys share a large common component that would otherwise take most
of every token's range; subtracting it changes each query's scores by the same ``q · mu`` for
all keys, which softmax ignores, so attention is unchanged up to rounding.

Rows of a batch may start at different slots (left-padded prompts): ``start[b]`` is row b's
first real slot. A token's rotary position is its slot minus its row's start, and attention
never looks at slots before a row's start.

Shapes (``T`` = max_len, ``H`` = n_kv_heads, ``D`` = head_dim, ``G`` = scale groups per head):
  float codes ``[batch, H, T, D]`` in the cache dtype (the model's, or float16 / bfloat16
  where the config says); int8 ``[batch, H, T, D]`` int8; fp8
  ``[batch, H, T, D]`` uint8 holding float8_e4m3fn bits (XLA:CPU updates a uint8 buffer in
  place, but rewrites a whole float8 one for every written slot); int4 ``[batch, H, T, D / 2]``
  uint8 (channel ``d`` in the low nibble, channel ``d + D / 2`` in the high one); scales
  ``[batch, H, T, G]`` float16.
Heads come before slots so that attention's products batch over (batch, head) on the stored
layout: with slots first, XLA transposes every layer's whole cache on every step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.ops import hadamard_matrix, hadamard_transform
from lowbit.recipes import KVCacheConfig, parse_kv_cache

# Largest code magnitude per format: scale = absmax / this.
_QMAX = {"int8": 127.0, "int4": 8.0, "fp8": 448.0}
SCALE_DTYPE = jnp.float16
# The smallest scale stored: a zero (or underflowing) row still gets a finite, positive scale.
_MIN_SCALE = float(np.finfo(np.float16).tiny)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of the tokens seen so far, one entry per layer.

    Attributes:
      keys: per layer, the key codes (float keys for a float cache; rotary already applied).
      values: per layer, the value codes.
      key_scales: per layer, ``[batch, n_kv_heads, max_len, groups]``; empty for floats.
      value_scales: likewise for values.
      key_offsets: per layer, ``[batch, n_kv_heads, 1, head_dim]`` float32, subtracted from
        keys before quantization; empty for float.
      length: ``int32 []``, how many leading slots hold tokens; new tokens go there.
      start: ``int32 [batch]``, each row's first real slot (0 unless left-padded).
      config: the `KVCacheConfig` (static), or None for a float cache of the model's dtype.
      rows: ``int32 [b]``, or None: the rows the next tokens go to (distinct), when they are
        fewer than the cache's rows (one decoded token each, or a few: the others are not
        run and their slots stay as they were). The write and the attention index those rows in
        place, without copying them out (what a server's decode over its busy rows runs).
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    key_scales: tuple[jax.Array, ...]
    value_scales: tuple[jax.Array, ...]
    key_offsets: tuple[jax.Array, ...]
    length: jax.Array
    start: jax.Array
    config: KVCacheConfig | None = dataclasses.field(default=None, metadata=dict(static=True))
    rows: jax.Array | None = None

    @property
    def max_len(self) -> int:
        """Number of token slots."""
        return self.keys[0].shape[2]

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    def nbytes(self) -> int:
        """Bytes of codes and scales (the cache's memory)."""
        arrays = [*self.keys, *self.values, *self.key_scales, *self.value_scales, *self.key_offsets]
        return int(sum(a.size * a.dtype.itemsize for a in arrays))

    @property
    def quantized(self) -> bool:
        """Whether the cache holds codes with scales (not floats of some dtype)."""
        return self.config is not None and not self.config.is_float

    def layer(self, i: int) -> LayerKV:
        """Layer `i`'s slice of the cache (a float16 / bfloat16 one reads and writes as a
        float cache of that dtype: its LayerKV has no config)."""
        if not self.quantized:
            return LayerKV(
                self.keys[i], self.values[i], None, None, None, self.start, None, self.rows
            )
        return LayerKV(
            self.keys[i],
            self.values[i],
            self.key_scales[i],
            self.value_scales[i],
            self.key_offsets[i],
            self.start,
            self.config,
            self.rows,
        )


@dataclasses.dataclass(frozen=True)
class LayerKV:
    """One layer's cache arrays (see `KVCache`), as the attention reads and writes them."""

    keys: jax.Array
    values: jax.Array
    key_scales: jax.Array | None
    value_scales: jax.Array | None
    key_offsets: jax.Array | None
    start: jax.Array
    config: KVCacheConfig | None
    rows: jax.Array | None = None  # see `KVCache.rows`

    def write(self, k: jax.Array, v: jax.Array, slot: jax.Array) -> LayerKV:
        """Stores ``k, v [batch, seq, H, D]`` at slots ``slot .. slot + seq - 1`` (of rows
        `rows` when set: ``batch`` of them)."""
        zero = jnp.zeros((), jnp.int32)
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)

        def put(dst, x):
            if dst.dtype == jnp.float16:  # beyond float16's range: its largest value, not inf
                big = float(jnp.finfo(jnp.float16).max)
                x = jnp.clip(x, -big, big)
            return _put_rows(dst, x.astype(dst.dtype), self.rows, (zero, slot, zero))

        if self.config is None:
            return dataclasses.replace(self, keys=put(self.keys, k), values=put(self.values, v))
        k, v = self.rotate(k), self.rotate(v)
        # The first write (slot 0: the prompt) sets the key offset: the mean of its real tokens.
        start, current = self.start, self.key_offsets
        if self.rows is not None:  # small arrays: a gather (`take_rows` unrolls a row each)
            start, current = start[self.rows], current[self.rows]
        real = (slot + jnp.arange(k.shape[2]))[None, :] >= start[:, None]  # [b, seq]
        real = real[:, None, :, None].astype(jnp.float32)
        mean = jnp.sum(k.astype(jnp.float32) * real, axis=2, keepdims=True) / jnp.maximum(
            jnp.sum(real, axis=2, keepdims=True), 1.0
        )
        offsets = jnp.where(slot == 0, mean, current)
        k = k.astype(jnp.float32) - offsets
        if self.rows is not None:
            zero = jnp.zeros((), jnp.int32)
            offsets = _put_rows(self.key_offsets, offsets, self.rows, (zero, zero, zero))
        kc, ks = quantize_kv(k, self.config)
        vc, vs = quantize_kv(v, self.config)
        return dataclasses.replace(
            self,
            keys=put(self.keys, kc),
            values=put(self.values, vc),
            key_scales=put(self.key_scales, ks),
            value_scales=put(self.value_scales, vs),
            key_offsets=offsets,
        )

    @property
    def rotated(self) -> bool:
        """Whether keys and values are stored Hadamard-rotated (see module docstring)."""
        return is_rotated(self.config, self.keys.shape[-1] * (2 if _packs(self.config) else 1))

    def rotate(self, x: jax.Array) -> jax.Array:
        """``x [..., D]`` times the rotation ``R`` when the cache is rotated, else `x`."""
        return hadamard_transform(x) if self.rotated else x

    def unrotate(self, x: jax.Array) -> jax.Array:
        """``x [..., D]`` times ``Rᵀ`` (back from the rotated basis) when the cache is
        rotated, else `x`."""
        return hadamard_transform(x, inverse=True) if self.rotated else x

    def slots(self, first: jax.Array, size: int) -> LayerKV:
        """Slots ``first .. first + size - 1`` (``first`` traced, ``size`` static) as a layer
        cache of ``size`` slots (what attention over part of the cache reads); only rows
        `rows` when set."""

        def take(a):
            a = jax.lax.dynamic_slice_in_dim(a, first, size, axis=2)
            return a if self.rows is None else take_rows(a, self.rows)

        if self.config is None:
            return dataclasses.replace(self, keys=take(self.keys), values=take(self.values))
        return dataclasses.replace(
            self,
            keys=take(self.keys),
            values=take(self.values),
            key_scales=take(self.key_scales),
            value_scales=take(self.value_scales),
        )

    def read_keys(self, dtype: Any) -> jax.Array:
        """``[batch, H, T, D]`` keys in `dtype` (every row: not for a cache with `rows`)."""
        if self.config is None:
            return self.keys.astype(dtype)
        return dequantize_kv(self.keys, self.key_scales, self.config, dtype)

    def read_values(self, dtype: Any) -> jax.Array:
        """``[batch, H, T, D]`` values in `dtype`."""
        if self.config is None:
            return self.values.astype(dtype)
        return dequantize_kv(self.values, self.value_scales, self.config, dtype)


def take_rows(a: jax.Array, rows: jax.Array) -> jax.Array:
    """``a[rows]`` along the first axis, a row at a time (XLA:CPU runs a gather element by
    element, a slice as one copy)."""
    parts = [jax.lax.dynamic_index_in_dim(a, rows[i], 0) for i in range(rows.shape[0])]
    return jnp.concatenate(parts, axis=0)


def _put_rows(
    dst: jax.Array, x: jax.Array, rows: jax.Array | None, corner: tuple[jax.Array, ...]
) -> jax.Array:
    """`dst` with ``x`` written at `corner` (the indices past the first axis): row ``i`` of
    `x` into row ``rows[i]`` (rows distinct), or `x` at row 0 without `rows`.

    The rows are one scatter of ``x``'s windows, in place (no copy of `dst` in the compiled
    program). As one update a row, the server's 16-row decode of SmolLM2 held 960 of them and
    compiled in 11-13 s against 5-6 s as a scatter, at the same step time (`python -m
    benchmarks decode_rows`, 2 Zen 4 cores). A window that would pass the end of `dst` is
    dropped, not moved back to fit."""
    if rows is None:
        return jax.lax.dynamic_update_slice(dst, x, (jnp.zeros((), jnp.int32), *corner))
    corner = tuple(jnp.broadcast_to(jnp.asarray(c, jnp.int32), rows.shape) for c in corner)
    index = jnp.stack([rows.astype(jnp.int32), *corner], axis=1)  # [b, dst.ndim]
    numbers = jax.lax.ScatterDimensionNumbers(
        update_window_dims=tuple(range(1, x.ndim)),
        inserted_window_dims=(0,),
        scatter_dims_to_operand_dims=tuple(range(dst.ndim)),
    )
    # Row i of x is the window written at index[i] (its row axis is the scatter's batch).
    return jax.lax.scatter(
        dst,
        index,
        x,
        numbers,
        indices_are_sorted=False,
        unique_indices=True,
        mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
    )


def init_kv_cache(
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    batch: int,
    max_len: int,
    dtype: Any,
    kv_cache: KVCacheConfig | str | None = None,
) -> KVCache:
    """An empty cache for `batch` sequences of up to `max_len` tokens.

    Raises:
      ValueError: for a non-positive size, an unknown `kv_cache` format, or a head_dim the
        format cannot store.
    """
    if batch < 1 or max_len < 1:
        raise ValueError(f"batch={batch} and max_len={max_len} must both be positive")
    config = parse_kv_cache(kv_cache)
    shape = (batch, n_kv_heads, max_len, head_dim)
    quantized = config is not None and not config.is_float
    # Separate buffers for every layer, keys and values: the decode loop donates them.
    if not quantized:
        code_dtype = dtype if config is None else jnp.dtype(config.format)
        code_shape, scale_shape = shape, None
    else:
        config.check_head_dim(head_dim)
        code_shape, code_dtype = _code_layout(shape, config)
        scale_shape = (*shape[:3], head_dim // (config.group_size or head_dim))

    filled = [(code_shape, jnp.dtype(code_dtype), 0)] * (2 * n_layers)
    if scale_shape is not None:
        filled += [(scale_shape, jnp.dtype(SCALE_DTYPE), 1)] * (2 * n_layers)
    if quantized:
        filled += [((batch, n_kv_heads, 1, head_dim), jnp.dtype(jnp.float32), 0)] * n_layers
    filled += [((), jnp.dtype(jnp.int32), 0), ((batch,), jnp.dtype(jnp.int32), 0)]
    arrays = _filled(tuple(filled))
    n = n_layers
    scales = arrays[2 * n : 4 * n] if scale_shape is not None else ()
    return KVCache(
        keys=arrays[:n],
        values=arrays[n : 2 * n],
        key_scales=scales[:n],
        value_scales=scales[n:],
        key_offsets=arrays[len(arrays) - 2 - n : -2] if quantized else (),
        length=arrays[-2],
        start=arrays[-1],
        config=config,
    )


@functools.partial(jax.jit, static_argnums=0)
def _filled(specs: tuple[tuple[tuple[int, ...], Any, int], ...]) -> tuple[jax.Array, ...]:
    """Arrays of (shape, dtype, fill value) `specs`, one program for a cache's buffers (each
    its own: the decode loop donates them). As eager ops, SmolLM2's 124 took 12 ms, more than
    a 128-token prefill's tenth."""
    return tuple(jnp.full(shape, fill, dtype) for shape, dtype, fill in specs)


def _packs(config: KVCacheConfig | None) -> bool:
    return config is not None and config.format == "int4"


def is_rotated(config: KVCacheConfig | None, head_dim: int) -> bool:
    """int4 caches of even head_dim store Hadamard-rotated keys and values."""
    return _packs(config) and head_dim >= 2 and head_dim % 2 == 0


def hadamard(n: int) -> np.ndarray:
    """The ``[n, n]`` orthogonal rotation of the cache (`lowbit.ops.hadamard_matrix`): for a
    power of two the normalized Sylvester matrix, symmetric and its own inverse."""
    return hadamard_matrix(n)


def _code_layout(shape: tuple[int, ...], config: KVCacheConfig) -> tuple[tuple[int, ...], Any]:
    if config.format == "int4":
        return (*shape[:-1], shape[-1] // 2), jnp.uint8
    if config.format == "fp8":
        return shape, jnp.uint8
    return shape, jnp.int8


def _grouped(x: jax.Array, config: KVCacheConfig) -> jax.Array:
    """``[..., D]`` -> ``[..., G, D / G]``."""
    d = x.shape[-1]
    group = config.group_size or d
    return x.reshape(*x.shape[:-1], d // group, group)


def quantize_kv(x: jax.Array, config: KVCacheConfig) -> tuple[jax.Array, jax.Array]:
    """Codes and scales of ``x [..., D]`` float (see module docstring for the layouts).

    Symmetric absmax per group: ``x ≈ code * scale``. NaN/Inf-free scales: a zero group gets the
    smallest float16 scale (its codes are 0).
    """
    qmax = _QMAX[config.format]
    g = _grouped(x.astype(jnp.float32), config)
    amax = jnp.max(jnp.abs(g), axis=-1, keepdims=True)
    scale = jnp.maximum(amax / qmax, _MIN_SCALE).astype(SCALE_DTYPE)
    # Divide by the scale as stored so that decode sees exactly the scale used to encode.
    y = g / scale.astype(jnp.float32)
    if config.format == "fp8":
        codes = jnp.clip(y, -qmax, qmax).astype(jnp.float8_e4m3fn).reshape(x.shape)
        return jax.lax.bitcast_convert_type(codes, jnp.uint8), scale[..., 0]
    if config.format == "int4":
        # 16 levels, none wasted: code c in [-8, 7] stands for (c + 1/2) * scale.
        codes = jnp.clip(jnp.floor(y), -8, 7).astype(jnp.int8).reshape(x.shape)
    else:
        codes = jnp.clip(jnp.round(y), -qmax, qmax).astype(jnp.int8).reshape(x.shape)
    if config.format == "int4":
        half = x.shape[-1] // 2
        lo = codes[..., :half].astype(jnp.uint8) & 0xF
        hi = codes[..., half:].astype(jnp.uint8) << 4
        codes = lo | hi
    return codes, scale[..., 0]


def unpack_int4(packed: jax.Array) -> jax.Array:
    """``[..., D / 2]`` uint8 -> ``[..., D]`` int8 in [-8, 7] (low nibbles first)."""
    signed = packed.astype(jnp.int8)
    lo = jnp.left_shift(signed, 4) >> 4
    hi = signed >> 4
    return jnp.concatenate([lo, hi], axis=-1)


def dequantize_kv(codes: jax.Array, scales: jax.Array, config: KVCacheConfig, dtype: Any):
    """``[..., D]`` values in `dtype` from codes and ``[..., G]`` scales."""
    if config.format == "int4":
        g = _grouped(unpack_int4(codes).astype(jnp.float32) + 0.5, config)
        out = g * scales.astype(jnp.float32)[..., None]
        return out.reshape(*codes.shape[:-1], -1).astype(dtype)
    if config.format == "fp8":
        codes = fp8_codes(codes)
    g = _grouped(codes.astype(jnp.float32), config)
    out = g * scales.astype(jnp.float32)[..., None]
    return out.reshape(codes.shape).astype(dtype)


def fp8_codes(stored: jax.Array) -> jax.Array:
    """An fp8 cache's uint8 storage as float8_e4m3fn codes (a bitcast, no copy)."""
    return jax.lax.bitcast_convert_type(stored, jnp.float8_e4m3fn)


def int8_scores(q: jax.Array, layer: LayerKV) -> jax.Array:
    """Attention logits ``q · k`` from int8 key codes with an int8 x int8 -> int32 product.

    Args:
      q: ``[batch, seq, H, group, D]`` float queries (grouped-query layout).
      layer: an int8 layer cache.
    Returns:
      ``[batch, H, group, seq, T]`` float32 (not yet divided by sqrt(D)).
    """
    config = layer.config
    qg = _grouped(q.astype(jnp.float32), config)  # [b, s, H, g, G, D/G]
    q_scale = jnp.maximum(jnp.max(jnp.abs(qg), axis=-1, keepdims=True) / 127.0, 1e-30)
    q_codes = jnp.round(qg / q_scale).astype(jnp.int8)
    k_codes = _grouped(layer.keys, config)  # [b, H, T, G, D/G]
    dots = jnp.einsum(
        "bskgnd,bktnd->bkgstn", q_codes, k_codes, preferred_element_type=jnp.int32
    ).astype(jnp.float32)
    q_scale = jnp.moveaxis(q_scale[..., 0], 1, 3)  # [b, H, g, s, G]
    k_scale = layer.key_scales.astype(jnp.float32)[:, :, None, None]  # [b, H, 1, 1, T, G]
    return jnp.sum(dots * q_scale[:, :, :, :, None, :] * k_scale, axis=-1)
