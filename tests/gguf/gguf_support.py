"""Shared GGUF test data: the block types by what their encoders promise, and test weights."""

import numpy as np

from lowbit.gguf import BLOCK_TYPES

TYPES = sorted(BLOCK_TYPES)
# Types `gguf.quants` can also encode (llama.cpp's simple reference quantizers).
GGUF_ENCODES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "TQ1_0", "TQ2_0")
# Types whose encoder gives decoded blocks back byte for byte (beyond the simple ones gguf
# also encodes): Q8_K keeps a decoded block's own scale, the K-quants with mins re-fit
# decoded values exactly. Every type gives decoded values back exactly (Q3_K and Q6_K not
# always in the same bytes: `test_k_quants_re_encode_decoded_blocks`).
BYTE_STABLE = (*GGUF_ENCODES, "IQ4_NL", "Q2_K", "Q4_K", "Q5_K", "Q8_K")


def weights(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Gaussian rows of varied scale, with a zero row, a constant row and a negative one."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x *= np.exp(rng.standard_normal((rows, 1))).astype(np.float32)
    x[0] = 0.0
    x[1] = 0.75
    x[2] = -np.abs(x[2])
    return x
