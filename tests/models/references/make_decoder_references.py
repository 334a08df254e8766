"""Record llama.cpp's outputs for every tiny GGUF decoder (see `tests/models/tiny_gguf.py`).

Run from the repository root with an environment that has llama-cpp-python:

    PYTHONPATH=. python tests/models/references/make_decoder_references.py

For each architecture it writes the tiny GGUF to a temporary directory, evaluates `PROMPT`
(24 tokens) in one batch, keeps the last position's logits, then decodes 32 tokens greedily,
feeding each argmax token back through llama.cpp's KV cache one at a time. Results go to
`decoders.npz` (keys `{arch}/prompt`, `{arch}/logits`, `{arch}/greedy`, `{arch}/sha256`) and
`decoders.json` (llama.cpp version, date, settings) next to this script.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
# tiny_gguf lives one directory up; the tests import it the same way (as a top-level module).
sys.path.insert(0, str(HERE.parent))

from tiny_gguf import ARCHITECTURES, bos_token_id, write_tiny_gguf  # noqa: E402

N_GREEDY = 32
N_CTX = 128
# Byte-ish token ids after BOS: varied, and all present in both tiny vocabularies.
_BODY = [
    72,
    101,
    108,
    108,
    111,
    44,
    32,
    119,
    111,
    114,
    108,
    100,
    33,
    32,
    84,
    105,
    110,
    121,
    32,
    109,
    111,
    100,
    101,
]


def prompt_for(arch: str) -> list[int]:
    """The fixed 24-token prompt: the architecture's BOS then 23 fixed ids."""
    return [bos_token_id(arch)] + _BODY


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_llama_cpp(path: Path, prompt: list[int], n_greedy: int = N_GREEDY):
    """(last-position logits [vocab] float32, greedy tokens [n_greedy] int32) from llama.cpp."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=N_CTX,
        n_batch=N_CTX,
        n_threads=2,
        n_threads_batch=2,
        logits_all=True,
        # float32 KV cache and no flash attention: llama.cpp then computes in float32 throughout.
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
        flash_attn=False,
        seed=0,
        verbose=False,
    )
    try:
        llm.reset()
        llm.eval(prompt)
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        greedy = []
        for _ in range(n_greedy):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            greedy.append(tok)
            llm.eval([tok])
        return logits, np.asarray(greedy, dtype=np.int32)
    finally:
        llm.close()


def main(archs: list[str]) -> None:
    """Record every architecture (all of them: the npz is rewritten whole)."""
    import llama_cpp

    out: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            path = write_tiny_gguf(arch, Path(tmp) / f"{arch}.gguf")
            prompt = prompt_for(arch)
            logits, greedy = run_llama_cpp(path, prompt)
            top2 = np.sort(logits)[-2:]
            print(
                f"{arch:9s} logits std {logits.std():.3f} top gap {top2[1] - top2[0]:.4f} "
                f"greedy {greedy.tolist()} ({len(set(greedy.tolist()))} distinct)"
            )
            out[f"{arch}/prompt"] = np.asarray(prompt, dtype=np.int32)
            out[f"{arch}/logits"] = logits
            out[f"{arch}/greedy"] = greedy
            out[f"{arch}/sha256"] = np.asarray(sha256_of(path))
    np.savez(HERE / "decoders.npz", **out)
    meta = {
        "llama_cpp_python": llama_cpp.__version__,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "n_ctx": N_CTX,
        "n_threads": 2,
        "kv_cache": "f32",
        "flash_attn": False,
        "n_greedy": N_GREEDY,
        "architectures": archs,
    }
    (HERE / "decoders.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main(list(ARCHITECTURES))
