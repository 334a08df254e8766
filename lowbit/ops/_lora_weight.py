"""`LoraWeight`: a frozen base weight (float or packed `QArray`) with a trainable low-rank adapter.

The weight it stands for is ``base + scale * (a @ b)`` (LoRA; QLoRA when `base` is a `QArray`).
Its matmul never forms that sum: `lora_dot_general` runs the base product through
`lowbit.ops.dot_general` (the quantized kernel paths for a `QArray`) and adds the low-rank term
``((x * dropout_mask) @ a) @ b * scale`` in float. The base is frozen: no gradient reaches it.

Axes: the base's axes split into `in_axes` (contracted by the matmul the adapter serves),
`out_axes`, and the rest, which are batch axes (stacked layers) leading both factors:
``a: [*batch, *in, rank]``, ``b: [*batch, rank, *out]``, each group in the base's axis order.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from lowbit.ops._dot_general import dot_general, plan_dot_general
from lowbit.ops._operand import dequantized, quantized
from lowbit.qarray import ArrayBacked, EngineValue, NoRule


@typing.final
@dataclasses.dataclass(frozen=True, eq=False)
class LoraWeight(ArrayBacked):
    """A frozen base weight plus ``scale * a @ b``.

    Attributes:
      base: [*shape] float array or `QArray`; frozen.
      a: [*batch, *in, rank] float; initialised random (trainable).
      b: [*batch, rank, *out] float; initialised to zero (trainable).
      key: optional PRNG key for adapter dropout (None: no dropout).
      in_axes: axes of `base` the adapter's input side covers (contracted by its matmul).
      out_axes: axes of `base` the adapter's output side covers.
      scale: ``alpha / rank``.
      dropout: probability of zeroing an input feature of the low-rank path (training only).
    """

    base: Any
    a: jax.Array
    b: jax.Array
    key: jax.Array | None = None
    in_axes: tuple[int, ...] = (0,)
    out_axes: tuple[int, ...] = (1,)
    scale: float = 1.0
    dropout: float = 0.0

    backing = "base"  # shape and dtype are those of `base`
    engine_priority = 3

    @property
    def rank(self) -> int:
        return int(self.a.shape[-1])

    @property
    def batch_axes(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.ndim) if i not in self.in_axes + self.out_axes)

    def delta(self) -> jax.Array:
        """``scale * a @ b`` laid out like `base`: [*shape] float32."""
        nb = len(self.batch_axes)
        n_in, n_out = len(self.in_axes), len(self.out_axes)
        a = self.a.astype(jnp.float32)
        b = self.b.astype(jnp.float32)
        batch = tuple(range(nb))
        prod = lax.dot_general(a, b, (((a.ndim - 1,), (nb,)), (batch, batch)))
        # prod axes: [*batch, *in, *out]; move them back to the base's order.
        order = self.batch_axes + self.in_axes + self.out_axes
        perm = [order.index(i) for i in range(nb + n_in + n_out)]
        return jnp.transpose(prod, perm) * self.scale

    def base_float(self) -> jax.Array:
        return lax.stop_gradient(dequantized(self.base))

    def dequantize(self, dtype: Any = None) -> jax.Array:
        """The merged weight ``base + scale * a @ b`` (gradients reach `a` and `b` only)."""
        base = self.base_float()
        dtype = base.dtype if dtype is None else dtype
        return (base.astype(jnp.float32) + self.delta()).astype(dtype)

    # --- the engine's protocol (`EngineValue`) -------------------------------------------------
    def map_layout(self, qarray_fn: Any, float_fn: Any) -> LoraWeight:
        """Only layout ops that leave the shape alone (copies, dtype casts of the base) keep
        the adapter; others dequantize the merged weight (counted)."""
        return self.map_backing(qarray_fn, float_fn, "a LoRA-adapted weight")

    def describe(self) -> str:
        return f"LoraWeight({self.describe_backing()}, rank={self.a.shape[-1]})"

    def dot_general(self, lhs: Any, rhs: Any, dimension_numbers: Any, **kwargs: Any):
        try:
            return _adapted_product(lhs, rhs, rhs is self, dimension_numbers, **kwargs)
        except LoraLayoutError as err:
            raise NoRule(str(err)) from None

    def scan_parts(self, qarray_parts: Any) -> Any:
        if 0 not in self.batch_axes:
            raise NoRule("is a LoRA-adapted weight whose adapter spans the scanned axis")
        base = self.base
        if isinstance(base, EngineValue):
            base_parts, rebuild_base = base.logical().scan_parts(qarray_parts)
        else:
            base_parts, rebuild_base = base, lambda part: part
        shift = lambda axes: tuple(i - 1 for i in axes)
        return (base_parts, self.a, self.b), lambda p: dataclasses.replace(
            self,
            base=rebuild_base(p[0]),
            a=p[1],
            b=p[2],
            in_axes=shift(self.in_axes),
            out_axes=shift(self.out_axes),
        )

    def shard_parts(self, spec: Any, qarray_parts: Any) -> Any:
        raise NoRule("is a LoRA-adapted weight entering shard_map")


jax.tree_util.register_dataclass(
    LoraWeight,
    data_fields=["base", "a", "b", "key"],
    meta_fields=["in_axes", "out_axes", "scale", "dropout"],
)


class LoraLayoutError(ValueError):
    """The matmul does not contract exactly the adapter's input axes."""


