"""Plain-NumPy forward pass of the decoder architectures llama.cpp runs, read off a GGUF file.

Written from llama.cpp's behaviour, independently of lowbit's models, so that it states the
exact semantics a GGUF decoder has and can be checked against llama.cpp's logits (the tiny
files of `tiny_gguf.py`; see `test_tiny_gguf.py`). Everything works in the file's own layout:
matrices are `[out, in]` as numpy reads them, query/key rows stay in the file's order.

What differs between architectures (all of it is in `ArchRules` below):

- Rotary embedding style. NORM (`llama`): rotates adjacent pairs `(2i, 2i+1)` of each head;
  the converter permuted HF's q/k rows so that this equals HF's rotate-half. NEOX (all the
  others here): rotates `(i, i + d/2)`; rows are stored as HF has them. Angle for pair i at
  position p: `p * base**(-2i/d) / freq_factor[i]` (`rope_freqs.weight`, Llama 3.1; else 1).
- Gemma family: input embeddings times `sqrt(n_embd)`; GELU (tanh form) gates instead of
  SiLU (llama.cpp's CPU backend rounds the GELU's input and output to float16, which moves
  the tiny models' logits by up to ~1e-2: see `float16_gelu`); norm weights are used as
  stored (the converter already added Gemma's `1 +`); the output matrix is the token
  embedding. Gemma 2 and 3 add `post_attention_norm` (on the attention output, before the
  residual add) and `post_ffw_norm` (same for the FFN).
- Gemma 2: attention scores `50 * tanh(s / 50)` after the `1/sqrt(head_dim)` scale and
  before the mask; final logits `30 * tanh(z / 30)` (the values come from the file's keys).
  Layers 0, 2, 4, ... use the sliding window.
- Gemma 3: q and k RMS-normed per head (`attn_q_norm`, `attn_k_norm`, before rope); of every
  6 layers the first 5 (`il % 6 < 5`) use the sliding window and rope base 10000, the 6th is
  global with `rope.freq_base`. No softcaps.
- Sliding window of n (`attention.sliding_window`): a query at position p sees keys at
  positions j with `p - n < j <= p`, i.e. itself and the n - 1 before it.
- Qwen2 / Qwen2-MoE: biases on q, k, v. Qwen3 / Qwen3-MoE: per-head q/k RMS norms before rope.
- Phi-3: `attn_qkv` rows are `[q | k | v]`; `ffn_up` rows are `[gate | up]`, out =
  `down(silu(gate) * up)`.
- MoE: router probabilities = softmax over all experts of `ffn_gate_inp @ h`; the top k by
  probability are used, weighted by those probabilities, renormalized to sum to one for
  Mixtral and Qwen3-MoE but not for Qwen2-MoE. Qwen2-MoE adds a shared expert times
  `sigmoid(ffn_gate_inp_shexp . h)`.
- Attention scale is `1/sqrt(head_dim)` everywhere here (llama.cpp uses Gemma's
  `query_pre_attn_scalar` only through the model size; the tiny files have head_dim 16).

Computes in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GEMMA3_SWA_PERIOD = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0


@dataclass(frozen=True)
class ArchRules:
    """The per-architecture switches of the forward pass (keyed by general.architecture)."""

    neox_rope: bool
    gemma: bool = False  # sqrt(n_embd) embedding scale, GELU gates
    post_norms: bool = False
    moe_renormalize: bool = True


RULES: dict[str, ArchRules] = {
    "llama": ArchRules(neox_rope=False),
    "qwen2": ArchRules(neox_rope=True),
    "qwen3": ArchRules(neox_rope=True),
    "gemma": ArchRules(neox_rope=True, gemma=True),
    "gemma2": ArchRules(neox_rope=True, gemma=True, post_norms=True),
    "gemma3": ArchRules(neox_rope=True, gemma=True, post_norms=True),
    "phi3": ArchRules(neox_rope=True),
    "qwen2moe": ArchRules(neox_rope=True, moe_renormalize=False),
    "qwen3moe": ArchRules(neox_rope=True),
}


def read_gguf_numpy(path) -> tuple[dict, dict[str, np.ndarray]]:
    """(metadata {key: scalar or list}, tensors {name: float64 array in numpy order})."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta = {}
    for name, field in reader.fields.items():
        if not field.types or field.types[0] == gguf.GGUFValueType.ARRAY:
            continue  # the vocabulary arrays are not needed here
        value = field.parts[field.data[0]]
        if field.types[0] == gguf.GGUFValueType.STRING:
            meta[name] = bytes(value).decode()
        else:
            meta[name] = value.item()
    tensors = {}
    for t in reader.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ValueError(f"{path}: tensor {t.name} is {t.tensor_type.name}; only F32 here")
        tensors[t.name] = np.asarray(t.data, dtype=np.float64)
    return meta, tensors


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def _gelu_tanh_float16_table(x: np.ndarray) -> np.ndarray:
    """llama.cpp's CPU GELU: tanh GELU looked up in a float16 table (input and output rounded
    to float16), exact outside (-10, 10). Differs from `_gelu_tanh` by up to ~1e-3 relative."""
    f16 = lambda v: v.astype(np.float16).astype(np.float64)  # noqa: E731
    return np.where(x <= -10.0, 0.0, np.where(x >= 10.0, x, f16(_gelu_tanh(f16(x)))))


