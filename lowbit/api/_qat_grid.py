"""QAT on a GGUF block format's exact grid, with the blocks' scales and minimums learned.

A rule whose weight format is a GGUF block format with a trainable grid (``q5_0``,
``iq4_nl``, ``q2_k``, ``q3_k``, ``q4_k``, ``q5_k``, ``q6_k``; `lowbit.gguf._grid.GRIDS`), or
one of the element formats GGML's 32-blocks are held as (``int8`` / ``int4`` symmetric and
``uint4`` with a zero point, groups of 32, float16 scales: Q8_0 / Q4_0 / Q4_1, what
`lowbit.recipes` candidates ``q8_0`` / ``q4_0`` / ``q4_1`` give), can train its blocks'
parameters as well as the weight: `grid_init` gives, per such weight,
llama.cpp's parameters (``d`` / ``dmin`` per block, the K-quants' sub-block levels), a plain
pytree the optimizer trains beside the params. Inside the loss each such weight becomes a
`QatWeight` whose `qarray` holds the blocks those parameters and the weight pack to
(`gguf_pack`), and whose `value` is `gguf_fake_quant` of the weight: the forward pass runs the
served op on the blocks, and the backward pass sends the straight-through gradient through
`gguf_fake_quant` to the weight and (LSQ) to the parameters. `grid_qarray` gives the same
blocks for `convert`, so the served QArray is the trained grid, byte for byte, and an export
writes those bytes as they are. For Q8_0 / Q4_0 / Q4_1 the QArray holds the blocks' codes and
float16 ``d`` as its element codes and scales (Q4_1's minimum as the zero point ``-m / d``,
as an import holds it), which export as those blocks again.

Parameters are laid out as `gguf_fake_quant` takes them: for a weight whose blocks run along
axis ``a`` (the QArray's `packed_axis`), that axis moved last and cut into blocks, e.g. a
``[512, 8]`` kernel with blocks along axis 0 has ``d`` ``[8, 2]`` for Q4_K.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from lowbit.formats import GGUF_ELEMENT_FORMATS, GGUFBlockFormat, get_format
from lowbit.gguf import GRIDS, grid_of
from lowbit.ops import QatWeight
from lowbit.qarray import (
    PerGroup,
    QArray,
    QuantConfig,
    gguf_fake_quant,
    gguf_grid_init,
    gguf_pack,
    quantize,
)
from lowbit.recipes import Recipe, Rule, param_leaves

GridParams = dict[str, jax.Array]


def grid_type(config: QuantConfig) -> str | None:
    """The GGML type whose grid a weight config trains on, or None (not a GGUF block format
    with a trainable grid)."""
    fmt = get_format(config.format)
    if isinstance(fmt, GGUFBlockFormat):
        return fmt.ggml_type if fmt.ggml_type in GRIDS else None
    g = config.granularity
    if not (isinstance(g, PerGroup) and g.size == 32):
        return None
    if jnp.dtype(config.scale_dtype) != jnp.float16:
        return None  # GGML stores float16 scales; float32 ones are another format
    for ggml_type, name in GGUF_ELEMENT_FORMATS.items():
        if fmt.name == name and config.symmetric == (ggml_type != "Q4_1"):
            return ggml_type
    return None


def _block_axis(leaf: jax.Array, config: QuantConfig, layout: QArray) -> int:
    """The axis a weight's GGML blocks run along."""
    if isinstance(get_format(config.format), GGUFBlockFormat):
        return layout.packed_axis
    return config.granularity.axis % jnp.ndim(leaf)


def _layout(leaf: jax.Array, config: QuantConfig) -> QArray:
    """The QArray `quantize` makes of `leaf` (abstract: only its structure and block axis)."""
    return jax.eval_shape(
        lambda x: quantize(x, config), jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    )


def grid_params(leaf: jax.Array, config: QuantConfig) -> GridParams:
    """llama.cpp's grid parameters for one weight (concrete; see the module docstring)."""
    ggml_type = grid_type(config)
    if ggml_type is None:
        raise ValueError(
            f"format {config.format!r} has no trainable GGUF grid; use one of "
            f"{', '.join(t.lower() for t in GRIDS if t.lower() != 'q8_0')}"
        )
    axis = _block_axis(leaf, config, _layout(leaf, config))
    return gguf_grid_init(jnp.moveaxis(jnp.asarray(leaf, jnp.float32), axis, -1), ggml_type)


