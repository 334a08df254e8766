"""Tiny random-weight GGUF decoders, one per architecture llama.cpp runs.

Each file is laid out as llama.cpp's Hugging Face converter would write that architecture:
its `general.architecture`, its `{arch}.*` hyper-parameter keys, its tensor names and shapes,
and the converter's own transforms of the Hugging Face weights (the LLAMA architecture's
query/key row permutation, Gemma's `1 + w` norm weights, Llama 3.1's `rope_freqs` factors,
Phi-3's fused projections as stored by Phi-3 itself). Weights are float32, so llama.cpp
computes in float32 and its outputs serve as references.

Shapes are tiny (width 64, 4 query heads, 2 key/value heads of 16, FFN 128, a 260- or 262-token
vocabulary) and every byte follows from `(arch, seed)`: the same call writes the same file.
Only numpy and gguf are needed, so both the test and the reference environments import it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

ARCHITECTURES: tuple[str, ...] = (
    "llama",
    "llama3",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3",
    "phi3",
    "mixtral",
    "qwen2moe",
    "qwen3moe",
)

N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2
HEAD_DIM = N_EMBD // N_HEAD
N_FF = 128
N_CTX_TRAIN = 256
N_EXPERT = 4
N_EXPERT_USED = 2
N_FF_EXP = 64
N_FF_SHEXP = 96
SLIDING_WINDOW = 8


@dataclass(frozen=True)
class _Spec:
    """How one test architecture maps onto a llama.cpp architecture and its options."""

    gguf_arch: str  # general.architecture
    n_layer: int
    rope_base: float
    rms_eps: float
    tokenizer: str  # "llama" (SentencePiece) or "gpt2" (byte-level BPE)
    permute_qk: bool = False  # the LLAMA converter interleaves q/k rows for NORM rope
    qkv_bias: bool = False
    qk_norm: bool = False
    gemma_norms: bool = False  # Gemma stores RMSNorm weights as 1 + w
    post_norms: bool = False  # Gemma 2/3: post-attention and post-FFN norms
    tied_output: bool = False
    fused_qkv: bool = False  # Phi-3
    llama3_rope: bool = False
    n_expert: int = 0
    shared_expert: bool = False


_SPECS: dict[str, _Spec] = {
    "llama": _Spec("llama", 2, 10000.0, 1e-5, "llama", permute_qk=True),
    "llama3": _Spec("llama", 2, 500000.0, 1e-5, "gpt2", permute_qk=True, llama3_rope=True),
    "mistral": _Spec("llama", 2, 1000000.0, 1e-5, "llama", permute_qk=True),
    "qwen2": _Spec("qwen2", 2, 1000000.0, 1e-6, "gpt2", qkv_bias=True, tied_output=True),
    "qwen3": _Spec("qwen3", 2, 1000000.0, 1e-6, "gpt2", qk_norm=True, tied_output=True),
    "gemma": _Spec("gemma", 2, 10000.0, 1e-6, "llama", gemma_norms=True, tied_output=True),
    "gemma2": _Spec(
        "gemma2", 3, 10000.0, 1e-6, "llama", gemma_norms=True, post_norms=True, tied_output=True
    ),
    "gemma3": _Spec(
        "gemma3",
        6,
        1000000.0,
        1e-6,
        "llama",
        gemma_norms=True,
        post_norms=True,
        qk_norm=True,
        tied_output=True,
    ),
    "phi3": _Spec("phi3", 2, 10000.0, 1e-5, "llama", fused_qkv=True),
    "mixtral": _Spec("llama", 2, 1000000.0, 1e-5, "llama", permute_qk=True, n_expert=N_EXPERT),
    "qwen2moe": _Spec(
        "qwen2moe",
        2,
        1000000.0,
        1e-6,
        "gpt2",
        qkv_bias=True,
        n_expert=N_EXPERT,
        shared_expert=True,
    ),
    "qwen3moe": _Spec("qwen3moe", 2, 1000000.0, 1e-6, "gpt2", qk_norm=True, n_expert=N_EXPERT),
}

# Gemma 2's softcaps as its Hugging Face config states them.
GEMMA2_ATTN_SOFTCAP = 50.0
GEMMA2_FINAL_SOFTCAP = 30.0
# Llama 3.1's rope_scaling block; with head_dim 16 and base 5e5 it gives factors of 1, a
# smooth in-between one and 8, so all three branches of the factor formula occur.
LLAMA3_ROPE_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# Phi-3 mini's config carries a sliding window that the converter writes and llama.cpp
# ignores (it disables SWA for Phi-3): larger than any test context here.
PHI3_SLIDING_WINDOW = 2047


# Per-architecture stream offsets, picked (by a search over float64 greedy decodes) so that the
# default files decode 32 varied tokens whose top-two logits stay at least 0.02 apart (0.03
# for the Gemma family, whose GELU llama.cpp evaluates through a float16 table, off by up to
# about 0.01 in the logits): a faithful float32 implementation then reproduces every token.
_STREAM: dict[str, int] = {
    "llama3": 2,
    "qwen3": 3,
    "phi3": 1,
    "gemma": 1,
    "gemma2": 2,
    "gemma3": 4,
    "qwen2moe": 2,
    "qwen3moe": 4,
}


def _arch_rng(arch: str, seed: int) -> np.random.Generator:
    # crc32, not hash(): str hashes change between interpreter runs.
    return np.random.default_rng([seed, zlib.crc32(arch.encode()), _STREAM.get(arch, 0)])


def _permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face rows (per head: first half, second half) -> llama.cpp rows interleaved.

    Row `h*D + 2i` of the result is HF row `h*D + i`, row `h*D + 2i + 1` is HF row
    `h*D + D/2 + i`: llama.cpp's NORM rope then rotates adjacent pairs where HF rotates halves.
    """
    rows, cols = w.shape
    d = rows // n_head
    return w.reshape(n_head, 2, d // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def llama3_rope_factors(base: float, head_dim: int, scaling: dict) -> np.ndarray:
    """[head_dim/2] float32 divisors of the rotary frequencies (llama.cpp `rope_freqs`)."""
    freqs = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    old_ctx = scaling["original_max_position_embeddings"]
    lo, hi, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < old_ctx / hi:
            out.append(1.0)
        elif wavelen > old_ctx / lo:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - lo) / (hi - lo)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies store)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


