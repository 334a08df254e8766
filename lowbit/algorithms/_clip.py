"""AWQ's clipping search: shrink each scale block's range where that lowers the output error.

Round-to-nearest with absmax scales spends the grid on the block's largest weight; clipping the
block to a fraction `r` of its range rounds the rest more finely. AWQ (Lin et al., 2023) picks
`r` per block (here per scale block and output column) on a grid, minimizing the block's output
error on the calibration inputs, ``δᵀ H_b δ`` with ``δ = w - Q(clip(w, r))`` and ``H_b`` the
block's diagonal block of the inputs' Gram matrix (all calibration rows, not a sample). The
weight is clipped in float, so round-to-nearest then finds the clipped range's scales: the
stored layout is the recipe's own.

Routed experts (``[E, K, N]``, input axis 1) are searched one expert at a time on that
expert's own Gram matrix (`clip_experts`), where the config's scale blocks never span two
experts; an expert that received no calibration rows keeps its full range.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lowbit.algorithms._smooth import block_shape, fake_quant
from lowbit.qarray import QuantConfig

# AutoAWQ's grid: r = 1, 0.95, ..., 0.55.
RATIOS = tuple(1.0 - i / 20 for i in range(10))


def _block_errors(w, hb, axis: int, config: QuantConfig, ratio: jax.Array):
    """(clipped w, [groups, N] error of each block): `w` 2-D with input axis `axis`, `hb`
    [groups, bk, bk] the diagonal blocks of the Gram matrix."""
    kn = jnp.moveaxis(w, axis, 0)
    g, bk, _ = hb.shape
    blocks = kn.reshape(g, bk, -1)
    if config.symmetric:  # the grid is symmetric: clip both sides to the shrunk absmax
        hi = jnp.max(jnp.abs(blocks), axis=1, keepdims=True)
        lo = -hi
    else:
        lo = jnp.minimum(blocks.min(axis=1, keepdims=True), 0.0)
        hi = jnp.maximum(blocks.max(axis=1, keepdims=True), 0.0)
    clipped = jnp.clip(blocks, ratio * lo, ratio * hi)
    clipped_w = jnp.moveaxis(clipped.reshape(kn.shape), 0, axis)
    q = jnp.moveaxis(fake_quant(clipped_w, config), axis, 0).reshape(blocks.shape)
    d = blocks - q
    err = jnp.einsum("gkn,gkl,gln->gn", d, hb, d, precision=jax.lax.Precision.HIGHEST)
    return clipped, err


def clip_search(
    w: jax.Array, axis: int, config: QuantConfig, h: jax.Array, ratios=RATIOS
) -> tuple[jax.Array, float] | str:
    """`w` clipped per scale block and output column to the range minimizing its output error.

    Args:
      w: [K, N] or [N, K] float weight (2-D), input axis `axis`.
      axis: its input (contracted) axis.
      config: its weight config (the scale blocks searched are its quantization's).
      h: [K, K] Gram matrix of its inputs (as the quantizer sees them: after any folded scale).
      ratios: range fractions tried (1 keeps round-to-nearest's range).
    Returns:
      (clipped weight like `w`, mean chosen ratio), or why it cannot be searched.
    """
    if w.ndim != 2:
        return "clip search needs a 2-D weight"
    block = block_shape(w, config)
    bk, bn = block[axis], block[1 - axis]
    if bn != 1:
        return f"clip search needs one scale per output column (blocks {block})"
    w = jnp.asarray(w, jnp.float32)
    out, mean_ratio = _search(w, jnp.asarray(h, jnp.float32), axis, bk, config, tuple(ratios))
    return out, float(mean_ratio)


def diagonal_blocks(h: jax.Array, size: int) -> jax.Array:
    """h [K, K] → its diagonal blocks [K / size, size, size]."""
    g = h.shape[0] // size
    return jnp.moveaxis(jnp.diagonal(h.reshape(g, size, g, size), axis1=0, axis2=2), -1, 0)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _search(w, h, axis: int, bk: int, config: QuantConfig, ratios: tuple[float, ...]):
    """(w clipped per block and column to its best ratio, mean ratio): one compiled loop over
    the ratios, so a weight's search is one dispatch. h: [K, K]; bk: the blocks' inputs."""
    hb = diagonal_blocks(h, bk)

    def step(best, r):
        clipped, err, ratio = best
        c, e = _block_errors(w, hb, axis, config, r)
        better = e < err
        return (
            jnp.where(better[:, None, :], c, clipped),
            jnp.where(better, e, err),
            jnp.where(better, r, ratio),
        ), None

    clipped, err = _block_errors(w, hb, axis, config, jnp.float32(ratios[0]))
    first = (clipped, err, jnp.full(err.shape, ratios[0], jnp.float32))
    (best, _, ratio), _ = jax.lax.scan(step, first, jnp.asarray(ratios[1:], jnp.float32))
    k = w.shape[axis]
    return jnp.moveaxis(best.reshape(k, w.size // k), 0, axis), jnp.mean(ratio)


def clip_experts(
    w: jax.Array, grams: list[jax.Array | None], config: QuantConfig, ratios=RATIOS
) -> tuple[jax.Array, float] | str:
    """`clip_search` per expert of `w` [E, K, N] (input axis 1).

    Args:
      w: the experts' weight.
      grams: per expert its inputs' Gram matrix [K, K] (over its rows), or None for an expert
        that received no rows (kept unclipped).
      config: the weight's config; its scale blocks must be one expert's blocks (block shape
        ``(1, *block of one expert)``).
      ratios: as for `clip_search`.
    Returns:
      (clipped weight like `w`, mean chosen ratio over the searched experts), or why not.
    """
    if w.ndim != 3:
        return "clip search per expert needs an [experts, in, out] weight"
    try:
        one = block_shape(w[0], config)
    except ValueError as error:
        return f"the config does not apply to one expert's [in, out] slice ({error})"
    if block_shape(w, config) != (1, *one):
        return "the config's scale blocks are not one expert's blocks"
    out, ratios_seen = [], []
    for e, gram in enumerate(grams):
        if gram is None:
            out.append(jnp.asarray(w[e]))
            continue
        found = clip_search(w[e], 0, config, gram, ratios)
        if isinstance(found, str):
            return found
        out.append(found[0].astype(w.dtype))
        ratios_seen.append(found[1])
    mean = sum(ratios_seen) / len(ratios_seen) if ratios_seen else 1.0
    return jnp.stack(out), mean
