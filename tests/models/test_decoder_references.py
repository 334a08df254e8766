"""Every architecture against llama.cpp: the tiny random-weight GGUF files of `tiny_gguf`, read
by `load_decoder_gguf`, give llama.cpp's last-token logits (cosine >= 0.9999) and its 32
greedy tokens through the KV cache.

The references (``references/decoders.npz``) were made by llama-cpp-python in the benchmark
environment (``references/make_decoder_references.py``); with llama_cpp importable, the
stored values are checked against a fresh run by ``test_tiny_gguf.py``.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from tiny_gguf import ARCHITECTURES, write_tiny_gguf

from lowbit.models import generate_tokens, load_decoder_gguf

REFERENCES = Path(__file__).parent / "references" / "decoders.npz"
# llama.cpp's CPU GELU reads a float16 table (Gemma's logits move by up to 1e-2); the rest
# agree to float32 rounding.
ATOL = {"gemma": 2e-2, "gemma2": 2e-2, "gemma3": 2e-2}


@functools.cache
def _references():
    return np.load(REFERENCES)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_and_greedy_tokens_match_llama_cpp(arch, tiny_dir):
    refs = _references()
    path = write_tiny_gguf(arch, tiny_dir / f"{arch}.gguf")
    model, tokenizer = load_decoder_gguf(path)
    prompt = refs[f"{arch}/prompt"]
    logits = np.asarray(model(jnp.asarray(prompt[None])))[0, -1]
    want = refs[f"{arch}/logits"]
    cosine = float(logits @ want / np.linalg.norm(logits) / np.linalg.norm(want))
    assert cosine >= 0.9999, cosine
    np.testing.assert_allclose(logits, want, atol=ATOL.get(arch, 1e-3))
    greedy = generate_tokens(model, [prompt.tolist()], max_new_tokens=32, stop_ids=())
    assert greedy.tokens[0] == refs[f"{arch}/greedy"].tolist()
    assert tokenizer is not None
