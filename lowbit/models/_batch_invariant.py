"""Arithmetic whose rounding does not depend on how many rows run together.

A server decodes whichever rows are busy, so one request's step runs at batch 1 one moment
and batch 8 the next. The weight products are the CPU kernels' (the same bits for a row at
any batch size); what XLA compiles around them is not, in two ways:

* **Reductions.** XLA picks a ``reduce``'s order by its shape: an RMSNorm's sum of squares
  over SmolLM2's 576 features rounded differently at batch 8 than at batch 1.
* **Contraction.** With FMA instructions, LLVM fuses a multiply into the add it feeds when
  both land in one XLA fusion, and XLA's fusion choices follow the batch size, so
  ``a * b + c`` rounds once in one program and twice in another (RoPE's
  ``x * cos + rotated * sin`` did).

Int8 activations turn such a last-bit difference into another token where two are nearly
tied, so a greedy answer would depend on the requests beside it. `lowbit.kernels.row_sum`
sums in one fixed pairwise order (one kernel call on CPU; elementwise adds, which XLA may
neither reorder nor contract, elsewhere), and `separately` keeps products out of the fusion
of an add they feed; `RMSNorm` and `softmax` are built on them. With them a dense decoder on
the CPU kernels gives each row the same bits at every batch size, in a prefill and in a
decode step (`tests/models/test_batch_invariant.py`).
Mixtures of experts are not covered: which rows share an expert changes their grouped
products.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes

from lowbit.kernels import row_sum


def separately(*xs: jax.Array) -> tuple[jax.Array, ...]:
    """`xs` computed in their own fusion: a product returned here is rounded before any add
    that uses it, whatever XLA fuses (no FMA contraction across this point)."""
    return jax.lax.optimization_barrier(xs)


def softmax(x: jax.Array) -> jax.Array:
    """``softmax(x)`` over the last axis, its denominator a `row_sum`: a row's probabilities
    are the same bits at any leading shape. `x` is materialized first, so a scale or cap
    multiplied into it is not contracted into the subtraction of the maximum."""
    (x,) = separately(x)
    shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    (unnormalized,) = separately(jnp.exp(shifted))
    return unnormalized / row_sum(unnormalized)


class RMSNorm(nnx.RMSNorm):
    """`flax.nnx.RMSNorm` over the last axis (its parameters and defaults) whose mean of
    squares is a `row_sum`, so a row normalizes to the same bits at any batch size.

    x: ``[..., features]`` -> the same shape; statistics in float32 at least.
    """

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        if mask is not None or self.reduction_axes not in (-1, (-1,)):
            raise ValueError(
                "lowbit's RMSNorm normalizes over the last axis without a mask; got "
                f"reduction_axes={self.reduction_axes}, mask={'set' if mask is not None else None}"
            )
        scale = self.scale[...] if self.scale is not None else None
        x, scale = self.promote_dtype((x, scale), dtype=self.dtype)
        stats = jnp.promote_types(x.dtype, jnp.float32)
        xs = x.astype(stats)
        mean_square = row_sum(xs, square=True) / x.shape[-1]
        mul = jax.lax.rsqrt(mean_square + self.epsilon)
        args = [x]
        if scale is not None:
            mul = mul * scale
            args.append(scale)
        return jnp.asarray(xs * mul, dtypes.canonicalize_dtype(*args, dtype=self.dtype))
