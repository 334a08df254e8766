"""The tiny model's next-token logits computed outside the server (one full forward pass, no
KV cache), for independent checks of what the server reports and samples."""

import jax.numpy as jnp
import numpy as np


def answer_logits(loaded, prompt, ids):
    """``[len(ids), V]`` float64: row i holds the logits of the token after ``prompt +
    ids[:i]`` (the model is causal: one pass over ``prompt + ids`` gives every row)."""
    tokens = list(prompt) + list(ids)
    logits = loaded.model(jnp.asarray([tokens], jnp.int32))
    return np.asarray(logits[0, len(prompt) - 1 : len(tokens) - 1], np.float64)


def log_softmax(logits):
    """Along the last axis."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
