"""N:M structured sparsity for params: masks, sparse-aware training, compressed weights.

`SparseRule` selects weights by path and gives the pattern (2:4 along the contracted axis by
default: axis -2 of a ``[..., in, out]`` kernel). Sparse-aware training keeps float params and
applies masks in the loss; the masks are recomputed by magnitude on a schedule
(`SparseRule.update_every` steps), so pruned weights can come back while it trains:

    rule = SparseRule(path=r".*kernel", update_every=50)
    masks = nm_masks(params, rule)
    for step in range(steps):
        if rule.refresh(step):
            masks = nm_masks(params, rule)
        grads = jax.grad(lambda p: loss(apply_masks(p, masks)))(params)
        ...

`nm_sparsify_params` then stores each selected weight as an `NMSparse` (kept values, float or
quantized, plus index metadata); the engine runs it dense (counted in the report) until a
sparse kernel exists.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from lowbit.qarray import QuantConfig, nm_mask, nm_sparsify, quantize
from lowbit.recipes import Select, map_params, select_params


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseRule:
    """Which weights are N:M sparse, and how.

    Attributes:
      path: regex fully matched against parameter paths.
      exclude: optional regex of paths left dense.
      n, m: keep n of every m consecutive entries along `axis`.
      axis: the weight axis the groups run along (its contracted axis; -2 for ``[in, out]``).
      update_every: steps between mask refreshes in sparse-aware training (>= 1).
      values: optional `QuantConfig` for the kept values (sparse int8 / fp8); its
        granularity applies to the compressed values array.
      min_ndim: parameters with fewer axes stay dense.
      select: the `lowbit.recipes.Select` built from `path`, `exclude` and `min_ndim` (not an
        argument): how every rule type picks its parameters.

    Raises:
      TypeError / ValueError: naming the field, the value and what is accepted.
    """

    path: str = r".*kernel"
    exclude: str | None = None
    n: int = 2
    m: int = 4
    axis: int = -2
    update_every: int = 100
    values: QuantConfig | None = None
    min_ndim: int = 2
    select: Select = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "select", Select.of(self))
        for field in ("n", "m", "update_every"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SparseRule.{field}: {value!r}; accepted: an int >= 1")
        if self.n >= self.m:
            raise ValueError(f"SparseRule: n={self.n} must be below m={self.m} (e.g. n=2, m=4)")
        if self.values is not None and not isinstance(self.values, QuantConfig):
            raise TypeError(f"SparseRule.values must be a QuantConfig or None, got {self.values!r}")

    def selects(self, path: str, leaf: Any) -> bool:
        """True if the parameter `leaf` at `path` is made sparse."""
        return self.select.matches(path, leaf)

    def refresh(self, step: int) -> bool:
        """Whether sparse-aware training recomputes its masks before `step`."""
        return step % self.update_every == 0


def nm_masks(params: Any, rule: SparseRule) -> dict[str, jax.Array]:
    """`lowbit.nm_masks`: {path: bool mask} by magnitude for every weight `rule` selects.

    Raises:
      ValueError: if the rule selects nothing, or `m` does not divide a weight's axis.
    """
    masks = {}
    for path, leaf in select_params(params, rule.select).items():
        try:
            masks[path] = nm_mask(leaf, rule.n, rule.m, rule.axis)
        except ValueError as err:
            raise ValueError(f"{path} {tuple(leaf.shape)}: {err}") from None
    return masks


def apply_masks(params: Any, masks: dict[str, jax.Array]) -> Any:
    """`lowbit.apply_masks`: params with pruned entries zeroed (traceable; gradients reach the
    kept entries)."""
    return map_params(
        lambda path, leaf: (
            jnp.where(masks[path], leaf, jnp.zeros((), leaf.dtype)) if path in masks else leaf
        ),
        params,
    )


def nm_sparsify_params(
    params: Any, rule: SparseRule, masks: dict[str, jax.Array] | None = None
) -> Any:
    """`lowbit.nm_sparsify_params`: the selected weights as compressed `NMSparse` values.

    Args:
      params: float params.
      rule: which weights, which pattern, which value format.
      masks: optional {path: keep mask} (the masks sparse-aware training ended with, or
        SparseGPT's); weights without one are pruned by magnitude.
    Returns:
      The params with `NMSparse` leaves (values quantized with `rule.values` if given).
    Raises:
      ValueError: as `nm_masks`.
    """
    selected = set(select_params(params, rule.select))
    quantize_values = None
    if rule.values is not None:
        quantize_values = lambda v: quantize(v, rule.values)

    def one(path: str, leaf: Any) -> Any:
        if path not in selected:
            return leaf
        try:
            mask = None if masks is None else masks.get(path)
            return nm_sparsify(
                leaf, rule.n, rule.m, rule.axis, quantize_values=quantize_values, mask=mask
            )
        except ValueError as err:
            raise ValueError(f"{path} {tuple(leaf.shape)}: {err}") from None

    return map_params(one, params)
