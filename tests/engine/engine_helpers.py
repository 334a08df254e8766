"""Shared helpers for the engine tests: compiled quantization and jaxpr inspection."""

import functools

import jax

from lowbit.engine import _compat
from lowbit.qarray import quantize


@functools.partial(jax.jit, static_argnames=("fmt", "granularity", "symmetric", "activation"))
def jit_quantize(x, fmt, granularity, symmetric=True, activation=None):
    """`quantize` compiled once per configuration (eager quantization dispatches op by op)."""
    import dataclasses

    q = quantize(x, fmt, granularity=granularity, symmetric=symmetric)
    return dataclasses.replace(q, activation=activation)


def all_eqns(closed_jaxpr):
    """Every equation of a jaxpr and of its sub-jaxprs, depth first."""
    jaxpr, _ = _compat.parts(_compat.closed(closed_jaxpr))
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if isinstance(sub, _compat.ClosedJaxpr | _compat.Jaxpr):
                    yield from all_eqns(sub)


def _dequantize_tree(tree):
    from lowbit.qarray import QArray

    is_q = lambda v: isinstance(v, QArray)
    return jax.tree.map(lambda v: v.dequantize() if is_q(v) else v, tree, is_leaf=is_q)


jit_dequantize = jax.jit(_dequantize_tree)
"""Every QArray leaf of a pytree dequantized (compiled: eager unpacking dispatches op by op)."""
