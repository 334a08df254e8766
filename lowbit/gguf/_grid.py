"""Each GGML block type's grid with its parameters given: initial parameters from llama.cpp's
quantizer, the codes of float values on that grid, and the blocks that store them.

A block type's values are ``x = step * g + offset``: per sub-block a ``step`` and an ``offset``
built from the stored parameters, and per element ``g``, the grid value of its code (``q - 8``
for Q4_0, ``K[q]`` for IQ4_NL). `Grid` names, per type, the parameters (float32 arrays, the
stored fields as floats: ``d`` / ``dmin`` / ``m`` per block ``[..., nb]``, sub-block levels
``scale`` / ``min`` ``[..., nb, n_sub]``), how they give ``step`` and ``offset``, how values pick
their codes, and how codes and parameters pack into blocks. Packing rounds ``d`` / ``dmin`` /
``m`` to float16 and the levels to their integer range: nothing else is rounded, so a
parameter set packs to exactly one block.

`initial_params` gives the parameters of llama.cpp's own quantizer (`lowbit.gguf.encode`), so
``decode(encode_with(x, initial_params(x)))`` is ``decode(encode(x))``. The 32-element types
keep the quantizer's float32 scale, with which it picks the codes (it stores it as float16).
The K-quants take theirs from the quantizer's blocks, whose codes are the nearest ones to the
stored step and offset; those blocks come from `lowbit.gguf.encode` itself (not traced), as
its re-fits are decided per chunk of blocks, so only its own chunking gives its blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.gguf import _search as search
from lowbit.gguf._bits import (
    IQ4_NL_VALUES,
    f16,
    f16_bytes,
    k_scales_pack,
    k_scales_unpack,
    nearest,
    pack_2bit_128,
    pack_nibbles_32,
    pack_nibbles_64,
    pack_q3_k,
    q3_scales_unpack,
    roundf,
    safe_div,
    signed_absmax,
    u8,
)
from lowbit.gguf._kquants import (
    q5_k_high_bytes,
    q6_k_code_bytes,
)
from lowbit.gguf._legacy import q5_high_bytes
from lowbit.gguf._types import encode

GridParams = dict[str, jax.Array]
Round = Callable[[jax.Array], jax.Array]


_F16_MAX = float(np.finfo(np.float16).max)


def round_fp16(x: jax.Array) -> jax.Array:
    """float32 -> the nearest float16 value, as float32 (what a block stores); values past
    float16's range saturate to its largest finite one, as a stored field must stay finite."""
    return jnp.clip(x, -_F16_MAX, _F16_MAX).astype(jnp.float16).astype(jnp.float32)


def _f16_field(x: jax.Array) -> jax.Array:
    """float32 [...] -> uint8 [..., 2]: the float16 field `fp16` gives."""
    return f16_bytes(round_fp16(x))


def round_level(x: jax.Array) -> jax.Array:
    """Float levels -> the nearest integers (half to even, llama.cpp's `nearest_int`)."""
    return jnp.round(x)


