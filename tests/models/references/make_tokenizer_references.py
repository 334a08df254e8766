"""Regenerate the GGUF tokenizer fixtures and llama.cpp's expected tokenization of them.

Run from the repository root with an environment that has ``llama_cpp``, ``gguf`` and
``tokenizers`` (never a test dependency)::

    python tests/models/references/make_tokenizer_references.py           # references only
    python tests/models/references/make_tokenizer_references.py --retrain # vocabs too

``tokenizer_vocabs.json`` holds small vocabularies as GGUF ``tokenizer.ggml.*`` metadata: an
SPM-style one (``llama`` model: scores, byte tokens, control tokens), the same named as Phi-3
(llama.cpp strips whitespace after its special tokens), and three byte-level BPE ones (``gpt2``
model with ``pre`` = llama-bpe, qwen2, smollm). They were trained with the
`tokenizers` library on the repository's docs, so they look like real vocabularies (merges
learned from text, holes that force byte fallback for CJK and emoji). ``--retrain`` rebuilds
them; training need not be reproducible because the file is stored.

``tokenizer_references.json`` holds, for each vocab and each of `TEXTS` (plus one text per
vocab with its special tokens written inline): llama.cpp's ids with and without BOS
(``tokenize(text, add_bos=..., special=True)``), the concatenated token pieces
(``token_to_piece``, special tokens rendered empty), and llama-cpp-python's ``detokenize``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import pathlib
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[2]
VOCABS = HERE / "tokenizer_vocabs.json"
REFERENCES = HERE / "tokenizer_references.json"

TEXTS = [
    "Hello world",
    "Héllo señor, über café! naïve façade, Ærøskøbing",
    "日本語のテキストと中文字符，한국어",
    "emoji 🤖, family 👨‍👩‍👧, flag 🇫🇷, thumbs 👍🏽 ok",
    "numbers 1234567890 and 3.14159 and 1,000,000 and 42",
    "def f(x):\n\treturn x**2\n\n\n    if x:\n        pass  # comment\n",
    "   leading spaces and  double  spaces   ",
    "\n\nnewlines first\r\nthen CRLF",
    "it's I'M we'LL they'd You'Re",
    "a\tb\t\tc  \t d",
    "",
]

# Special tokens per vocab: (text, ggml token type); 3 = control, 4 = user-defined.
_SPM_SPECIALS = [("<start_of_turn>", 3), ("<end_of_turn>", 3), ("<tool>", 4)]
_LLAMA3_SPECIALS = [
    ("<|begin_of_text|>", 3),
    ("<|end_of_text|>", 3),
    ("<|start_header_id|>", 3),
    ("<|end_header_id|>", 3),
    ("<|eot_id|>", 3),
]
_QWEN2_SPECIALS = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3)]
_SMOLLM_SPECIALS = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3)]

SPECIAL_TEXTS = {
    "spm": "<start_of_turn>user\nHi <tool>there<end_of_turn>\n<start_of_turn>model\n",
    "llama-bpe": "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>",
    "qwen2": "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "smollm": "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "spm-phi3": "<start_of_turn>user\n  Hi <tool>  there<end_of_turn>\n\n<|endoftext|> x </s>  y",
}


def _training_text() -> list[str]:
    files = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "lowbit" / "eval" / "sentences.txt"]
    files += sorted((ROOT / "lowbit" / "models").glob("*.py"))[:6]
    return [line for f in files for line in f.read_text(encoding="utf-8").splitlines(True)]


def _train_spm(lines: list[str]) -> dict:
    """A SentencePiece-BPE-like vocab: <unk>,<s>,</s>, 256 byte tokens, specials, pieces."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=2000, limit_alphabet=120, show_progress=False)
    tok.train_from_iterator(lines, trainer)
    model = json.loads(tok.to_str())["model"]
    merged = ["".join(m if isinstance(m, list) else m.split(" ")) for m in model["merges"]]
    alphabet = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    alphabet = [t for t in alphabet if len(t) == 1]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    tokens += [t for t, _ in _SPM_SPECIALS]
    types += [k for _, k in _SPM_SPECIALS]
    scores = [0.0] * len(tokens)
    # SentencePiece BPE scores: learned pieces rank by merge order, single characters last.
    pieces = list(dict.fromkeys(merged + alphabet))
    tokens += pieces
    types += [1] * len(pieces)
    scores += [-float(i) for i in range(len(pieces))]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": (
            "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
            "{{ raise_exception('System role not supported') }}{% endif %}"
            "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else "
            "message['role']) + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
        ),
    }


def _phi3_variant(spm: dict) -> dict:
    """The SPM vocab named as Phi-3, whose special tokens llama.cpp strips whitespace after."""
    md = dict(spm)
    md["general.name"] = "Phi-3 Mini 4k Instruct"
    # llama.cpp's Phi-3 rule looks <|endoftext|> up and fails to load a vocab without it.
    md["tokenizer.ggml.tokens"] = [*spm["tokenizer.ggml.tokens"], "<|endoftext|>"]
    md["tokenizer.ggml.token_type"] = [*spm["tokenizer.ggml.token_type"], 3]
    md["tokenizer.ggml.scores"] = [*spm["tokenizer.ggml.scores"], 0.0]
    return md


