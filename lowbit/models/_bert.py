"""A plain float BERT encoder (all-MiniLM-L6-v2) in Flax NNX.

Post-norm Transformer encoder as in Hugging Face's `BertModel`, without the pooler (sentence
embeddings mean-pool the last hidden states instead). Like `Decoder`, weights are read only
through standard `flax.nnx` layers and the forward pass is plain `jnp` code, so a quantization
engine that swaps weight arrays can run it unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from lowbit.models._abstract import LayerStack

# Hugging Face's `hidden_act` names of the feed-forward activations BERT checkpoints use.
ACTIVATIONS = {
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class BertConfig:
    """Hyper-parameters of a BERT encoder; defaults are all-MiniLM-L6-v2's.

    `activation` is the feed-forward's, by its Hugging Face ``hidden_act`` name: ``"gelu"``
    (exact, erf), ``"gelu_new"`` / ``"gelu_pytorch_tanh"`` (tanh approximation) or ``"relu"``.
    """

    vocab_size: int = 30522
    dim: int = 384
    n_layers: int = 6
    n_heads: int = 12
    activation: str = "gelu"
    ffn_dim: int = 1536
    max_positions: int = 512
    type_vocab_size: int = 2
    norm_eps: float = 1e-12

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"BertConfig.activation is {self.activation!r}; accepted: {sorted(ACTIVATIONS)}"
            )
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not a multiple of n_heads={self.n_heads}")

    @property
    def head_dim(self) -> int:
        """Features per attention head."""
        return self.dim // self.n_heads


def _layer_norm(config: BertConfig, **kw: Any) -> nnx.LayerNorm:
    # The two-pass variance: the one-pass form loses digits that a 1e-12 epsilon cannot hide.
    return nnx.LayerNorm(config.dim, epsilon=config.norm_eps, use_fast_variance=False, **kw)


class Embeddings(nnx.Module):
    """Word + position + token-type embeddings, then LayerNorm."""

    def __init__(self, config: BertConfig, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.word = nnx.Embed(config.vocab_size, config.dim, **kw)
        self.position = nnx.Embed(config.max_positions, config.dim, **kw)
        self.token_type = nnx.Embed(config.type_vocab_size, config.dim, **kw)
        self.norm = _layer_norm(config, **kw)

    def __call__(self, tokens: jax.Array, token_types: jax.Array) -> jax.Array:
        """tokens, token_types: ``[batch, seq]`` int32 -> ``[batch, seq, dim]``."""
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
        x = self.word(tokens) + self.position(positions) + self.token_type(token_types)
        return self.norm(x)


class SelfAttention(nnx.Module):
    """Multi-head self-attention with a key padding mask."""

    def __init__(self, config: BertConfig, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
        self.config = config
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.query = nnx.Linear(config.dim, config.dim, **kw)
        self.key = nnx.Linear(config.dim, config.dim, **kw)
        self.value = nnx.Linear(config.dim, config.dim, **kw)
        self.out = nnx.Linear(config.dim, config.dim, **kw)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        """x: ``[batch, seq, dim]``; mask: ``[batch, seq]`` bool, True for real tokens."""
        c = self.config
        b, s, _ = x.shape
        q = self.query(x).reshape(b, s, c.n_heads, c.head_dim)
        k = self.key(x).reshape(b, s, c.n_heads, c.head_dim)
        v = self.value(x).reshape(b, s, c.n_heads, c.head_dim)
        scores = jnp.einsum("bshd,bthd->bhst", q, k).astype(jnp.float32)
        scores = scores / jnp.sqrt(jnp.float32(c.head_dim))
        scores = jnp.where(mask[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        out = jnp.einsum("bhst,bthd->bshd", probs, v).reshape(b, s, c.dim)
        return self.out(out)


class MLP(nnx.Module):
    """Feed-forward: ``down(act(up(x)))``, `act` the config's (exact GELU by default)."""

    def __init__(self, config: BertConfig, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.activation = config.activation
        self.up = nnx.Linear(config.dim, config.ffn_dim, **kw)
        self.down = nnx.Linear(config.ffn_dim, config.dim, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: ``[batch, seq, dim]`` -> ``[batch, seq, dim]``."""
        return self.down(ACTIVATIONS[self.activation](self.up(x)))


class EncoderLayer(nnx.Module):
    """Post-norm encoder layer: ``norm(x + attn(x))`` then ``norm(x + mlp(x))``."""

    def __init__(self, config: BertConfig, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.attn = SelfAttention(config, **kw)
        self.attn_norm = _layer_norm(config, **kw)
        self.mlp = MLP(config, **kw)
        self.mlp_norm = _layer_norm(config, **kw)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        """x: ``[batch, seq, dim]``; mask: ``[batch, seq]`` bool."""
        x = self.attn_norm(x + self.attn(x, mask))
        return self.mlp_norm(x + self.mlp(x))


class Bert(LayerStack):
    """BERT encoder returning the last hidden states.

    Parameter paths read like ``layers/2/attn/query/kernel``; kernels are
    ``[in_features, out_features]``.
    """

    Layer = EncoderLayer

    def build_input(self, config: BertConfig, **kw: Any) -> None:
        self.embeddings = Embeddings(config, **kw)

    def __call__(
        self,
        tokens: jax.Array,
        attention_mask: jax.Array | None = None,
        token_types: jax.Array | None = None,
    ) -> jax.Array:
        """Hidden states ``[batch, seq, dim]``.

        Args:
          tokens: ``[batch, seq]`` int32 WordPiece ids.
          attention_mask: ``[batch, seq]``, nonzero/True for real tokens, zero for padding;
            default all real.
          token_types: ``[batch, seq]`` int32 segment ids; default all 0.
        """
        if attention_mask is None:
            mask = jnp.ones(tokens.shape, bool)
        else:
            mask = attention_mask.astype(bool)
        if token_types is None:
            token_types = jnp.zeros_like(tokens)
        x = self.embeddings(tokens, token_types)
        for layer in self.layers:
            x = layer(x, mask)
        return x


def mean_pool(hidden: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """Mean over real tokens, then L2-normalised: ``[batch, seq, dim]`` -> ``[batch, dim]``.

    attention_mask: ``[batch, seq]``, nonzero for real tokens.
    """
    m = attention_mask.astype(jnp.float32)[..., None]
    summed = jnp.sum(hidden.astype(jnp.float32) * m, axis=1)
    # Same clamps as sentence-transformers, so an all-padding row gives zeros, not NaN.
    pooled = summed / jnp.maximum(jnp.sum(m, axis=1), 1e-9)
    norm = jnp.linalg.norm(pooled, axis=-1, keepdims=True)
    return pooled / jnp.maximum(norm, 1e-12)
