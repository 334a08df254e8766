"""Orthogonal Hadamard-like rotations of the last axis, for any size with a power-of-two factor.

A rotation ``x ↦ x H`` by an orthogonal ``H`` changes no dot product (``(xH)·(yH) = x·y``) but
spreads a few outlier channels over all of them, which is what makes low-bit activations,
weights and KV caches work after QuaRot-style rotations. This module builds one such ``H`` of
every even size ``n = 2^k · m`` (m odd) and applies it in ``O(n log n)`` (sizes up to
`DENSE_UP_TO`: one dense product, faster there):

    H = (M ⊗ S) / sqrt(rows(S)),

with ``S`` the Sylvester (Walsh–Hadamard) matrix of order ``2^j`` applied as a fast butterfly,
and ``M`` a fixed orthogonal matrix for the rest:

  * a normalized Hadamard matrix of order ``4m`` when a Paley construction gives one (12, 20,
    28, 36, ... : SmolLM2's 576 = 36 · 16 and 1536 = 12 · 128 are both exact Hadamard
    matrices, every entry ``±1 / sqrt(n)``);
  * else the orthonormal DCT-II of order ``m`` (deterministic; flattens outliers less evenly);
  * nothing (``M = [1]``) for a power of two.

``H`` is orthogonal but symmetric only for a power of two: `hadamard_transform` with
``inverse=True`` applies ``Hᵀ``. `hadamard_matrix` gives the dense matrix, for offline
rotations of weights and for tests.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np


def split_size(n: int) -> tuple[int, int]:
    """``(m, p)`` with ``n = m · p``: `p` the power of two the butterfly covers, `m` the size
    of the fixed factor (1, an order-4k Hadamard matrix, or the odd part).

    Raises:
      ValueError: for `n` < 1 or an odd `n` > 1 (no power-of-two factor to rotate with).
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"a Hadamard rotation needs a positive size, got {n!r}")
    p = n & -n  # largest power of two dividing n
    m = n // p
    if m == 1:
        return 1, n
    if p == 1:
        raise ValueError(
            f"a Hadamard rotation of size {n} needs a power-of-two factor (n = 2^k · m, k >= 1); "
            "pad the axis to an even size or leave it unrotated"
        )
    if p >= 4 and _paley(4 * m) is not None:
        return 4 * m, p // 4
    return m, p


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, math.isqrt(q) + 1))


def _jacobsthal(q: int) -> np.ndarray:
    """``Q[i, j] = χ(j - i)`` over GF(q), χ the quadratic character (q prime)."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = np.array([0] + [1 if d in squares else -1 for d in range(1, q)], np.int64)
    idx = (np.arange(q)[None, :] - np.arange(q)[:, None]) % q
    return chi[idx]


@functools.cache
def _paley(order: int) -> np.ndarray | None:
    """A ``±1`` Hadamard matrix of `order` from Paley's constructions over a prime field, or
    None when neither applies (order 4k: q = order - 1 ≡ 3 mod 4, or q = order / 2 - 1 ≡ 1
    mod 4)."""
    q = order - 1
    if _is_prime(q) and q % 4 == 3:
        jac = _jacobsthal(q)
        s = np.zeros((order, order), np.int64)
        s[0, 1:] = 1
        s[1:, 0] = -1
        s[1:, 1:] = jac
        return s + np.eye(order, dtype=np.int64)
    q = order // 2 - 1
    if order % 2 == 0 and _is_prime(q) and q % 4 == 1:
        c = np.zeros((q + 1, q + 1), np.int64)
        c[0, 1:] = 1
        c[1:, 0] = 1
        c[1:, 1:] = _jacobsthal(q)
        plus = np.array([[1, -1], [-1, -1]], np.int64)
        minus = np.array([[1, 1], [1, -1]], np.int64)
        return np.kron(c, plus) + np.kron(np.eye(q + 1, dtype=np.int64), minus)
    return None


def _dct(m: int) -> np.ndarray:
    """The orthonormal DCT-II matrix of order `m`, rows as basis vectors: ``[m, m]``."""
    k = np.arange(m)[:, None]
    i = np.arange(m)[None, :]
    d = np.cos(np.pi * (2 * i + 1) * k / (2 * m)) * np.sqrt(2.0 / m)
    d[0] /= np.sqrt(2.0)
    return d


@functools.cache
def _factor(m: int) -> np.ndarray:
    """The orthonormal ``[m, m]`` factor `M` (float64)."""
    if m == 1:
        return np.ones((1, 1))
    h = _paley(m) if m % 4 == 0 else None
    if h is not None:
        return h / np.sqrt(m)
    return _dct(m)


def _sylvester(p: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < p:
        h = np.block([[h, h], [h, -h]])
    return h


@functools.cache
def _dense(n: int) -> np.ndarray:
    m, p = split_size(n)
    return np.kron(_factor(m), _sylvester(p) / np.sqrt(p))


def hadamard_matrix(n: int, dtype: np.dtype | type = np.float32) -> np.ndarray:
    """The ``[n, n]`` orthogonal matrix `hadamard_transform` multiplies by (``x ↦ x H``).

    Raises:
      ValueError: for an `n` without a power-of-two factor (see `split_size`).
    """
    return _dense(n).astype(dtype)


# Up to this size one dense product beats the butterfly's log2(n) passes of small XLA ops
# (a KV cache's head_dim of 64 or 128: one product per decoded token and head).
DENSE_UP_TO = 128


def _butterfly(x: jax.Array) -> jax.Array:
    """Unnormalized Walsh–Hadamard transform of the last axis (a power of two): ``log2 p``
    passes of sums and differences, each over ``p`` elements."""
    p = x.shape[-1]
    lead = x.shape[:-1]
    half = 1
    while half < p:
        y = x.reshape(*lead, p // (2 * half), 2, half)
        a, b = y[..., 0, :], y[..., 1, :]
        x = jnp.stack([a + b, a - b], axis=-2).reshape(*lead, p)
        half *= 2
    return x


def hadamard_transform(x: jax.Array, *, inverse: bool = False) -> jax.Array:
    """``x H`` (or ``x Hᵀ`` with `inverse`) along the last axis, `H` = `hadamard_matrix`.

    Args:
      x: ``[..., n]`` float, ``n = 2^k · m`` with ``k >= 1`` (or n = 1). Works under `jit`.
      inverse: multiply by ``Hᵀ = H⁻¹`` instead.
    Returns:
      ``[..., n]`` in `x`'s dtype (computed in float32, or float64 for float64 input).
    Raises:
      ValueError: for a last axis without a power-of-two factor.
    """
    n = x.shape[-1]
    m, p = split_size(n)
    dtype = x.dtype
    work = jnp.float64 if dtype == jnp.float64 else jnp.float32
    if n <= DENSE_UP_TO:
        h = _dense(n).T if inverse else _dense(n)
        return jnp.matmul(x.astype(work), jnp.asarray(h, work)).astype(dtype)
    y = x.astype(work).reshape(*x.shape[:-1], m, p)
    if m > 1:
        # H = M ⊗ S / sqrt(p): for x indexed (a, b), (x H)[c, d] = Σ_ab x[a, b] M[a, c] S[b, d].
        factor = _factor(m)
        factor = factor.T if inverse else factor
        y = jnp.einsum("...ab,ac->...cb", y, jnp.asarray(factor, work))
    if p > 1:
        y = _butterfly(y) * jnp.asarray(1.0 / math.sqrt(p), work)
    return y.reshape(x.shape).astype(dtype)
