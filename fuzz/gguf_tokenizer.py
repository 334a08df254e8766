"""Fuzzes the tokenizer built from GGUF ``tokenizer.ggml.*`` metadata
(`lowbit.models.tokenizer_from_gguf`, `special_token_ids`), then encodes and decodes text.

The input drives a structured generator (`atheris.FuzzedDataProvider`): the vocabulary model
and pre-tokenizer names, tokens (SmolLM2's first ones, edited, or arbitrary strings), token
types, scores, merges, special-token ids and flags, as a hostile GGUF file could hold them,
values of the wrong type included. Contract: a `ValueError` naming a ``tokenizer.ggml`` key,
or a tokenizer that encodes text to ids inside its vocabulary and decodes them.
"""

from __future__ import annotations

from fuzz._contract import documented, main
from fuzz._seeds import tokenizer_seeds

seeds = tokenizer_seeds  # what `python -m fuzz` starts the corpus from

_MODELS = ("llama", "gpt2", "bert", "")
_PRES = ("smollm", "llama3", "qwen2", "gpt2", "default", "starcoder", "unknown-pre")
_BASE: list[str] = []
_BASE_MERGES: list[str] = []


def _load():
    global atheris, special_token_ids, tokenizer_from_gguf
    import atheris

    from lowbit.models import special_token_ids, tokenizer_from_gguf

    _BASE.extend(["<unk>", "<s>", "</s>", "<0x41>", "▁", "▁a", "a", "b", "ab", "Ġ", "Ġa", "ĠĠ"])
    _BASE.extend(["h", "e", "l", "o", "he", "ll", "hell", "hello", "<|im_start|>"])
    _BASE_MERGES.extend(["a b", "h e", "l l", "he ll", "hell o", "Ġ a", "Ġ Ġ"])


def _value(fdp, make):
    """A value as `make` draws it, or now and then one of the wrong type."""
    choice = fdp.ConsumeIntInRange(0, 15)
    if choice == 0:
        return fdp.ConsumeUnicodeNoSurrogates(4)
    if choice == 1:
        return fdp.ConsumeInt(8)
    return make()


def _metadata(data: bytes) -> tuple[dict, str]:
    fdp = atheris.FuzzedDataProvider(data)
    n = fdp.ConsumeIntInRange(0, 40)
    tokens = []
    for i in range(n):
        if fdp.ConsumeBool():
            tokens.append(_BASE[i % len(_BASE)])
        else:
            tokens.append(fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 6)))
    meta: dict = {
        "tokenizer.ggml.model": fdp.PickValueInList(list(_MODELS))
        if fdp.ConsumeBool()
        else fdp.ConsumeUnicodeNoSurrogates(6),
        "tokenizer.ggml.tokens": tokens,
    }
    if fdp.ConsumeBool():
        meta["tokenizer.ggml.pre"] = fdp.PickValueInList(list(_PRES))
    if fdp.ConsumeBool():
        meta["tokenizer.ggml.token_type"] = [
            _value(fdp, lambda: fdp.ConsumeIntInRange(0, 7))
            for _ in range(fdp.ConsumeIntInRange(0, n + 1))
        ]
    if fdp.ConsumeBool():
        meta["tokenizer.ggml.scores"] = [
            _value(fdp, lambda: fdp.ConsumeRegularFloat())
            for _ in range(fdp.ConsumeIntInRange(0, n + 1))
        ]
    if fdp.ConsumeBool():
        meta["tokenizer.ggml.merges"] = [
            fdp.PickValueInList(_BASE_MERGES)
            if fdp.ConsumeBool()
            else fdp.ConsumeUnicodeNoSurrogates(5)
            for _ in range(fdp.ConsumeIntInRange(0, 12))
        ]
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        if fdp.ConsumeBool():
            meta[f"tokenizer.ggml.{key}"] = _value(fdp, lambda: fdp.ConsumeIntInRange(-2, n + 2))
    for key in ("add_bos_token", "add_eos_token", "add_space_prefix"):
        if fdp.ConsumeBool():
            meta[f"tokenizer.ggml.{key}"] = _value(fdp, fdp.ConsumeBool)
    if fdp.ConsumeBool():
        meta["general.name"] = fdp.PickValueInList(["phi-3 mini", "smollm2", ""])
    return meta, fdp.ConsumeUnicodeNoSurrogates(64)


def test_one(data: bytes) -> None:
    meta, text = _metadata(data)
    with documented((ValueError,), "tokenizer.ggml"):
        special_token_ids(meta)
        tok = tokenizer_from_gguf(meta)
        ids = tok.encode(text).ids
        n = len(meta["tokenizer.ggml.tokens"])
        assert all(0 <= i < n for i in ids), (ids, n)
        tok.decode(ids)


if __name__ == "__main__":
    main(test_one, _load)