def _rope(x: np.ndarray, base: float, neox: bool, factors: np.ndarray | None) -> np.ndarray:
    """x: [seq, heads, d] -> same, position p = row index."""
    seq, _, d = x.shape
    freqs = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    if factors is not None:
        freqs = freqs / factors
    theta = np.arange(seq, dtype=np.float64)[:, None] * freqs[None, :]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    if neox:
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def is_sliding_layer(arch: str, il: int, meta: dict) -> bool:
    """Whether layer `il` attends through the sliding window (llama.cpp's fixed patterns)."""
    if f"{arch}.attention.sliding_window" not in meta:
        return False
    if arch == "gemma2":
        return il % 2 == 0
    if arch == "gemma3":
        return il % GEMMA3_SWA_PERIOD < GEMMA3_SWA_PERIOD - 1
    return False  # Phi-3's window is written but llama.cpp disables it


def _attention_mask(seq: int, window: int | None) -> np.ndarray:
    """[seq(query), seq(key)] True where the key is visible."""
    p = np.arange(seq)[:, None]
    j = np.arange(seq)[None, :]
    visible = j <= p
    if window is not None:
        visible &= p - j < window
    return visible


def _moe(h: np.ndarray, w: dict[str, np.ndarray], p: str, n_used: int, renorm: bool):
    """h: [seq, n_embd] -> [seq, n_embd]."""
    probs = h @ w[p + "ffn_gate_inp.weight"].T
    probs = np.exp(probs - probs.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    for s in range(h.shape[0]):
        top = np.argsort(-probs[s], kind="stable")[:n_used]
        weights = probs[s, top]
        if renorm:
            weights = weights / weights.sum()
        for e, g in zip(top, weights, strict=True):
            gate = w[p + "ffn_gate_exps.weight"][e] @ h[s]
            up = w[p + "ffn_up_exps.weight"][e] @ h[s]
            out[s] += g * (w[p + "ffn_down_exps.weight"][e] @ (_silu(gate) * up))
    if p + "ffn_gate_inp_shexp.weight" in w:
        shared = w[p + "ffn_down_shexp.weight"] @ (
            _silu(w[p + "ffn_gate_shexp.weight"] @ h.T) * (w[p + "ffn_up_shexp.weight"] @ h.T)
        )
        gate = 1.0 / (1.0 + np.exp(-(h @ w[p + "ffn_gate_inp_shexp.weight"].reshape(-1))))
        out += shared.T * gate[:, None]
    return out


def decoder_logits(
    meta: dict, w: dict[str, np.ndarray], tokens: list[int], *, float16_gelu: bool = False
) -> np.ndarray:
    """Logits [seq, vocab] (float64) of the GGUF decoder `(meta, w)` for `tokens`.

    `float16_gelu` evaluates the Gemma GELU as llama.cpp's CPU backend does (through a
    float16 table); by default it is the exact tanh form, which is what the models mean.
    """
    arch = meta["general.architecture"]
    rules = RULES[arch]
    k = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    n_embd, n_head, n_kv = (
        k("embedding_length"),
        k("attention.head_count"),
        k("attention.head_count_kv"),
    )
    d = k("attention.key_length", n_embd // n_head)
    eps = k("attention.layer_norm_rms_epsilon")
    base = k("rope.freq_base", 10000.0)
    window = k("attention.sliding_window")
    attn_cap, final_cap = k("attn_logit_softcapping"), k("final_logit_softcapping")
    n_used = k("expert_used_count", 0)
    factors = w.get("rope_freqs.weight")
    seq = len(tokens)

    x = w["token_embd.weight"][tokens]
    if rules.gemma:
        x = x * np.sqrt(n_embd)
    for il in range(k("block_count")):
        p = f"blk.{il}."
        h = _rms_norm(x, w[p + "attn_norm.weight"], eps)
        if p + "attn_qkv.weight" in w:
            qkv = h @ w[p + "attn_qkv.weight"].T
            q, kk, v = np.split(qkv, [n_head * d, n_head * d + n_kv * d], axis=-1)
        else:
            q, kk, v = (h @ w[p + f"attn_{n}.weight"].T for n in "qkv")
            if p + "attn_q.bias" in w:
                q, kk, v = (
                    q + w[p + "attn_q.bias"],
                    kk + w[p + "attn_k.bias"],
                    v + w[p + "attn_v.bias"],
                )
        q, kk, v = q.reshape(seq, n_head, d), kk.reshape(seq, n_kv, d), v.reshape(seq, n_kv, d)
        if p + "attn_q_norm.weight" in w:
            q = _rms_norm(q, w[p + "attn_q_norm.weight"], eps)
            kk = _rms_norm(kk, w[p + "attn_k_norm.weight"], eps)
        sliding = is_sliding_layer(arch, il, meta)
        layer_base = GEMMA3_LOCAL_ROPE_BASE if (arch == "gemma3" and sliding) else base
        q = _rope(q, layer_base, rules.neox_rope, factors)
        kk = _rope(kk, layer_base, rules.neox_rope, factors)
        group = n_head // n_kv
        kk, v = np.repeat(kk, group, axis=1), np.repeat(v, group, axis=1)  # head h uses kv h//group
        scores = np.einsum("qhd,khd->hqk", q, kk) / np.sqrt(d)
        if attn_cap:
            scores = attn_cap * np.tanh(scores / attn_cap)
        mask = _attention_mask(seq, window if sliding else None)
        scores = np.where(mask[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(seq, n_head * d)
        out = attn @ w[p + "attn_output.weight"].T
        if rules.post_norms:
            out = _rms_norm(out, w[p + "post_attention_norm.weight"], eps)
        x = x + out

        h = _rms_norm(x, w[p + "ffn_norm.weight"], eps)
        if p + "ffn_gate_inp.weight" in w:
            out = _moe(h, w, p, n_used, rules.moe_renormalize)
        else:
            if p + "ffn_gate.weight" in w:
                gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
            else:  # Phi-3: ffn_up holds [gate | up]
                gate, up = np.split(h @ w[p + "ffn_up.weight"].T, 2, axis=-1)
            if rules.gemma:
                act = _gelu_tanh_float16_table if float16_gelu else _gelu_tanh
            else:
                act = _silu
            out = (act(gate) * up) @ w[p + "ffn_down.weight"].T
        if rules.post_norms:
            out = _rms_norm(out, w[p + "post_ffw_norm.weight"], eps)
        x = x + out

    x = _rms_norm(x, w["output_norm.weight"], eps)
    logits = x @ w.get("output.weight", w["token_embd.weight"]).T
    if final_cap:
        logits = final_cap * np.tanh(logits / final_cap)
    return logits


def file_logits(path, tokens: list[int]) -> np.ndarray:
    """Logits [seq, vocab] of the GGUF decoder at `path`."""
    meta, w = read_gguf_numpy(path)
    return decoder_logits(meta, w, tokens)


def greedy_tokens(path, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens after `prompt` (recomputing the whole sequence each step)."""
    meta, w = read_gguf_numpy(path)
    seq = list(prompt)
    out = []
    for _ in range(n):
        tok = int(np.argmax(decoder_logits(meta, w, seq)[-1]))
        out.append(tok)
        seq.append(tok)
    return out