def _train_byte_level(lines: list[str]) -> tuple[list[str], list[str]]:
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(lines, vocab_size=1500, show_progress=False)
    model = json.loads(tok._tokenizer.to_str())["model"]
    vocab = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return vocab, merges


def _byte_level_vocab(vocab, merges, pre, specials, bos, eos, add_bos, template) -> dict:
    tokens = list(vocab) + [t for t, _ in specials]
    types = [1] * len(vocab) + [k for _, k in specials]
    ids = {t: i for i, t in enumerate(tokens)}
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": list(merges),
        "tokenizer.ggml.bos_token_id": ids[bos],
        "tokenizer.ggml.eos_token_id": ids[eos],
        "tokenizer.chat_template": template,
    }
    if add_bos is not None:
        md["tokenizer.ggml.add_bos_token"] = add_bos
    return md


_CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)


def retrain() -> dict:
    lines = _training_text()
    vocab, merges = _train_byte_level(lines)
    return {
        "spm": _train_spm(lines),
        # Llama 3 GGUFs carry no add_bos_token; llama.cpp adds BOS for the llama-bpe family.
        "llama-bpe": _byte_level_vocab(
            vocab,
            merges,
            "llama-bpe",
            _LLAMA3_SPECIALS,
            "<|begin_of_text|>",
            "<|eot_id|>",
            None,
            _LLAMA3,
        ),
        "qwen2": _byte_level_vocab(
            vocab, merges, "qwen2", _QWEN2_SPECIALS, "<|endoftext|>", "<|im_end|>", False, _CHATML
        ),
        "smollm": _byte_level_vocab(
            vocab,
            merges,
            "smollm",
            _SMOLLM_SPECIALS,
            "<|im_start|>",
            "<|im_end|>",
            False,
            _CHATML,
        ),
    }


def write_gguf(path: pathlib.Path, metadata: dict) -> None:
    """A vocab-only GGUF llama.cpp can load (arch ``llama``, tiny hyperparameters)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    if "general.name" in metadata:
        w.add_name(metadata["general.name"])
    w.add_tokenizer_model(metadata["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in metadata:
        w.add_tokenizer_pre(metadata["tokenizer.ggml.pre"])
    w.add_token_list(metadata["tokenizer.ggml.tokens"])
    w.add_token_types(metadata["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.scores" in metadata:
        w.add_token_scores(metadata["tokenizer.ggml.scores"])
    if "tokenizer.ggml.merges" in metadata:
        w.add_token_merges(metadata["tokenizer.ggml.merges"])
    w.add_bos_token_id(metadata["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(metadata["tokenizer.ggml.eos_token_id"])
    if "tokenizer.ggml.unknown_token_id" in metadata:
        w.add_unk_token_id(metadata["tokenizer.ggml.unknown_token_id"])
    if "tokenizer.ggml.add_bos_token" in metadata:
        w.add_add_bos_token(metadata["tokenizer.ggml.add_bos_token"])
    if "tokenizer.ggml.add_eos_token" in metadata:
        w.add_add_eos_token(metadata["tokenizer.ggml.add_eos_token"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def pieces(llm, ids: list[int]) -> str:
    """llama.cpp's ``token_to_piece`` for each id (special tokens empty), concatenated."""
    import llama_cpp

    out = b""
    buf = (ctypes.c_char * 256)()
    for t in ids:
        n = llama_cpp.llama_token_to_piece(llm._model.vocab, t, buf, 256, 0, False)
        out += bytes(buf[:n])
    return out.decode("utf-8", errors="replace")


def llama_cpp_cases(path: pathlib.Path, texts: list[str]) -> list[dict]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    cases = []
    for text in texts:
        ids = llm.tokenize(text.encode(), add_bos=True, special=True)
        cases.append(
            {
                "text": text,
                "ids": ids,
                "ids_no_bos": llm.tokenize(text.encode(), add_bos=False, special=True),
                "pieces": pieces(llm, ids),
                "detokenized": llm.detokenize(ids).decode("utf-8", errors="replace"),
            }
        )
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--retrain", action="store_true", help="retrain the fixture vocabs")
    args = parser.parse_args()
    vocabs = retrain() if args.retrain else json.loads(VOCABS.read_text(encoding="utf-8"))
    vocabs.setdefault("spm-phi3", _phi3_variant(vocabs["spm"]))
    VOCABS.write_text(json.dumps(vocabs, ensure_ascii=False) + "\n", encoding="utf-8")
    refs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, md in vocabs.items():
            path = pathlib.Path(tmp) / f"{name}.gguf"
            write_gguf(path, md)
            refs[name] = llama_cpp_cases(path, TEXTS + [SPECIAL_TEXTS[name]])
    REFERENCES.write_text(json.dumps(refs, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {REFERENCES.relative_to(ROOT)} ({sum(len(c) for c in refs.values())} cases)")


if __name__ == "__main__":
    main()