def grid_qarray(leaf: jax.Array, params: GridParams, config: QuantConfig, rule: Rule) -> QArray:
    """The QArray of `leaf`'s blocks on the grid `params` give (traceable).

    Returns:
      The QArray `quantize(leaf, config)` would be, with these blocks as its codes and the
      rule's activation quantizer.
    """
    layout = _layout(leaf, config)
    axis = _block_axis(leaf, config, layout)
    rows = jnp.moveaxis(jnp.asarray(leaf, jnp.float32), axis, -1)
    if not isinstance(get_format(config.format), GGUFBlockFormat):
        return _element_qarray(rows, params, config, rule, layout, axis)
    codes = jnp.moveaxis(gguf_pack(rows, params, grid_type(config)), -1, axis)
    return QArray(
        codes=codes,
        scale=jnp.ones(layout.scale.shape, layout.scale.dtype),
        zero_point=None,
        tensor_scale=None,
        format=layout.format,
        shape=layout.shape,
        dtype=layout.dtype,
        packed_axis=axis,
        activation=rule.activation,
    )


def _element_qarray(
    rows: jax.Array, params: GridParams, config: QuantConfig, rule: Rule, layout: QArray, axis: int
) -> QArray:
    """Q8_0 / Q4_0 / Q4_1 blocks as the element-format QArray `quantize` would make (codes,
    float16 scales, Q4_1's zero point), from `rows` ``[..., n]`` (block axis last)."""
    ggml_type = grid_type(config)
    g = grid_of(ggml_type)
    blocks = rows.reshape(*rows.shape[:-1], -1, g.block_size)
    sg = jax.lax.stop_gradient
    params = jax.tree.map(sg, params)
    values = jnp.asarray(g.values, jnp.float32)[g.codes(sg(blocks), params)]  # [..., nb, 32]
    step, offset = g.stored(params)  # [..., nb, 1]: float16 d (and m) as float32
    d = step[..., 0]
    zero_point = None
    if ggml_type == "Q4_1":
        m = offset[..., 0]
        flat = d == 0
        # x = d q + m = d (q - z) with z = -m / d; a constant block (d = 0) is |m| (q - z)
        # with z = -sign(m) and codes 0, as an import holds it.
        zero_point = jnp.where(flat, -jnp.sign(m), -m / jnp.where(flat, 1.0, d))
        d = jnp.where(flat, jnp.where(m == 0, 1.0, jnp.abs(m)), d)
        values = jnp.where(flat[..., None], 0.0, values)
        zero_point = jnp.moveaxis(zero_point, -1, axis).astype(jnp.float32)
    fmt = get_format(config.format)
    codes = values.reshape(rows.shape).astype(jnp.int32)
    codes = (codes & 15).astype(jnp.uint8) if fmt.bits == 4 else codes.astype(jnp.int8)
    codes = jnp.moveaxis(codes, -1, axis)
    if layout.packed_axis is not None:
        codes = fmt.pack(codes, layout.packed_axis)
    return QArray(
        codes=codes,
        scale=jnp.moveaxis(d, -1, axis).astype(layout.scale.dtype),
        zero_point=zero_point,
        tensor_scale=None,
        format=layout.format,
        shape=layout.shape,
        dtype=layout.dtype,
        packed_axis=layout.packed_axis,
        activation=rule.activation,
    )


def grid_qat_weight(
    leaf: jax.Array, params: GridParams, config: QuantConfig, rule: Rule
) -> QatWeight:
    """`leaf` as a `QatWeight` on its grid: forward on the packed blocks, gradients to `leaf`
    (straight-through) and to `params` (LSQ) through `gguf_fake_quant`."""
    qarray = grid_qarray(jax.lax.stop_gradient(leaf), params, config, rule)
    axis = _block_axis(leaf, config, qarray)
    rows = jnp.moveaxis(leaf, axis, -1)
    value = jnp.moveaxis(gguf_fake_quant(rows, params, grid_type(config)), -1, axis)
    return QatWeight(value=value, qarray=qarray, activation=rule.activation, gradient=rule.gradient)


def grid_init(params: Any, recipe: Recipe, decisions: Mapping[str, Any]) -> dict[str, GridParams]:
    """Path -> llama.cpp's grid parameters, for every weight `decisions` quantize to a format
    with a trainable grid."""
    out = {}
    for path, leaf in param_leaves(params):
        decision = decisions.get(path)
        if decision is None or not decision.quantized or grid_type(decision.config) is None:
            continue
        out[path] = grid_params(leaf, decision.config)
    return out