@dataclasses.dataclass(frozen=True)
class Grid:
    """One GGML block type's grid, its parameters given (see the module docstring).

    Attributes:
      name: the GGML type name, e.g. ``"Q4_K"``.
      block_size: elements per block (32 or 256).
      sub_size: elements sharing one step and offset.
      values: the grid value ``g`` of each code, ascending.
      init: the 32-element types' values ``[..., nb, 32]`` -> llama.cpp's parameters for
        them (traced); the K-quants' llama.cpp blocks ``[..., nb, type_size]`` -> their
        parameters.
      per_block: the parameters of shape ``[..., nb]``; the others (the K-quants' levels)
        are ``[..., nb, block_size / sub_size]``.
      affine: (params, to_fp16, to_level) -> ``(step, offset)`` ``[..., nb, n_sub]``, with
        `to_fp16` applied to the float16 fields and `to_level` to the integer levels (each
        level already clipped to its range): `fp16` / `level` for the stored values, their
        straight-through versions for training.
      codes: (values ``[..., nb, block_size]``, params) -> code indices into `values`, int32.
      pack: (codes, params) -> blocks ``uint8 [..., nb, type_size]``.
    """

    name: str
    block_size: int
    sub_size: int
    values: tuple[float, ...]
    per_block: tuple[str, ...]
    init: Callable[[jax.Array], GridParams] = dataclasses.field(repr=False)
    affine: Callable[[GridParams, Round, Round], tuple[jax.Array, jax.Array]] = dataclasses.field(
        repr=False
    )
    codes: Callable[[jax.Array, GridParams], jax.Array] = dataclasses.field(repr=False)
    pack: Callable[[jax.Array, GridParams], jax.Array] = dataclasses.field(repr=False)

    def stored(self, params: GridParams) -> tuple[jax.Array, jax.Array]:
        """(step, offset) ``[..., nb, n_sub]`` as the blocks store them."""
        return self.affine(params, round_fp16, round_level)

    @property
    def from_blocks(self) -> bool:
        """Whether `init` takes llama.cpp's blocks (the K-quants) rather than values."""
        return self.block_size != 32

    def param_shapes(self, blocks_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """Each parameter's shape for values of shape ``[..., nb, block_size]``."""
        lead = tuple(blocks_shape[:-1])
        n_sub = self.block_size // self.sub_size
        names = ("d", "dmin", "m", "scale", "min")
        keys = [k for k in names if k in self.per_block or k in self.levels]
        return {k: lead if k in self.per_block else (*lead, n_sub) for k in keys}

    @property
    def levels(self) -> tuple[str, ...]:
        """The integer sub-block levels among the parameters (the K-quants')."""
        if not self.from_blocks:
            return ()
        return ("scale", "min") if "dmin" in self.per_block else ("scale",)

    def encode_with(self, x: jax.Array, params: GridParams) -> jax.Array:
        """Values ``[..., nb, block_size]`` -> blocks on the grid `params` give."""
        return self.pack(self.codes(x, params), params)


def _subs(x: jax.Array, sub: int) -> jax.Array:
    return x.reshape(*x.shape[:-1], x.shape[-1] // sub, sub)


# --- the 32-element types: one float16 scale (Q4_1: and minimum) per block ------------------


def _scale_only(params, to_fp16, to_level):
    d = to_fp16(params["d"])[..., None]
    return d, jnp.zeros_like(d)


def _inverse(params):
    # The quantizers multiply by 1 / d (float32, before d is stored as float16).
    return safe_div(1.0, params["d"])[..., None]


def _legacy(name, values, init, codes, pack, affine=_scale_only, per_block=("d",)):
    values = tuple(float(v) for v in values)
    return Grid(name, 32, 32, values, per_block, init, affine, codes, pack)


def _q8_0_codes(x, p):
    return jnp.clip(roundf(x * _inverse(p)), -128, 127).astype(jnp.int32) + 128


def _q8_0_pack(c, p):
    q = jax.lax.bitcast_convert_type((c - 128).astype(jnp.int8), jnp.uint8)
    return jnp.concatenate([_f16_field(p["d"]), q], -1)


def _offset_codes(bias, top):
    """Q4_0 / Q5_0: the quantizers' ``min(top, (int8)(x / d + bias))`` (x / d + bias >= 0)."""
    return lambda x, p: jnp.clip(jnp.floor(x * _inverse(p) + bias), 0, top).astype(jnp.int32)


def _q4_0_pack(c, p):
    return jnp.concatenate([_f16_field(p["d"]), pack_nibbles_32(c)], -1)


def _q5_0_pack(c, p):
    return jnp.concatenate([_f16_field(p["d"]), q5_high_bytes(c), pack_nibbles_32(c & 15)], -1)


def _q4_1_init(x):
    lo, hi = x.min(-1), x.max(-1)
    return {"d": (hi - lo) / 15, "m": lo}


def _q4_1_affine(params, to_fp16, to_level):
    return to_fp16(params["d"])[..., None], to_fp16(params["m"])[..., None]


def _q4_1_codes(x, p):
    x0 = (x - p["m"][..., None]) * _inverse(p)
    return jnp.clip(jnp.floor(x0 + 0.5), 0, 15).astype(jnp.int32)


def _q4_1_pack(c, p):
    return jnp.concatenate([_f16_field(p["d"]), _f16_field(p["m"]), pack_nibbles_32(c)], -1)


def _iq4_nl_codes(x, p):
    return search.best_index_iq4(x * _inverse(p)).astype(jnp.int32)


# --- the K-quants: float16 super-scales, integer sub-block levels ----------------------------


def _k_affine(top, low=0, with_min=True):
    def affine(params, to_fp16, to_level):
        step = to_fp16(params["d"])[..., None] * to_level(jnp.clip(params["scale"], low, top))
        if not with_min:
            return step, jnp.zeros_like(step)
        offset = -to_fp16(params["dmin"])[..., None] * to_level(jnp.clip(params["min"], 0, top))
        return step, offset

    return affine


def _k_codes(sub, low, high, affine):
    """Nearest codes to the stored step and offset, as the K-quant quantizers pick them
    (``nearest((x + ml) / dl)``); 0 where the step is 0 (any code decodes to the offset)."""

    def codes(x, p):
        step, offset = affine(p, round_fp16, round_level)
        xs = _subs(x, sub)
        safe = jnp.where(step == 0, 1, step)[..., None]
        q = jnp.clip(nearest((xs - offset[..., None]) / safe), low, high)
        q = jnp.where((step == 0)[..., None], low, q) - low
        return q.reshape(x.shape).astype(jnp.int32)

    return codes


def _stored_levels(p, key, low, top):
    return jnp.clip(round_level(p[key]), low, top).astype(jnp.int32)


def _q2_k_init(b):
    sc = b[..., 0:16]
    return {
        "d": f16(b[..., 80:82]),
        "dmin": f16(b[..., 82:84]),
        "scale": (sc & 15).astype(jnp.float32),
        "min": (sc >> 4).astype(jnp.float32),
    }


def _q2_k_pack(c, p):
    ls, lm = _stored_levels(p, "scale", 0, 15), _stored_levels(p, "min", 0, 15)
    parts = [u8(ls | (lm << 4)), pack_2bit_128(c), _f16_field(p["d"]), _f16_field(p["dmin"])]
    return jnp.concatenate(parts, -1)


def _q3_k_init(b):
    sc = q3_scales_unpack(b[..., 96:108]).astype(jnp.float32) - 32
    return {"d": f16(b[..., 108:110]), "scale": sc}


def _q3_k_pack(c, p):
    l6 = _stored_levels(p, "scale", -32, 31) + 32
    return pack_q3_k(_f16_field(p["d"]), l6, _subs(c, 16))


def _k_min_init():
    def init(b):
        sc, mn = k_scales_unpack(b[..., 4:16])
        return {
            "d": f16(b[..., 0:2]),
            "dmin": f16(b[..., 2:4]),
            "scale": sc.astype(jnp.float32),
            "min": mn.astype(jnp.float32),
        }

    return init


def _k_min_header(p):
    ls, lm = _stored_levels(p, "scale", 0, 63), _stored_levels(p, "min", 0, 63)
    return [_f16_field(p["d"]), _f16_field(p["dmin"]), k_scales_pack(ls, lm)]


def _q4_k_pack(c, p):
    return jnp.concatenate([*_k_min_header(p), pack_nibbles_64(c)], -1)


def _q5_k_pack(c, p):
    return jnp.concatenate([*_k_min_header(p), q5_k_high_bytes(c), pack_nibbles_64(c & 15)], -1)


def _q6_k_init(b):
    sc = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
    return {"d": f16(b[..., 208:210]), "scale": sc}


def _q6_k_pack(c, p):
    sc = _stored_levels(p, "scale", -128, 127).astype(jnp.int8)
    sc8 = jax.lax.bitcast_convert_type(sc, jnp.uint8)
    return jnp.concatenate([q6_k_code_bytes(c), sc8, _f16_field(p["d"])], -1)


def _k_grid(name, sub, low, high, init, pack, affine, per_block=("d", "dmin")):
    values = tuple(float(v) for v in range(low, high + 1))
    codes = _k_codes(sub, low, high, affine)
    return Grid(name, 256, sub, values, per_block, init, affine, codes, pack)


_Q2_K = _k_affine(15)
_Q3_K = _k_affine(31, -32, with_min=False)
_Q4_K = _k_affine(63)
_Q6_K = _k_affine(127, -128, with_min=False)

GRIDS: types.MappingProxyType[str, Grid] = types.MappingProxyType(
    {
        g.name: g
        for g in (
            _legacy(
                "Q8_0",
                range(-128, 128),
                lambda x: {"d": signed_absmax(x)[0] / 127},
                _q8_0_codes,
                _q8_0_pack,
            ),
            _legacy(
                "Q4_0",
                range(-8, 8),
                lambda x: {"d": signed_absmax(x)[1] / -8},
                _offset_codes(8.5, 15),
                _q4_0_pack,
            ),
            _legacy(
                "Q4_1",
                range(16),
                _q4_1_init,
                _q4_1_codes,
                _q4_1_pack,
                _q4_1_affine,
                ("d", "m"),
            ),
            _legacy(
                "Q5_0",
                range(-16, 16),
                lambda x: {"d": signed_absmax(x)[1] / -16},
                _offset_codes(16.5, 31),
                _q5_0_pack,
            ),
            _legacy(
                "IQ4_NL",
                IQ4_NL_VALUES,
                lambda x: {"d": search.iq4_scale(x)},
                _iq4_nl_codes,
                _q4_0_pack,
            ),
            _k_grid("Q2_K", 16, 0, 3, _q2_k_init, _q2_k_pack, _Q2_K),
            _k_grid("Q3_K", 16, -4, 3, _q3_k_init, _q3_k_pack, _Q3_K, ("d",)),
            _k_grid("Q4_K", 32, 0, 15, _k_min_init(), _q4_k_pack, _Q4_K),
            _k_grid("Q5_K", 32, 0, 31, _k_min_init(), _q5_k_pack, _Q4_K),
            _k_grid("Q6_K", 16, -32, 31, _q6_k_init, _q6_k_pack, _Q6_K, ("d",)),
        )
    }
)
"""GGML type name -> `Grid`: the types whose grid can be trained on (`lowbit.qarray`)."""


def grid_of(name: str) -> Grid:
    """The `Grid` of GGML type `name`; ValueError listing the types that have one."""
    found = GRIDS.get(name)
    if found is None:
        raise ValueError(
            f"GGUF block type {name!r} has no trainable grid; accepted: {', '.join(GRIDS)}"
        )
    return found


@functools.partial(jax.jit, static_argnums=0)
def _traced_init(name: str, x: jax.Array) -> GridParams:
    return grid_of(name).init(x)


def grid_initial_params(name: str, x: jax.Array | np.ndarray) -> GridParams:
    """llama.cpp's parameters for values `x` ``[..., nb, block_size]`` on `name`'s grid.

    Not traced (the K-quants run `lowbit.gguf.encode`, see the module docstring): call it on
    concrete values, outside `jit`.

    Raises:
      ValueError: for a type without a grid, or values `lowbit.gguf.encode` refuses (NaN,
        Inf, beyond the type's float16 range).
    """
    g = grid_of(name)
    if not g.from_blocks:
        x = np.asarray(x, np.float32)
        if not np.isfinite(x).all():
            raise ValueError(f"{name}: cannot quantize NaN or Inf values")
        return _traced_init(name, jnp.asarray(x))
    blocks = encode(name, np.asarray(x, np.float32).reshape(*np.shape(x)[:-2], -1))
    return g.init(jnp.asarray(blocks.reshape(*np.shape(x)[:-1], -1)))
