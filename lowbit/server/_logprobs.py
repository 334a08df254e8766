"""Log-probabilities of sampled tokens: computed in the compiled programs (`token_logprobs`)
and handed to the HTTP side per token (`TokenLogprob`).

They are the model's own distribution, ``log_softmax`` of the raw logits, before temperature,
top-k, top-p and penalties (as vLLM reports them by default), whatever drew the token.

Shapes: ``b`` rows, ``V`` vocabulary, ``K`` = `MAX_LOGPROBS` (or ``V`` when smaller).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.server._protocol import MAX_LOGPROBS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """Attributes (leading dimensions ``[...]``: rows, and steps in a decode call):
    chosen: ``[...]`` float32, the sampled token's log-probability.
    top_values: ``[..., K]`` float32, the `K` largest log-probabilities, largest first.
    top_ids: ``[..., K]`` int32, their token ids.
    """

    chosen: jax.Array
    top_values: jax.Array
    top_ids: jax.Array


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> TokenLogprobs:
    """``logits [b, V]`` and the sampled ``tokens [b]`` -> their `TokenLogprobs` ``[b]``."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    values, ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, logprobs.shape[-1]))
    return TokenLogprobs(chosen, values, ids.astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One sampled token's log-probability and its `top` alternatives ``(token id,
    log-probability)``, largest first (as many as the request asked for)."""

    logprob: float
    top: tuple[tuple[int, float], ...]


def host_logprobs(arrays: TokenLogprobs, row: int, count: int, top: int) -> list[TokenLogprob]:
    """Row `row`'s first `count` tokens' `TokenLogprob`, `top` alternatives each, from
    `TokenLogprobs` fetched to the host with a steps axis (``chosen [b, S]``)."""
    chosen = np.asarray(arrays.chosen)[row]
    values = np.asarray(arrays.top_values)[row]
    ids = np.asarray(arrays.top_ids)[row]
    return [
        TokenLogprob(
            float(chosen[i]),
            tuple((int(t), float(v)) for t, v in zip(ids[i, :top], values[i, :top], strict=True)),
        )
        for i in range(count)
    ]