def _dropped(x: jax.Array, weight: LoraWeight, salt: int) -> jax.Array:
    if weight.key is None or weight.dropout <= 0.0:
        return x
    keep = 1.0 - weight.dropout
    mask = jax.random.bernoulli(jax.random.fold_in(weight.key, salt), keep, x.shape)
    return jnp.where(mask, x / keep, jnp.zeros((), x.dtype)).astype(x.dtype)


def lora_dot_general(
    lhs: Any,
    rhs: Any,
    dimension_numbers: Any,
    *,
    precision: Any = None,
    preferred_element_type: Any = None,
    out_sharding: Any = None,
) -> jax.Array:
    """`lax.dot_general` with one operand a `LoraWeight`: base product + low-rank product.

    Args:
      lhs, rhs: one `LoraWeight` (without batch axes) and one float array.
      dimension_numbers: as for `lax.dot_general`; the weight's contracting dimensions must be
        exactly its `in_axes` and it must have no dot batch dimensions.
    Returns:
      The product, as `lax.dot_general` on the merged weight would give it (up to rounding).
    Raises:
      LoraLayoutError: for other dimension numbers (callers dequantize the merged weight).
    """
    out, _ = _adapted_product(
        lhs,
        rhs,
        isinstance(rhs, LoraWeight),
        dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
    )
    return out


def _adapted_product(
    lhs, rhs, weight_rhs, dimension_numbers, *, precision, preferred_element_type, out_sharding
) -> tuple[jax.Array, str]:
    """(`lora_dot_general`'s product, its path ``"lora+<base path>"``, e.g.
    ``"lora+cpu_kernel_nf4"``): the base product is planned once for both. `weight_rhs`:
    the adapted weight is `rhs` (else `lhs`)."""
    (lc, rc), (lb, rb) = dimension_numbers
    weight, x = (rhs, lhs) if weight_rhs else (lhs, rhs)
    wc, xc = (rc, lc) if weight_rhs else (lc, rc)
    if isinstance(x, EngineValue):
        raise LoraLayoutError("both operands are quantized or adapted")
    if weight.batch_axes or lb or rb:
        raise LoraLayoutError("the adapted weight has batch axes")
    if sorted(wc) != sorted(weight.in_axes):
        raise LoraLayoutError(
            f"contracts axes {tuple(wc)} of the weight, not the adapter's input axes "
            f"{weight.in_axes}"
        )
    base = weight.base
    if not quantized(base):
        base = lax.stop_gradient(base)
    pair = (lhs, base) if weight_rhs else (base, rhs)
    plan = plan_dot_general(*pair, dimension_numbers, out_sharding=out_sharding)
    out = dot_general(
        *pair,
        dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
        plan=plan,
    )
    # Low-rank path in float32: x contracts with `a` over the same axes, then `rank` with `b`.
    a_axes = tuple(weight.in_axes.index(axis) for axis in wc)
    xd = _dropped(x, weight, salt=0).astype(jnp.float32)
    t = lax.dot_general(xd, weight.a.astype(jnp.float32), ((tuple(xc), a_axes), ((), ())))
    b = weight.b.astype(jnp.float32)
    if weight_rhs:
        low = lax.dot_general(t, b, (((t.ndim - 1,), (0,)), ((), ())))
    else:
        # Output axes are [*weight free, *x free]: contract b's rank with t's last axis.
        low = lax.dot_general(b, t, (((0,), (t.ndim - 1,)), ((), ())))
    low = low * weight.scale
    return (out.astype(jnp.float32) + low).astype(out.dtype), f"lora+{plan.path}"


def lora_init(
    key: jax.Array,
    base: Any,
    *,
    rank: int,
    in_axes: tuple[int, ...],
    out_axes: tuple[int, ...],
    dtype: Any = jnp.float32,
) -> tuple[jax.Array, jax.Array]:
    """Fresh adapter factors for `base`: ``a`` Kaiming-uniform-like, ``b`` zeros (delta 0).

    Returns:
      (a: [*batch, *in, rank], b: [*batch, rank, *out]).
    """
    shape = tuple(base.shape)
    batch = tuple(i for i in range(len(shape)) if i not in in_axes + out_axes)
    batch_shape = tuple(shape[i] for i in batch)
    in_shape = tuple(shape[i] for i in in_axes)
    out_shape = tuple(shape[i] for i in out_axes)
    fan_in = math.prod(in_shape)
    bound = 1.0 / math.sqrt(fan_in)
    a = jax.random.uniform(key, (*batch_shape, *in_shape, rank), dtype, -bound, bound)
    b = jnp.zeros((*batch_shape, rank, *out_shape), dtype)
    return a, b
