"""Small models shared by the API tests (imported by the test modules)."""

import functools

import jax
import jax.numpy as jnp
from flax import linen, nnx


@functools.partial(jax.jit, static_argnums=(1, 2))
def init(key, shape, dtype=jnp.float32):
    """Scaled normal init, compiled once per shape (Flax's default initializers run eagerly
    op by op, which dominates the runtime of these small tests)."""
    return jax.random.normal(key, shape, dtype) / jnp.sqrt(shape[0]).astype(dtype)


def linear(a, b, *, rngs, **kwargs):
    return nnx.Linear(a, b, kernel_init=init, rngs=rngs, **kwargs)


class MLP(nnx.Module):
    def __init__(self, sizes, *, rngs):
        self.layers = nnx.List(
            [linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:], strict=True)]
        )

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


class LinenMLP(linen.Module):
    hidden: int = 128
    out: int = 32

    @linen.compact
    def __call__(self, x, negate: bool = False):
        x = jax.nn.relu(linen.Dense(self.hidden, kernel_init=init)(x))
        y = linen.Dense(self.out, kernel_init=init)(x)
        return -y if negate else y  # a Python flag: must stay static under jit


class Block(nnx.Module):
    """A pre-norm transformer block: causal multi-head attention (einsum) and a gated MLP."""

    def __init__(self, dim=64, heads=4, hidden=128, *, rngs):
        self.heads = heads
        self.norm1 = nnx.RMSNorm(dim, rngs=rngs)
        self.q = linear(dim, dim, use_bias=False, rngs=rngs)
        self.k = linear(dim, dim, use_bias=False, rngs=rngs)
        self.v = linear(dim, dim, use_bias=False, rngs=rngs)
        self.o = linear(dim, dim, use_bias=False, rngs=rngs)
        self.norm2 = nnx.RMSNorm(dim, rngs=rngs)
        self.gate = linear(dim, hidden, use_bias=False, rngs=rngs)
        self.up = linear(dim, hidden, use_bias=False, rngs=rngs)
        self.down = linear(hidden, dim, use_bias=False, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        h = self.norm1(x)
        split = lambda y: y.reshape(b, t, self.heads, d // self.heads)
        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        scores = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(d // self.heads)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
        attn = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)
        x = x + self.o(attn.reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


def rel_error(y, ref):
    return float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
