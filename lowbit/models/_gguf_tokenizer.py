"""`tokenizers.Tokenizer`s rebuilt from GGUF ``tokenizer.ggml.*`` metadata, as llama.cpp reads it.

Two vocabulary kinds (``tokenizer.ggml.model``) are reproduced:

- ``llama``: SentencePiece BPE (Llama 2, Mistral, Gemma, Phi-3). Spaces become ``▁``, a ``▁``
  is prepended to each run of text (``tokenizer.ggml.add_space_prefix``, default true; llama.cpp
  prepends it again after every special token), pieces merge highest score first, and
  characters outside the vocab fall back to ``<0xNN>`` byte tokens. The library's BPE model does
  this when its merges are every ``(left, right)`` split of a vocab piece, ranked by the score of
  the piece.
- ``gpt2``: byte-level BPE (Llama 3, Qwen2/2.5/3, SmolLM, GPT-2) with the pre-tokenizer regexes
  llama.cpp selects by ``tokenizer.ggml.pre``.

Control, unknown and user-defined tokens are matched whole in input text, as llama.cpp does with
``parse_special``. Control and unknown ones are "special" (dropped by ``decode`` by default,
which llama.cpp renders as empty); user-defined ones decode to their text.

llama.cpp keys one behaviour on the model's name: for files whose ``general.name`` contains
``phi-3``/``phi3``, whitespace after a special token (but ``<unk>``, ``<s>``,
``<|endoftext|>``) is dropped; so is it here. Not reproduced: that rule on non-ASCII whitespace
(llama.cpp keeps a no-break or ideographic space there, this drops it); llama.cpp's order
between two different pieces of exactly equal score (trained vocabs give each piece its own
score); unused tokens (type 5) decode to their text where llama.cpp renders nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

# ggml token types (`tokenizer.ggml.token_type`).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_SPACE = "▁"  # SentencePiece's visible space

# llama.cpp's pre-tokenizer regexes, applied in order (each splits the pieces of the one before;
# text no regex matches stays a piece of its own). The contractions are spelled out
# case-insensitively because llama.cpp's regex engine has no inline flags.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclasses.dataclass(frozen=True)
class _PreTokenizer:
    regexes: tuple[str, ...]
    add_bos: bool  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token
    ignore_merges: bool  # a pre-token that is a whole vocab entry is emitted as is


_GPT2_FAMILY = _PreTokenizer((_GPT2,), add_bos=False, ignore_merges=False)
_DIGITS_FAMILY = _PreTokenizer((r"\p{N}", _GPT2), add_bos=False, ignore_merges=False)
_LLAMA3_FAMILY = _PreTokenizer((_LLAMA3,), add_bos=True, ignore_merges=True)
_QWEN2_FAMILY = _PreTokenizer((_QWEN2,), add_bos=False, ignore_merges=False)

# `tokenizer.ggml.pre` values and the llama.cpp pre-tokenizer each one names.
PRE_TOKENIZERS: Mapping[str, _PreTokenizer] = {
    **dict.fromkeys(("gpt2", "mpt", "olmo", "jais"), _GPT2_FAMILY),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell"), _DIGITS_FAMILY),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral"), _LLAMA3_FAMILY
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), _QWEN2_FAMILY),
}
MODEL_KINDS = ("llama", "gpt2")

# Texts of tokens that end a chat turn, for files that do not name them in
# tokenizer.ggml.eot_token_id (llama.cpp stops on the same ones).
END_OF_TURN_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
    }
)


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """A GGUF vocab's special token ids and BOS/EOS policy, as llama.cpp resolves them.

    Attributes:
      bos, eos, eot, unk, pad: token ids, or None when the file names none.
      add_bos, add_eos: whether ``encode`` (with special tokens) adds BOS first / EOS last.
      end_of_generation: ids that end generation: EOS, EOT/EOM, and every control or
        user-defined token whose text is a known end-of-turn marker (``<|eot_id|>``,
        ``<|im_end|>``, ``<end_of_turn>``, ``<|end|>``, ...), ascending.
    """

    bos: int | None
    eos: int | None
    eot: int | None
    unk: int | None
    pad: int | None
    add_bos: bool
    add_eos: bool
    end_of_generation: tuple[int, ...]


def _kind(metadata: Mapping[str, Any]) -> str:
    kind = metadata.get("tokenizer.ggml.model")
    if kind not in MODEL_KINDS:
        raise ValueError(
            f"tokenizer.ggml.model is {kind!r}; supported tokenizer models are "
            f"{', '.join(MODEL_KINDS)} (SentencePiece BPE and byte-level BPE)"
        )
    return kind


def _pre(metadata: Mapping[str, Any]) -> _PreTokenizer:
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if not isinstance(pre, str) or pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"tokenizer.ggml.pre is {pre!r}, a pre-tokenizer lowbit does not reproduce; "
            f"supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    return PRE_TOKENIZERS[pre]


def _list(metadata: Mapping[str, Any], key: str, kinds: tuple[type, ...], what: str) -> list:
    """The list at `key` (absent: empty), every entry one of `kinds` (bools are not numbers).

    Raises:
      ValueError: naming the key and the first entry that is not `what`.
    """
    value = metadata.get(key, [])
    if not isinstance(value, list | tuple):
        raise ValueError(f"{key} is {type(value).__name__} {value!r:.80}, not a list of {what}")
    # The types present, found at C speed (vocabularies are long); the entry that fails is
    # looked for only when one does.
    if not set(map(type, value)) <= set(kinds):
        for i, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, kinds):
                raise ValueError(f"{key}[{i}] is {item!r:.80}, not {what}")
    return list(value)


def _flag(metadata: Mapping[str, Any], key: str, default: bool) -> bool:
    value = metadata.get(f"tokenizer.ggml.{key}", default)
    if not isinstance(value, bool):
        raise ValueError(f"tokenizer.ggml.{key} is {value!r:.80}; accepted: true or false")
    return value


def _tokens(metadata: Mapping[str, Any]) -> list[str]:
    return _list(metadata, "tokenizer.ggml.tokens", (str,), "a string")


def _types(metadata: Mapping[str, Any], tokens: list[str]) -> list[int]:
    if "tokenizer.ggml.token_type" not in metadata:
        return [NORMAL] * len(tokens)
    types = _list(metadata, "tokenizer.ggml.token_type", (int,), "an integer token type")
    if len(types) != len(tokens):
        raise ValueError(
            f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    return types


def _required(metadata: Mapping[str, Any], key: str, kind: str) -> None:
    if key not in metadata:
        raise ValueError(f"tokenizer.ggml.model {kind!r} needs {key}, which the file lacks")


def _id(metadata: Mapping[str, Any], key: str, default: int | None, n: int) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{key}", default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"tokenizer.ggml.{key} is {value!r:.80}, not a token id")
    if value is None or value < 0:
        return None
    if int(value) >= n:
        raise ValueError(f"tokenizer.ggml.{key} is {value}, outside the {n}-token vocab")
    return int(value)


def special_token_ids(metadata: Mapping[str, Any]) -> SpecialTokens:
    """The special token ids and BOS/EOS policy of a GGUF vocab (see `SpecialTokens`).

    Defaults follow llama.cpp: SentencePiece vocabs add BOS and use ids 1/2/0 for BOS/EOS/UNK
    when the file does not say; byte-level ones add BOS only for the Llama 3 pre-tokenizer
    family. ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` override both.
    """
    kind = _kind(metadata)
    tokens = _tokens(metadata)
    types = _types(metadata, tokens)
    n = len(tokens)
    spm = kind == "llama"
    add_bos = _flag(metadata, "add_bos_token", spm or _pre(metadata).add_bos)
    add_eos = _flag(metadata, "add_eos_token", False)
    bos = _id(metadata, "bos_token_id", 1 if spm else None, n)
    eos = _id(metadata, "eos_token_id", 2 if spm else None, n)
    eot = _id(metadata, "eot_token_id", None, n)
    eom = _id(metadata, "eom_token_id", None, n)
    if add_bos and bos is None:
        raise ValueError("tokenizer.ggml.add_bos_token is set but bos_token_id is missing")
    if add_eos and eos is None:
        raise ValueError("tokenizer.ggml.add_eos_token is set but eos_token_id is missing")
    stops = {i for i in (eos, eot, eom) if i is not None}
    stops |= {
        i
        for i, (text, t) in enumerate(zip(tokens, types, strict=True))
        if t in (CONTROL, USER_DEFINED) and text in END_OF_TURN_TEXTS
    }
    return SpecialTokens(
        bos=bos,
        eos=eos,
        eot=eot,
        unk=_id(metadata, "unknown_token_id", 0 if spm else None, n),
        pad=_id(metadata, "padding_token_id", None, n),
        add_bos=add_bos,
        add_eos=add_eos,
        end_of_generation=tuple(sorted(stops)),
    )


def _spm_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]):
    """Every split of each mergeable piece into two vocab pieces, best piece score first.

    llama.cpp's SentencePiece tokenizer repeatedly joins the adjacent pair whose concatenation
    is in the vocab with the highest score; a BPE merge list with these ranks does the same.
    """
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, (text, t) in enumerate(zip(tokens, types, strict=True)):
        if t not in (NORMAL, UNUSED) or len(text) < 2:
            continue
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _spm_tokenizer(metadata: Mapping[str, Any], tokens: list[str], types: list[int]) -> Tokenizer:
    _required(metadata, "tokenizer.ggml.scores", "llama")
    scores = [float(s) for s in _list(metadata, "tokenizer.ggml.scores", (int, float), "a score")]
    if len(scores) != len(tokens):
        raise ValueError(
            f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens"
        )
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
    merges = _spm_merges(tokens, scores, types)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=True))
    space_prefix = _flag(metadata, "add_space_prefix", True)
    # The library applies the normalizer to each run of text between special tokens, so the
    # prefix "▁" lands at the start and after every special token, as in llama.cpp.
    steps = [normalizers.Prepend(_SPACE)] if space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
    # Decoding drops the prefix space again (llama.cpp's detokenizer after BOS does too).
    strip = [decoders.Strip(" ", 1, 0)] if space_prefix else []
    tok.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return tok


def _bpe_tokenizer(metadata: Mapping[str, Any], tokens: list[str]) -> Tokenizer:
    pre = _pre(metadata)
    _required(metadata, "tokenizer.ggml.merges", "gpt2")
    texts = _list(metadata, "tokenizer.ggml.merges", (str,), "a merge")
    merges = [tuple(merge.split(" ", 1)) for merge in texts]
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
    # Every merge checked at once; the first bad one is looked for only when there is one.
    pairs_ok = all(len(pair) == 2 for pair in merges)
    if (
        not pairs_ok
        or not ({t for pair in merges for t in pair} | {left + right for left, right in merges})
        <= vocab.keys()
    ):
        for i, (merge, pair) in enumerate(zip(texts, merges, strict=True)):
            if len(pair) != 2:
                raise ValueError(f"tokenizer.ggml.merges[{i}] is {merge!r:.80}, not 'left right'")
            left, right = pair
            missing = next((t for t in (left, right, left + right) if t not in vocab), None)
            if missing is not None:
                raise ValueError(
                    f"tokenizer.ggml.merges[{i}] ({left} {right!r:.80}) needs {missing!r:.80}, "
                    "which tokenizer.ggml.tokens lacks"
                )
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre.ignore_merges,
        )
    )
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    tok.decoder = decoders.ByteLevel()
    return tok


def _rstrip_after(metadata: Mapping[str, Any]):
    """Whether llama.cpp drops the whitespace after a special token (by its text)."""
    name = str(metadata.get("general.name", "")).lower()
    if "phi-3" in name or "phi3" in name:
        return lambda text: text not in ("<unk>", "<s>", "<|endoftext|>")
    return lambda text: False


def _post_processor(tokens: list[str], special: SpecialTokens):
    """BOS/EOS around the text as llama.cpp adds them; None when it adds neither."""
    bos = [special.bos] if special.add_bos else []
    eos = [special.eos] if special.add_eos else []
    if not bos and not eos:
        return None
    names = {i: _template_name(tokens[i], i) for i in bos + eos}
    single = [names[i] for i in bos] + ["$A"] + [names[i] for i in eos]
    return processors.TemplateProcessing(
        single=single,
        pair=single + ["$B:1"],
        special_tokens=[
            {"id": name, "ids": [i], "tokens": [tokens[i]]} for i, name in sorted(names.items())
        ],
    )


def _template_name(text: str, i: int) -> str:
    """How a template refers to token `i`: its text, unless the template syntax would read
    that as something else (``$A`` sequences, ``name:type_id`` pairs)."""
    if text and ":" not in text and not text.startswith("$"):
        return text
    return f"<special token {i}>"


def tokenizer_from_gguf(metadata: Mapping[str, Any]) -> Tokenizer:
    """Build a `tokenizers.Tokenizer` from GGUF ``tokenizer.ggml.*`` metadata.

    ``tok.encode(text).ids`` equals llama.cpp's ``tokenize(text, add_bos=True, special=True)``
    (BOS/EOS added as the file says, see `special_token_ids`); with
    ``add_special_tokens=False`` the same without them. ``tok.decode(ids)`` gives the text of
    llama.cpp's token pieces (control tokens render as nothing; ``skip_special_tokens=False``
    keeps their text). For SentencePiece vocabs with a space prefix, one leading space is
    dropped, as llama.cpp's detokenizer does after BOS, so ``decode(encode(text))`` is
    ``text`` when no special token is written in it (llama.cpp adds a "▁" after each one).

    Raises:
      ValueError: for a ``tokenizer.ggml.model`` or ``tokenizer.ggml.pre`` lowbit does not
        reproduce (the message lists the supported ones), or missing/inconsistent fields.
    """
    kind = _kind(metadata)
    _required(metadata, "tokenizer.ggml.tokens", kind)
    tokens = _tokens(metadata)
    types = _types(metadata, tokens)
    special = special_token_ids(metadata)
    tok = (
        _spm_tokenizer(metadata, tokens, types)
        if kind == "llama"
        else _bpe_tokenizer(metadata, tokens)
    )
    # (Their ids are the GGUF ones: every added text is already in the model's vocab.)
    rstrip = _rstrip_after(metadata)
    tok.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False, rstrip=rstrip(tokens[i]))
            for i, t in enumerate(types)
            if t in (CONTROL, UNKNOWN)
        ]
    )
    tok.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False, rstrip=rstrip(tokens[i]))
            for i, t in enumerate(types)
            if t == USER_DEFINED
        ]
    )
    post = _post_processor(tokens, special)
    if post is not None:
        tok.post_processor = post
    return tok
