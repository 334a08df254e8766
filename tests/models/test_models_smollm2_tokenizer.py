"""The byte-level BPE tokenizer built from SmolLM2's GGUF metadata."""

from __future__ import annotations

import pytest

from lowbit import models


@pytest.fixture(scope="module")
def tok(smollm2_file):
    return models.tokenizer_from_gguf(smollm2_file.metadata)


@pytest.mark.parametrize(
    "text",
    [
        "Hello world! It's 2024, isn't it?",
        "  leading spaces, trailing spaces  ",
        "line one\n\nline two\ttabbed\r\n",
        "Ünïcödé: 日本語, emoji 🤖, math ∑ x²",
        "def f(x):\n    return x ** 2  # comment",
        "",
    ],
)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_pretokenizer_matches_smollm_family(tok):
    # Digits are split one by one before the GPT-2 regex; words carry their leading space.
    assert tok.encode("It costs 1234").tokens == ["It", "Ġcosts", "Ġ", "1", "2", "3", "4"]
    assert tok.encode("Hello world").ids == [19556, 905]


def test_special_tokens_are_atomic(tok, smollm2_file):
    md = smollm2_file.metadata
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids[0] == md["tokenizer.ggml.bos_token_id"] == 1
    assert ids[-1] == md["tokenizer.ggml.eos_token_id"] == 2
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert tok.get_vocab_size() == 49152


def test_chat_prompt_follows_the_stored_template(smollm2_file):
    template = smollm2_file.metadata["tokenizer.chat_template"]
    prompt = models.chat_prompt("Hi there")
    assert models._tokenizer.SMOLLM2_DEFAULT_SYSTEM in template
    assert "'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'" in (
        template
    )
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    sys_first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert models.chat_prompt(sys_first, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )
    with pytest.raises(ValueError, match="messages"):
        models.chat_prompt([])


def test_rejects_unknown_tokenizer_kind(smollm2_file):
    md = dict(smollm2_file.metadata, **{"tokenizer.ggml.model": "llama"})
    with pytest.raises(ValueError, match="'llama'"):
        models.tokenizer_from_gguf(md)