# Token ids the tests use as BOS/EOS, per tokenizer kind.
SPM_BOS, SPM_EOS = 1, 2
GPT2_BOS, GPT2_EOS = 257, 258


def _spm_tokens() -> list[str]:
    # <unk> <s> </s>, the 256 byte-fallback tokens, one word piece, and the two control tokens
    # llama.cpp's vocabulary loader looks up by text for Phi-3 (it fails without them): 262.
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    return ["<unk>", "<s>", "</s>", *bytes_, "\u2581", "<|endoftext|>", "<|end|>"]


def _gpt2_tokens() -> list[str]:
    # The 256 byte tokens, one merge result, three control tokens: 260.
    table = _bytes_to_unicode()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
    return [table[b] for b in range(256)] + ["\u0120t", *specials]


def _vocab_size(kind: str) -> int:
    return len(_spm_tokens() if kind == "llama" else _gpt2_tokens())


def _add_tokenizer(w: gguf.GGUFWriter, kind: str, gguf_arch: str) -> None:
    normal, control, byte, unknown = (
        int(gguf.TokenType.NORMAL),
        int(gguf.TokenType.CONTROL),
        int(gguf.TokenType.BYTE),
        int(gguf.TokenType.UNKNOWN),
    )
    if kind == "llama":
        tokens = _spm_tokens()
        types = [unknown, control, control] + [byte] * 256 + [normal, control, control]
        scores = [0.0] * 259 + [-1.0, 0.0, 0.0]
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(SPM_BOS)
        w.add_eos_token_id(SPM_EOS)
        w.add_unk_token_id(0)
    else:
        tokens = _gpt2_tokens()
        types = [normal] * 257 + [control] * 3
        w.add_tokenizer_model("gpt2")
        # What the converter writes for these families (llama.cpp and lowbit both read it).
        w.add_tokenizer_pre("llama-bpe" if gguf_arch == "llama" else "qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(["\u0120 t"])
        w.add_bos_token_id(GPT2_BOS)
        w.add_eos_token_id(GPT2_EOS)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if gguf_arch.startswith("gemma"):
        w.add_add_space_prefix(False)


def _tensors(spec: _Spec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array in numpy order ([out, in] for matrices)."""

    def mat(n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        return rng.standard_normal((n_out, n_in)) * (gain / np.sqrt(n_in))

    def norm(n: int, centre: float = 1.0) -> np.ndarray:
        """RMSNorm weights near `centre`, as stored in the file."""
        if spec.gemma_norms:
            # Gemma's RMSNorm multiplies by (1 + w) and HF stores w; the converter adds the 1.
            w_hf = centre - 1.0 + rng.standard_normal(n) * 0.1
            return w_hf + 1.0
        return centre + rng.standard_normal(n) * 0.1

    q_out, kv_out = N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM
    t: dict[str, np.ndarray] = {}
    if spec.llama3_rope:
        t["rope_freqs.weight"] = llama3_rope_factors(spec.rope_base, HEAD_DIM, LLAMA3_ROPE_SCALING)
    # Tied outputs read logits off the embeddings: small embeddings keep a token's own row
    # from dominating the residual stream (greedy decoding would then repeat the input).
    n_vocab = _vocab_size(spec.tokenizer)
    t["token_embd.weight"] = rng.standard_normal((n_vocab, N_EMBD)) * (
        0.05 if spec.tied_output else 1.0
    )
    for il in range(spec.n_layer):
        p = f"blk.{il}."
        t[p + "attn_norm.weight"] = norm(N_EMBD)
        if spec.fused_qkv:
            # Phi-3's own qkv_proj: rows [q | k | v].
            t[p + "attn_qkv.weight"] = mat(q_out + 2 * kv_out, N_EMBD, 1.5)
        else:
            wq, wk = mat(q_out, N_EMBD, 1.5), mat(kv_out, N_EMBD, 1.5)
            if spec.permute_qk:
                wq, wk = _permute_qk(wq, N_HEAD), _permute_qk(wk, N_HEAD_KV)
            t[p + "attn_q.weight"] = wq
            t[p + "attn_k.weight"] = wk
            t[p + "attn_v.weight"] = mat(kv_out, N_EMBD)
            if spec.qkv_bias:
                t[p + "attn_q.bias"] = rng.standard_normal(q_out) * 0.2
                t[p + "attn_k.bias"] = rng.standard_normal(kv_out) * 0.2
                t[p + "attn_v.bias"] = rng.standard_normal(kv_out) * 0.2
        if spec.qk_norm:
            # q/k norms fix |q|, |k|; weights near 2 keep attention from being near-uniform.
            t[p + "attn_q_norm.weight"] = norm(HEAD_DIM, 2.0)
            t[p + "attn_k_norm.weight"] = norm(HEAD_DIM, 2.0)
        t[p + "attn_output.weight"] = mat(N_EMBD, q_out, 2.0)
        if spec.post_norms:
            t[p + "post_attention_norm.weight"] = norm(N_EMBD)
        t[p + "ffn_norm.weight"] = norm(N_EMBD)
        if spec.n_expert:
            n_ff = N_FF_EXP if spec.gguf_arch != "llama" else N_FF
            t[p + "ffn_gate_inp.weight"] = mat(spec.n_expert, N_EMBD, 2.0)
            t[p + "ffn_gate_exps.weight"] = np.stack([mat(n_ff, N_EMBD) for _ in range(N_EXPERT)])
            t[p + "ffn_up_exps.weight"] = np.stack([mat(n_ff, N_EMBD) for _ in range(N_EXPERT)])
            t[p + "ffn_down_exps.weight"] = np.stack(
                [mat(N_EMBD, n_ff, 2.0) for _ in range(N_EXPERT)]
            )
            if spec.shared_expert:
                t[p + "ffn_gate_inp_shexp.weight"] = mat(1, N_EMBD, 2.0)
                t[p + "ffn_gate_shexp.weight"] = mat(N_FF_SHEXP, N_EMBD)
                t[p + "ffn_up_shexp.weight"] = mat(N_FF_SHEXP, N_EMBD)
                t[p + "ffn_down_shexp.weight"] = mat(N_EMBD, N_FF_SHEXP, 2.0)
        elif spec.fused_qkv:
            # Phi-3's own gate_up_proj: rows [gate | up].
            t[p + "ffn_up.weight"] = mat(2 * N_FF, N_EMBD)
            t[p + "ffn_down.weight"] = mat(N_EMBD, N_FF, 2.0)
        else:
            t[p + "ffn_gate.weight"] = mat(N_FF, N_EMBD)
            t[p + "ffn_up.weight"] = mat(N_FF, N_EMBD)
            t[p + "ffn_down.weight"] = mat(N_EMBD, N_FF, 2.0)
        if spec.post_norms:
            t[p + "post_ffw_norm.weight"] = norm(N_EMBD)
    # A large final norm restores the logits' spread that small tied embeddings take away.
    t["output_norm.weight"] = norm(N_EMBD, 8.0 if spec.tied_output else 1.0)
    if not spec.tied_output:
        t["output.weight"] = mat(n_vocab, N_EMBD, 4.0)
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in t.items()}


def _add_hparams(w: gguf.GGUFWriter, arch: str, spec: _Spec) -> None:
    w.add_name(f"tiny-{arch}")
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    w.add_context_length(N_CTX_TRAIN)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    if spec.gguf_arch not in ("gemma", "gemma2"):
        # The Gemma 1/2 converters write no base: llama.cpp's default, 10000, applies.
        w.add_rope_freq_base(spec.rope_base)
    if spec.gguf_arch in ("llama", "phi3"):
        w.add_rope_dimension_count(HEAD_DIM)
    if spec.gguf_arch == "llama":
        w.add_vocab_size(_vocab_size(spec.tokenizer))
    if spec.gguf_arch in ("gemma", "gemma2", "gemma3", "qwen3", "qwen3moe"):
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
    if spec.gguf_arch == "gemma2":
        w.add_attn_logit_softcapping(GEMMA2_ATTN_SOFTCAP)
        w.add_final_logit_softcapping(GEMMA2_FINAL_SOFTCAP)
    if spec.gguf_arch in ("gemma2", "gemma3"):
        w.add_sliding_window(SLIDING_WINDOW)
    if spec.gguf_arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(N_CTX_TRAIN)
        w.add_sliding_window(PHI3_SLIDING_WINDOW)
    if spec.n_expert:
        w.add_expert_count(spec.n_expert)
        w.add_expert_used_count(N_EXPERT_USED)
        if spec.gguf_arch != "llama":
            w.add_expert_feed_forward_length(N_FF_EXP)
        if spec.shared_expert:
            w.add_expert_shared_feed_forward_length(N_FF_SHEXP)


def write_tiny_gguf(arch: str, path: str | Path, *, seed: int = 0) -> Path:
    """Write the tiny `arch` decoder (one of `ARCHITECTURES`) to `path`; returns the path.

    The bytes depend only on `(arch, seed)`.
    """
    if arch not in _SPECS:
        raise ValueError(f"arch {arch!r} is not one of {', '.join(ARCHITECTURES)}")
    spec = _SPECS[arch]
    path = Path(path)
    rng = _arch_rng(arch, seed)
    tensors = _tensors(spec, rng)
    w = gguf.GGUFWriter(str(path), spec.gguf_arch)
    _add_hparams(w, arch, spec)
    _add_tokenizer(w, spec.tokenizer, spec.gguf_arch)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_architecture(arch: str) -> str:
    """The `general.architecture` llama.cpp sees for test architecture `arch`."""
    return _SPECS[arch].gguf_arch


def bos_token_id(arch: str) -> int:
    return SPM_BOS if _SPECS[arch].tokenizer == "llama" else GPT2_BOS
