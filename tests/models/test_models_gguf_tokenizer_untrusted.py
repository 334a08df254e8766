"""`tokenizer_from_gguf` on metadata a hostile GGUF file can hold: a `ValueError` naming the
``tokenizer.ggml`` key, never another exception (inputs minimised from the fuzz harness
``fuzz/gguf_tokenizer.py``)."""

from __future__ import annotations

import pytest

from lowbit.models import special_token_ids, tokenizer_from_gguf

BASE = {
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": "gpt2",
    "tokenizer.ggml.tokens": ["a", "b", "ab"],
    "tokenizer.ggml.merges": ["a b"],
}


@pytest.mark.parametrize(
    "change, fragment",
    [
        (
            {"tokenizer.ggml.bos_token_id": "佘㭯"},
            "tokenizer.ggml.bos_token_id is '佘㭯', not a token",
        ),
        ({"tokenizer.ggml.eos_token_id": True}, "tokenizer.ggml.eos_token_id is True"),
        ({"tokenizer.ggml.tokens": ["a", 7]}, r"tokenizer.ggml.tokens\[1\] is 7, not a string"),
        ({"tokenizer.ggml.tokens": "ab"}, "tokenizer.ggml.tokens is str 'ab', not a list"),
        ({"tokenizer.ggml.token_type": [1, "x", 1]}, r"token_type\[1\] is 'x'"),
        ({"tokenizer.ggml.merges": [3]}, r"tokenizer.ggml.merges\[0\] is 3, not a merge"),
        (
            {"tokenizer.ggml.merges": ["ab"]},
            r"tokenizer.ggml.merges\[0\] is 'ab', not 'left right'",
        ),
        (
            {"tokenizer.ggml.merges": ["h e"]},
            r"merges\[0\] .*needs 'h', which tokenizer.ggml.tokens",
        ),
        ({"tokenizer.ggml.pre": ["gpt2"]}, "tokenizer.ggml.pre is \\['gpt2'\\]"),
        ({"tokenizer.ggml.add_bos_token": 1}, "tokenizer.ggml.add_bos_token is 1; accepted"),
        ({"tokenizer.ggml.model": {}}, "tokenizer.ggml.model is {}"),
    ],
)
def test_hostile_metadata_is_a_value_error_naming_the_key(change, fragment):
    with pytest.raises(ValueError, match=fragment):
        special_token_ids({**BASE, **change})
        tokenizer_from_gguf({**BASE, **change})


def test_llama_scores_must_be_numbers():
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "a"],
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0, "x"],
    }
    with pytest.raises(ValueError, match=r"tokenizer.ggml.scores\[3\] is 'x'"):
        tokenizer_from_gguf(meta)


def test_special_tokens_whose_text_reads_as_template_syntax_still_work():
    meta = {
        **BASE,
        "tokenizer.ggml.tokens": ["a:1", "b", "$A"],
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": True,
    }
    encoding = tokenizer_from_gguf(meta).encode("b")
    assert encoding.ids == [0, 1, 2] and encoding.tokens == ["a:1", "b", "$A"]
