"""Fake quantization on a GGML block type's exact grid, with learnable scales and minimums.

`gguf_fake_quant(w, params, ggml_type)` is the value a GGUF file of that type stores for `w`
when the blocks' parameters are `params` (`lowbit.gguf._grid`: ``d`` / ``dmin`` / ``m`` per
block, the K-quants' sub-block levels ``scale`` / ``min``): forward, exactly
``decode(pack(codes(w, params), params))`` -- the bytes `gguf_pack` writes decode to it bit for
bit, with no further rounding. Backward:

  * ``w``: straight-through inside the grid's range (the element's continuous code
    ``u = (w - offset) / step`` between the smallest and the largest grid value), zero outside
    (clipped elements get no gradient) and where a sub-block's step is 0;
  * the float16 fields (``d``, ``dmin``, ``m``): LSQ / LSQ+ -- ``x = step g + offset`` with
    the code ``g`` straight-through, so ``dx / dstep = g - u`` inside the range and ``g``
    outside, ``dx / doffset = 0`` inside and 1 outside; their float16 rounding is
    straight-through;
  * the integer sub-block levels: the same, through ``step = d * round(scale)`` and
    ``offset = -dmin * round(min)``, the rounding straight-through (a level past its range is
    clipped to it, and gets no gradient).

`gguf_grid_init` gives llama.cpp's own parameters for a float weight, so at initialisation the
fake-quantized weight is ``decode(encode(w))`` with llama.cpp's quantizer (PTQ). LSQ's gradient
scale (1 / sqrt(n Qp)) is left to the optimizer's learning rate for the parameters.

Shapes: ``w`` ``[..., n]`` with ``n`` whole blocks along the last axis; per-block parameters
``[..., n / block_size]``, levels ``[..., n / block_size, n_sub]``. Exactness holds in
float32; a ``w`` of another dtype gets the float32 values cast to it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lowbit.gguf import (
    Grid,
    GridParams,
    block_type,
    grid_initial_params,
    grid_of,
    round_fp16,
    round_level,
)

_sg = jax.lax.stop_gradient


def _ste(rounding):
    """`rounding` forward, the identity backward."""
    return lambda x: x + _sg(rounding(x) - x)


def _blocks(w: jax.Array, g: Grid) -> jax.Array:
    if w.ndim == 0 or w.shape[-1] % g.block_size:
        raise ValueError(
            f"{g.name} fake quantization takes blocks of {g.block_size} along the last axis, "
            f"got shape {tuple(w.shape)}; move the block axis last and pad it to whole blocks"
        )
    return jnp.asarray(w, jnp.float32).reshape(*w.shape[:-1], -1, g.block_size)


def _check_params(params: GridParams, x: jax.Array, g: Grid) -> None:
    shapes = {k: tuple(jnp.shape(v)) for k, v in params.items()}
    want = g.param_shapes(x.shape)
    if shapes != want:
        raise ValueError(
            f"{g.name} grid parameters must be {want} for this weight, got {shapes}; build them "
            "with gguf_grid_init(w, ggml_type)"
        )


def gguf_grid_init(w: jax.Array, ggml_type: str) -> GridParams:
    """llama.cpp's parameters for `w` on `ggml_type`'s grid (the training's initial ones).

    Not traced: call it on concrete weights, outside `jit`, once before training.

    Args:
      w: ``[..., n]`` float, ``n`` whole blocks.
      ggml_type: a type of `lowbit.gguf._grid.GRIDS` (Q8_0, Q4_0, Q4_1, Q5_0, IQ4_NL, Q2_K,
        Q3_K, Q4_K, Q5_K, Q6_K).
    Returns:
      A dict of float32 arrays: ``d`` (and ``dmin`` / ``m``) ``[..., n / block_size]``, the
      K-quants' ``scale`` (and ``min``) ``[..., n / block_size, n_sub]``.
    Raises:
      ValueError: for a type without a grid, a last axis that is not whole blocks, or values
        llama.cpp's quantizer refuses (NaN, Inf, beyond float16's range).
    """
    g = grid_of(ggml_type)
    return grid_initial_params(ggml_type, _blocks(jnp.asarray(w), g))


def gguf_pack(w: jax.Array, params: GridParams, ggml_type: str) -> jax.Array:
    """The GGUF blocks of `w` on the grid `params` give (what an export of the trained weight
    writes): they decode to `gguf_fake_quant(w, params, ggml_type)` bit for bit.

    Args:
      w: ``[..., n]`` float; params: as `gguf_grid_init` gives; ggml_type: as there.
    Returns:
      ``uint8 [..., n / block_size * type_size]``.
    """
    g = grid_of(ggml_type)
    x = _blocks(w, g)
    _check_params(params, x, g)
    blocks = g.encode_with(_sg(x), jax.tree.map(_sg, params))
    return blocks.reshape(*w.shape[:-1], -1)


def gguf_fake_quant(w: jax.Array, params: GridParams, ggml_type: str) -> jax.Array:
    """`w` on `ggml_type`'s grid with parameters `params` (see the module docstring).

    Args:
      w: ``[..., n]`` float, ``n`` whole blocks along the last axis.
      params: as `gguf_grid_init` gives (float32; trained with LSQ gradients).
      ggml_type: as for `gguf_grid_init`.
    Returns:
      ``[..., n]`` of `w`'s dtype: the values ``gguf_pack(w, params, ggml_type)`` decodes to.
    Raises:
      ValueError: for a type without a grid, a last axis that is not whole blocks, or
        parameters of other shapes than `gguf_grid_init` gives for `w`.
    """
    g = grid_of(ggml_type)
    x = _blocks(w, g)
    _check_params(params, x, g)
    codes = g.codes(_sg(x), jax.tree.map(_sg, params))
    exact = block_type(ggml_type).decode_blocks(g.pack(codes, jax.tree.map(_sg, params)))

    step, offset = g.affine(params, _ste(round_fp16), _ste(round_level))  # [..., nb, n_sub]
    xs = x.reshape(*x.shape[:-1], -1, g.sub_size)
    values = jnp.asarray(g.values, jnp.float32)
    gq = values[codes].reshape(xs.shape)
    step, offset = step[..., None], offset[..., None]
    live = _sg(step) != 0
    u = _sg((xs - offset) / jnp.where(live, step, 1.0))  # the continuous code
    inside = live & (u >= values[0]) & (u <= values[-1])
    # Inside: x + step (g - u), so d/dx = 1 exactly, d/dstep = g - u, d/doffset = 0; outside:
    # step g + offset, so d/dx = 0, d/dstep = g, d/doffset = 1.
    surrogate = jnp.where(inside, xs + step * (gq - u), step * gq + offset).reshape(x.shape)
    out = exact + (surrogate - _sg(surrogate))
    return out.reshape(w.shape).astype(w.dtype)
