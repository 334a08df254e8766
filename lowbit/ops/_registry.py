"""The kernels that compute quantized products their own way on one platform, registered by
(weight format, platform), and the choice of them for one product.

A `Kernel` is a handler and the facts that select it: the platform whose lowering runs it, the
weight formats it reads, `applies` (static facts of the operands -> the kernel's hashable
configuration, or None when it does not compute this product) and `run` (the operands and
that configuration -> the product). The CPU kernels register in `_cpu_kernels`, the Pallas
weight-only kernel and CUDA's K-major GEMM in `_accelerated`. `plan_dot_general` calls
`choose` once per product; `dot_general` binds each chosen kernel's `run` as its platform's
implementation (`lowbit.kernels.by_platform`), the portable pure-JAX product everywhere else.

Adding a kernel is one handler and one entry::

    register(Kernel("my_kernel", "cuda", ("int4",), applies=my_rule, run=my_handler))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import jax

from lowbit.kernels import PLATFORMS
from lowbit.ops._operand import quantized


@dataclasses.dataclass(frozen=True)
class Call:
    """What a kernel's `run` is given besides its operands and configuration (static).

    Attributes:
      dimension_numbers: the product's normalized ``((lc, rc), (lb, rb))``.
      precision, preferred_element_type: as `dot_general` was given them.
      out_dtype: the dtype `run` returns.
      portable: ``portable(lhs, rhs, dimension_numbers) -> [out_dtype]``, the pure-JAX product
        (for a kernel that only lays the operands out another way).
    """

    dimension_numbers: Any
    precision: Any
    preferred_element_type: Any
    out_dtype: Any
    portable: Callable[[Any, Any, Any], jax.Array]


@dataclasses.dataclass(frozen=True, eq=False)
class Kernel:
    """One platform's own implementation of products with a quantized weight (`rhs`).

    Attributes:
      name: what it is called (e.g. ``"cpu_kernel"``, ``"pallas"``).
      platform: the lowering platform that runs it, one of `lowbit.kernels.PLATFORMS`.
      formats: the weight formats (`QArray.fmt.name`) it reads.
      applies: ``applies(lhs, rhs, dimension_numbers) -> config | None`` from static facts
        (shapes, dtypes, scale layouts, shardings); a hashable, non-None config selects it.
      run: ``run(lhs, rhs, config, call: Call) -> jax.Array`` in ``call.out_dtype``.
      path: ``path(config) -> str``, the name the engine reports for products it runs on the
        CPU (None: the portable product's name).
      per_call_layout: ``per_call_layout(lhs, rhs, config) -> bool``, whether `run` lays a
        logical weight out on every call (a fallback the engine counts), or None for never.
      declines: ``declines(lhs, rhs, dimension_numbers) -> str | None``, why a product of
        its formats that it does not take is left to the portable product (the engine
        report counts it), or None where that is by design; None: never says.
    """

    name: str
    platform: str
    formats: tuple[str, ...]
    applies: Callable[[Any, Any, Any], Hashable | None]
    run: Callable[..., jax.Array]
    path: Callable[[Any], str] | None = None
    per_call_layout: Callable[[Any, Any, Any], bool] | None = None
    declines: Callable[[Any, Any, Any], str | None] | None = None


@dataclasses.dataclass(frozen=True)
class Chosen:
    """A kernel chosen for one product, with the configuration its `applies` gave."""

    kernel: Kernel
    config: Hashable

    @property
    def platform(self) -> str:
        return self.kernel.platform


_KERNELS: dict[tuple[str, str], tuple[Kernel, ...]] = {}


def register(kernel: Kernel) -> Kernel:
    """Adds `kernel` for each of its formats on its platform, after those already there (the
    first that applies to a product is chosen)."""
    if kernel.platform not in PLATFORMS:
        raise ValueError(
            f"register: kernel {kernel.name!r} names platform {kernel.platform!r}; expected one "
            f"of {PLATFORMS}"
        )
    for fmt in kernel.formats:
        _KERNELS[fmt, kernel.platform] = (*_KERNELS.get((fmt, kernel.platform), ()), kernel)
    return kernel


def registered(fmt: str, platform: str) -> tuple[Kernel, ...]:
    """The kernels for weights of format `fmt` on `platform`, in the order they are tried."""
    return _KERNELS.get((fmt, platform), ())


def choose(lhs: Any, rhs: Any, dimension_numbers: Any) -> tuple[Chosen, ...]:
    """For each platform, the first kernel registered for the weight's format that applies.

    Args:
      lhs, rhs: the product's operands, logical (a `PreparedQArray` is planned by its own
        route); only a quantized `rhs` has kernels.
      dimension_numbers: normalized ``((lc, rc), (lb, rb))``.
    Returns:
      One `Chosen` per platform that has a kernel for this product, in `PLATFORMS` order.
    """
    if not quantized(rhs):
        return ()
    chosen = []
    for platform in PLATFORMS:
        for kernel in registered(rhs.fmt.name, platform):
            config = kernel.applies(lhs, rhs, dimension_numbers)
            if config is not None:
                chosen.append(Chosen(kernel, config))
                break
    return tuple(chosen)


def declined(
    lhs: Any, rhs: Any, dimension_numbers: Any, chosen: tuple[Chosen, ...]
) -> tuple[tuple[str, str], ...]:
    """(platform, "kernel: reason") for each platform without a chosen kernel whose kernels
    for this weight's format say why they leave it to the portable product (the first that
    says, per platform)."""
    if not quantized(rhs):
        return ()
    taken = {c.platform for c in chosen}
    out = []
    for platform in PLATFORMS:
        if platform in taken:
            continue
        for kernel in registered(rhs.fmt.name, platform):
            reason = kernel.declines and kernel.declines(lhs, rhs, dimension_numbers)
            if reason:
                out.append((platform, f"{kernel.name}: {reason}"))
                break
    return tuple(out)
