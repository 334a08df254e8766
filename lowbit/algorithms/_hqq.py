"""HQQ (Badri & Shaji, 2023): data-free zero points minimizing an lp (p < 1) weight error.

Per group, with codes ``c = round(w / s + z)`` (clipped) and error ``e = w - (c - z) s``, HQQ
minimizes ``‖e‖_p^p`` by half-quadratic splitting: an auxiliary ``we`` is the generalized
soft-threshold of the error (``shrink(x) = sign(x) · relu(|x| - |x|^(p-1) / β)``), then the zero
point is the mean that best explains ``w - we``, and ``β`` grows by ``κ`` each iteration. The
best iterate by the lp objective is kept, so the objective of the returned zero points never
exceeds the RTN starting point's. Scales stay RTN's (min/max); only asymmetric integer formats
have a zero point to optimize.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from lowbit.formats import get_format
from lowbit.qarray import QArray, QuantConfig, blocks_view
from lowbit.qarray import quantize as quantize_array
from lowbit.recipes import HQQ


def _shrink(x, beta, p):
    return jnp.sign(x) * jax.nn.relu(jnp.abs(x) - jnp.abs(x + 1e-12) ** (p - 1) / beta)


@functools.partial(jax.jit, static_argnames=("fmt_name", "iters"))
def hqq_zero_points(blocks, scale, zero, *, fmt_name, iters, p, beta, kappa):
    """blocks: [..., G] float32; scale, zero: [...] → (zero [...], objective [iters + 1]).

    The objective sequence is of the best iterate so far (non-increasing).
    """
    fmt = get_format(fmt_name)
    s = scale[..., None]

    def objective(z):
        c = jnp.clip(jnp.round(blocks / s + z[..., None]), fmt.qmin, fmt.qmax)
        err = blocks - (c - z[..., None]) * s
        return jnp.sum(jnp.abs(err) ** p), c

    first, _ = objective(zero)

    def step(i, state):
        z, b, best_z, best, history = state
        _, c = objective(z)
        we = _shrink(blocks - (c - z[..., None]) * s, b, p)
        z = jnp.mean(c - (blocks - we) / s, axis=-1)
        value, _ = objective(z)
        better = value < best
        best_z = jnp.where(better, z, best_z)
        best = jnp.minimum(value, best)
        return z, b * kappa, best_z, best, history.at[i + 1].set(best)

    history = jnp.zeros(iters + 1).at[0].set(first)
    _, _, best_z, _, history = jax.lax.fori_loop(
        0, iters, step, (zero, jnp.float32(beta), zero, first, history)
    )
    return best_z, history


def hqq_qarray(w: jax.Array, config: QuantConfig, algorithm: HQQ) -> tuple[QArray, jax.Array]:
    """Quantizes `w` by an asymmetric grouped `config` with HQQ zero points.

    Returns:
      (QArray, [iters + 1] lp objective of the best iterate so far; entry 0 is RTN's).
    Raises:
      ValueError: for a symmetric config (no zero point to optimize).
    """
    if config.symmetric:
        raise ValueError(
            f"HQQ optimizes zero points: format {get_format(config.format).name!r} with "
            "symmetric=True has none; use an asymmetric uintN config (symmetric=False)"
        )
    rtn = quantize_array(w, config)
    fmt = rtn.fmt
    tile = tuple(n // s for n, s in zip(rtn.shape, rtn.scale.shape, strict=True))
    blocks = blocks_view(jnp.asarray(w, jnp.float32), tile)
    scale = rtn.scale.astype(jnp.float32)
    zero, history = hqq_zero_points(
        blocks,
        scale,
        rtn.zero_point.astype(jnp.float32),
        fmt_name=fmt.name,
        iters=algorithm.iters,
        p=algorithm.p,
        beta=algorithm.beta,
        kappa=algorithm.kappa,
    )
    # Bounds whose min/max quantization gives this scale and zero point.
    lo = (fmt.min_value - zero) * scale
    hi = lo + scale * (fmt.max_value - fmt.min_value)
    q = quantize_array(w, dataclasses.replace(config), bounds=(lo, hi))
    return q, history
