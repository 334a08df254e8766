"""The tiny model's next-token logits computed outside the server (one full forward pass, no
KV cache), for independent checks of what the server reports and samples."""

import jax.numpy as jnp
import numpy as np


def next_logits(loaded, ids):
    """``[V]`` float64 logits of the token after `ids`."""
    logits = loaded.model(jnp.asarray([list(ids)], jnp.int32))
    return np.asarray(logits[0, -1], np.float64)


def log_softmax(logits):
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())
