"""Shared test support: jitted encode/decode per format and cheap hypothesis strategies.

Each format's encode/decode is jitted once and reused (eager dispatch would compile every
primitive separately and dominate the runtime). Arrays are built by NumPy from a few drawn
parameters (seed, magnitude, distribution), which keeps each of the 200 examples cheap while
still covering zeros, ties, constant blocks and outliers.
"""

import functools

import hypothesis.extra.numpy as hnp
import jax
import numpy as np
from hypothesis import strategies as st

from lowbit.formats import Format, get_format

KINDS = ("normal", "uniform", "integers", "halves", "constant", "outlier", "sparse")


def jit(fn):
    """`jax.jit` for test-sized inputs: compile time dominates, so skip backend optimisation
    (LLVM -O0 leaves the HLO, and so the arithmetic, unchanged)."""
    return jax.jit(fn, compiler_options={"xla_backend_optimization_level": 0})


def _element(name: str) -> Format:
    # Block formats encode and decode with their element: share its compiled functions.
    fmt = get_format(name)
    return getattr(fmt, "element", fmt)


def encoder(name: str):
    return _jit_encode(_element(name))


def decoder(name: str):
    return _jit_decode(_element(name))


@functools.cache
def _jit_encode(fmt: Format):
    return jit(fmt.encode)


@functools.cache
def _jit_decode(fmt: Format):
    return jit(fmt.decode)


@functools.cache
def round_trip(fmt: Format):
    """Jitted (codes, y) → (decode(codes), encode(decode(codes)), decode(encode(y)))."""

    def run(codes, y):
        values = fmt.decode(codes)
        return values, fmt.encode(values), fmt.decode(fmt.encode(y))

    return jit(run)


def round_trip_for(name: str):
    return round_trip(_element(name))


def make_array(seed: int, log2_scale: int, kind: str, shape) -> np.ndarray:
    """A float32 array of `shape` with values of magnitude ~2**log2_scale."""
    rng = np.random.default_rng(seed)
    scale = 2.0**log2_scale
    if kind == "normal":
        x = rng.standard_normal(shape) * scale
    elif kind == "uniform":
        x = rng.uniform(-scale, scale, shape)
    elif kind == "integers":
        x = rng.integers(-8, 9, shape) * scale / 8
    elif kind == "halves":  # exact ties for integer rounding
        x = (rng.integers(-16, 17, shape) + 0.5) * scale / 16
    elif kind == "constant":
        x = np.full(shape, rng.standard_normal() * scale)
    elif kind == "outlier":
        x = rng.standard_normal(shape) * scale
        x.flat[rng.integers(x.size)] *= 1000.0
    else:  # sparse: mostly exact zeros
        x = rng.standard_normal(shape) * scale * (rng.uniform(size=shape) < 0.2)
    return x.astype(np.float32)


def arrays(shape, log2_range=(-8, 8)):
    """Strategy for float32 arrays of `shape` built by `make_array`."""
    return st.builds(
        make_array,
        seed=st.integers(0, 2**32 - 1),
        log2_scale=st.integers(*log2_range),
        kind=st.sampled_from(KINDS),
        shape=st.just(shape),
    )


def special_floats(size: int = 4):
    """Strategy for a few arbitrary float32 values (±Inf, subnormals, huge), no NaN."""
    return hnp.arrays(np.float32, size, elements=st.floats(allow_nan=False, width=32))
