"""Shared helpers for the ops tests: random inputs, tolerance bounds, jaxpr walking."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lowbit.qarray import QArray, quantize

EPS32 = float(np.finfo(np.float32).eps)


def normal(seed: int, shape, dtype=jnp.float32) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


# One compile per (shape, config) instead of one per primitive in eager mode.
jit_quantize = jax.jit(
    quantize, static_argnums=(1,), static_argnames=("granularity", "symmetric", "pack")
)


def weight(w: jax.Array, config, activation=None, bounds=None, **overrides) -> QArray:
    q = jit_quantize(w, config, **overrides)
    return dataclasses.replace(q, activation=activation, activation_bounds=bounds)


def summation_bound(lhs_abs: jax.Array, rhs_abs: jax.Array, dims, contracted: int) -> np.ndarray:
    """Elementwise bound on the difference of two float32 evaluations of the same product.

    Each evaluation of a sum of K products is within gamma_K * sum |a||b| of the exact value
    (gamma_K ~ K eps); two evaluations (in different orders, with scales applied before or
    after) differ by at most twice that, plus a few roundings of the scale products.
    """
    mag = lax.dot_general(lhs_abs, rhs_abs, dims, precision=lax.Precision.HIGHEST)
    return np.asarray((2 * contracted + 8) * EPS32 * mag + 1e-30)


def iter_eqns(jaxpr):
    """Every equation of a (closed) jaxpr, recursing into sub-jaxprs."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    yield from iter_eqns(sub)


def int_dots(jaxpr):
    """dot_general / ragged / conv equations reading int8 operands with int32 accumulation."""
    names = ("dot_general", "ragged_dot_general", "conv_general_dilated")
    found = []
    for eqn in iter_eqns(jaxpr):
        if eqn.primitive.name not in names:
            continue
        dtypes = [v.aval.dtype for v in eqn.invars[:2]]
        if (
            all(d == jnp.int8 for d in dtypes)
            and eqn.params.get("preferred_element_type") == jnp.int32
        ):
            found.append(eqn)
    return found
