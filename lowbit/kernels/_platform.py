"""One op, an implementation per platform, chosen when the program is lowered: lowbit's one
platform switch (the CPU kernels' FFI calls, the quantized products' accelerator kernels and
the models' fused attention all go through it).

`by_platform(args, rules, default)` computes ``default(*args)`` and binds it as one primitive
whose lowering is per platform: ``rules["cpu"]`` where the program is lowered for CPU,
``rules["cuda"]`` for CUDA, `default` for any other. A traced program so carries each
platform's kernel only into that platform's lowering, and one exported for several platforms
holds each kernel on its own branch.

Why not `jax.lax.platform_dependent`: JAX lowers the branches it keeps with the module's full
list of platforms, so a Pallas call in the CUDA branch of a ("cpu", "cuda") export is lowered
for CPU too, which Pallas refuses. A lowering rule per platform is lowered for that platform
alone (`mlir.lower_fun` on the rule's restricted context).

Derivatives follow `default` (every implementation computes the same function; a kernel's FFI
call has no derivative of its own); `lowbit.ops` wraps its products in straight-through rules
of their own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.extend
from jax.extend.core import ClosedJaxpr, Primitive, jaxpr_as_fun
from jax.interpreters import ad, batching, mlir

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

by_platform_p = Primitive("lowbit_by_platform")


def by_platform(args: tuple, rules: Mapping[str, Callable[..., Any]], default: Callable) -> Any:
    """``rules[platform](*args)`` for the platform the program is lowered for, else
    ``default(*args)``; every implementation returns one array of the same shape and dtype.

    Each implementation is traced here, into a jaxpr that the equation carries (as `cond`
    carries its branches), so walkers of the traced program see every one. Values an
    implementation closes over (arrays of an enclosing trace) become operands of the equation.

    Args:
      args: a tuple of pytrees (arrays, QArrays, ...); ``()`` for implementations that close
        over their inputs.
      rules: platform name (`PLATFORMS`) -> implementation.
      default: the implementation on every other platform.
    Returns:
      The single array the implementations return.
    """
    unknown = set(rules) - set(PLATFORMS)
    if unknown:
        raise ValueError(f"by_platform: unknown platforms {sorted(unknown)}; expected {PLATFORMS}")
    flat, tree = jax.tree.flatten(args)
    platforms = tuple(sorted(rules))
    traced = [_trace(fn, tree, flat) for fn in (default, *(rules[p] for p in platforms))]
    # Each implementation's closed-over tracers, hoisted: the equation's operands are `flat`
    # and then every implementation's, and each jaxpr takes them all.
    hoisted = [t for _, captured in traced for t in captured]
    spans, start = [], len(flat)
    for _, captured in traced:
        spans.append((start, start + len(captured)))
        start += len(captured)
    jaxprs = [
        _closed_over(jaxpr, len(flat), span, [*flat, *hoisted])
        for (jaxpr, _), span in zip(traced, spans, strict=True)
    ]
    fallback, branches = jaxprs[0], tuple(jaxprs[1:])
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
    return by_platform_p.bind(
        *flat, *hoisted, platforms=platforms, branches=branches, default=fallback
    )


def _call(fn: Callable, tree: Any, *flat: Any) -> Any:
    return fn(*jax.tree.unflatten(tree, flat))


def _trace(fn: Callable, tree: Any, flat: list) -> tuple[ClosedJaxpr, list]:
    """`fn`'s jaxpr on `flat`, and the tracers of an enclosing trace it closes over."""
    jaxpr = jax.make_jaxpr(functools.partial(_call, fn, tree))(*flat)
    return jaxpr, [c for c in jaxpr.consts if isinstance(c, jax.core.Tracer)]


def _closed_over(jaxpr: ClosedJaxpr, n: int, span: tuple[int, int], operands: list) -> ClosedJaxpr:
    """`jaxpr` as a function of all the equation's operands (its own hoisted tracers at
    ``operands[span[0]:span[1]]``), with no tracer among its constants."""
    if span[0] == span[1]:
        if len(operands) == n:
            return jaxpr
        return jax.make_jaxpr(lambda *ops: jaxpr_as_fun(jaxpr)(*ops[:n]))(*operands)

    def fn(*ops):
        own = iter(ops[span[0] : span[1]])
        consts = [next(own) if isinstance(c, jax.core.Tracer) else c for c in jaxpr.consts]
        return jaxpr_as_fun(ClosedJaxpr(jaxpr.jaxpr, consts))(*ops[:n])

    return jax.make_jaxpr(fn)(*operands)


def _abstract_eval(*avals: Any, platforms, branches, default) -> Any:
    (out,) = default.out_avals
    return out


def _platform_of(flat: tuple) -> str:
    """The platform (`PLATFORMS`' names) of the first JAX array's device, else of the device
    host values go to (`jax.default_device`'s, or the default backend's first)."""
    device = next((next(iter(x.devices())) for x in flat if isinstance(x, jax.Array)), None)
    if device is None:
        device = jax.config.jax_default_device
        if device is None or isinstance(device, str):
            device = jax.devices(device)[0]
    if device.platform == "gpu":
        return "rocm" if "rocm" in device.client.platform_version.lower() else "cuda"
    return device.platform


def _impl(*flat: Any, platforms, branches, default) -> Any:
    # Eagerly: the implementation for the arrays' platform, evaluated op by op (each op's
    # program compiled once a shape and kept). Compiling the equation as one program instead
    # compiled it on every call, since every bind traces its jaxprs anew: an eager forward of a
    # 4-layer decoder took 0.49 s a call that way, every call.
    chosen = dict(zip(platforms, branches, strict=True)).get(_platform_of(flat), default)
    return jaxpr_as_fun(chosen)(*flat)[0]


def _lowering(ctx, *flat, platforms, branches, default, platform: str | None):
    chosen = dict(zip(platforms, branches, strict=True)).get(platform, default)
    fn = lambda *f: jaxpr_as_fun(chosen)(*f)[0]
    return mlir.lower_fun(fn, multiple_results=False)(ctx, *flat)


def _batch(values, dims, *, platforms, branches, default):
    """vmap: the same choice of implementations, each `vmap`ped (batched activations alone
    keep one call into each kernel: its leading axes take any batch)."""
    axes = tuple(dims)

    def mapped(jaxpr) -> Callable:
        fn = lambda *f: jaxpr_as_fun(jaxpr)(*f)[0]
        return lambda *flat: jax.vmap(fn, in_axes=axes)(*flat)

    rules = {p: mapped(b) for p, b in zip(platforms, branches, strict=True)}
    return by_platform(tuple(values), rules, mapped(default)), 0


def _jvp(primals, tangents, *, platforms, branches, default):
    """The kernels' value, the default implementation's derivative."""
    out = by_platform_p.bind(*primals, platforms=platforms, branches=branches, default=default)
    tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
    _, tangent = jax.jvp(lambda *f: jaxpr_as_fun(default)(*f)[0], tuple(primals), tangents)
    return out, tangent


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
ad.primitive_jvps[by_platform_p] = _jvp
