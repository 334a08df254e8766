"""One op, an implementation per platform, chosen when the program is lowered.

`by_platform(args, rules, default)` computes ``default(*args)`` and binds it as one primitive
whose lowering is per platform: ``rules["cpu"]`` where the program is lowered for CPU,
``rules["cuda"]`` for CUDA, `default` for any other. A traced program so carries each
platform's kernel only into that platform's lowering, and one exported for several platforms
holds each kernel on its own branch.

Why not `jax.lax.platform_dependent`: JAX lowers the branches it keeps with the module's full
list of platforms, so a Pallas call in the CUDA branch of a ("cpu", "cuda") export is lowered
for CPU too, which Pallas refuses. A lowering rule per platform is lowered for that platform
alone (`mlir.lower_fun` on the rule's restricted context).

No derivative rule: callers wrap it in their own (`lowbit.ops` uses straight-through ones).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.extend
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

by_platform_p = Primitive("lowbit_by_platform")


def by_platform(args: tuple, rules: Mapping[str, Callable[..., Any]], default: Callable) -> Any:
    """``rules[platform](*args)`` for the platform the program is lowered for, else
    ``default(*args)``; every implementation returns one array of the same shape and dtype.

    Each implementation is traced here, into a jaxpr that the equation carries (as `cond`
    carries its branches), so walkers of the traced program see every one.

    Args:
      args: a tuple of pytrees (arrays, QArrays, ...).
      rules: platform name (`PLATFORMS`) -> implementation.
      default: the implementation on every other platform.
    Returns:
      The single array the implementations return.
    """
    unknown = set(rules) - set(PLATFORMS)
    if unknown:
        raise ValueError(f"by_platform: unknown platforms {sorted(unknown)}; expected {PLATFORMS}")
    flat, tree = jax.tree.flatten(args)
    trace = lambda fn: jax.make_jaxpr(functools.partial(_call, fn, tree))(*flat)
    fallback = trace(default)
    platforms = tuple(sorted(rules))
    branches = tuple(trace(rules[p]) for p in platforms)
    for platform, branch in zip(platforms, branches, strict=True):
        # Shape and dtype: under a mesh the avals may also differ in sharding annotations
        # (a kernel's custom call carries none), which the lowering reconciles.
        if [(a.shape, a.dtype) for a in branch.out_avals] != [
            (a.shape, a.dtype) for a in fallback.out_avals
        ]:
            raise ValueError(
                f"by_platform: the {platform} implementation returns {branch.out_avals}, the "
                f"default {fallback.out_avals}"
            )
    if len(fallback.out_avals) != 1:
        raise ValueError(f"by_platform: implementations return one array, got {fallback.out_avals}")
    return by_platform_p.bind(*flat, platforms=platforms, branches=branches, default=fallback)


def _call(fn: Callable, tree: Any, *flat: Any) -> Any:
    return fn(*jax.tree.unflatten(tree, flat))


def _abstract_eval(*avals: Any, platforms, branches, default) -> Any:
    (out,) = default.out_avals
    return out


def _impl(*flat: Any, **params: Any) -> Any:
    # Run eagerly as a compiled program, so the device's platform picks the implementation.
    return jax.jit(lambda *f: by_platform_p.bind(*f, **params))(*flat)


def _lowering(ctx, *flat, platforms, branches, default, platform: str | None):
    chosen = dict(zip(platforms, branches, strict=True)).get(platform, default)
    fn = lambda *f: jax.extend.core.jaxpr_as_fun(chosen)(*f)[0]
    return mlir.lower_fun(fn, multiple_results=False)(ctx, *flat)


def _batch(values, dims, *, platforms, branches, default):
    """vmap: the same choice of implementations, each `vmap`ped (batched activations alone
    keep one call into each kernel: its leading axes take any batch)."""
    axes = tuple(dims)

    def mapped(jaxpr) -> Callable:
        fn = lambda *f: jax.extend.core.jaxpr_as_fun(jaxpr)(*f)[0]
        return lambda *flat: jax.vmap(fn, in_axes=axes)(*flat)

    rules = {p: mapped(b) for p, b in zip(platforms, branches, strict=True)}
    return by_platform(tuple(values), rules, mapped(default)), 0


# The implementations' jaxprs may hold JAX's own high-level primitives (`jnp.ldexp` is one):
# they are traced again, and so lowered to plain ones, when the chosen one is lowered.
by_platform_p.is_high = lambda *avals, **params: False
by_platform_p.def_impl(_impl)
by_platform_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(by_platform_p, functools.partial(_lowering, platform=None))
for _platform in PLATFORMS:
    mlir.register_lowering(
        by_platform_p, functools.partial(_lowering, platform=_platform), platform=_platform
    )
batching.primitive_batchers[by_platform_p] = _batch
