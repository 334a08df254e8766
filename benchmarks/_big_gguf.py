"""Random-weight GGUF files of real model shapes, written block by block with no float copy.

`write_gguf(path, shape, mix)` writes a file laid out as llama.cpp's quantizer lays out a file
of that shape (`SHAPES`: Llama-3.2-1B, Qwen2-1.5B, Llama-3-8B) and mix (`MIXES`): Q4_K_M has
Q4_K weights, Q6_K for the output projection (the tied embedding), and for `attn_v` /
`ffn_down` in llama.cpp's "more bits" layers; Q8_0 has Q8_0 weights throughout; F16 has fp16
weights drawn from N(0, 0.02^2); all have F32 norms and biases. The blocks hold random codes
with small fp16 scales, so a forward pass stays finite (the text is noise: these files measure
speed and memory, not quality). The tokenizer is SmolLM2's (GPT-2 BPE), padded with unused
tokens to the shape's vocabulary. Memory: one tensor's bytes at a time.

An F16 file is the source for llama.cpp's own quantizer (`benchmarks.mixes.quantize_llama_cpp`),
whose output is the file a user downloads: every block type and every block's fit llama.cpp's.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np

from lowbit.gguf import BLOCK_TYPES


@dataclasses.dataclass(frozen=True)
class Shape:
    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    rope_base: float


SHAPES = {
    "llama3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 128256, True, 5e5),
    "qwen2-1.5b": Shape("qwen2", 1536, 28, 12, 2, 8960, 151936, True, 1e6),
    "llama3-8b": Shape("llama", 4096, 32, 32, 8, 14336, 128256, False, 5e5),
}


# mix -> llama.cpp's general.file_type for it.
MIXES = {"Q4_K_M": 15, "Q8_0": 7, "F16": 1}


def _more_bits(i: int, n: int) -> bool:  # llama.cpp's rule for the _M mixes
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _blocks(rng: np.random.Generator, ggml_type: str, rows: int, k: int) -> np.ndarray:
    """Random blocks of `ggml_type` for a [rows, k] tensor, scales small and finite."""
    t = BLOCK_TYPES[ggml_type]
    n = rows * (k // t.block_size)
    b = rng.integers(0, 256, (n, t.type_size), dtype=np.uint8)
    half = lambda v: np.frombuffer(np.float16(v).tobytes(), np.uint8)  # noqa: E731
    if ggml_type == "Q4_K":  # d, dmin at 0 and 2: w ~ d * sc * q - dmin * m
        b[:, 0:2] = half(2e-4)
        b[:, 2:4] = half(2e-4)
    elif ggml_type == "Q6_K":  # int8 scales at 192, d at 208
        b[:, 192:208] = rng.integers(1, 16, (n, 16), dtype=np.uint8)
        b[:, 208:210] = half(2e-4)
    elif ggml_type == "Q8_0":  # d at 0, then 32 int8 codes
        b[:, 0:2] = half(2e-4)
    else:
        raise ValueError(ggml_type)
    return b.reshape(rows, -1)


def write_gguf(path: str, shape: str, mix: str = "Q4_K_M", seed: int = 0) -> str:
    """Writes the random `mix` file of `SHAPES[shape]` to `path`; returns `path`."""
    from lowbit.gguf import read_gguf
    from lowbit.models import smollm2_gguf_path

    if mix not in MIXES:
        raise ValueError(f"mix {mix!r}: one of {', '.join(MIXES)}")
    s = SHAPES[shape]
    rng = np.random.default_rng(seed)
    head = s.hidden // s.heads
    w = gguf.GGUFWriter(path, s.arch)
    a = s.arch
    w.add_uint32(f"{a}.block_count", s.layers)
    w.add_uint32(f"{a}.context_length", 8192)
    w.add_uint32(f"{a}.embedding_length", s.hidden)
    w.add_uint32(f"{a}.feed_forward_length", s.ffn)
    w.add_uint32(f"{a}.attention.head_count", s.heads)
    w.add_uint32(f"{a}.attention.head_count_kv", s.kv_heads)
    w.add_float32(f"{a}.rope.freq_base", s.rope_base)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_uint32(f"{a}.vocab_size", s.vocab)
    w.add_uint32(f"{a}.rope.dimension_count", head)
    w.add_uint32("general.file_type", MIXES[mix])
    meta = read_gguf(smollm2_gguf_path()).metadata
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta["tokenizer.ggml.token_type"])
    pad = s.vocab - len(tokens)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(tokens + [f"<|unused_{i}|>" for i in range(pad)])
    w.add_token_types(types + [gguf.TokenType.UNUSED] * pad)
    w.add_token_merges(list(meta["tokenizer.ggml.merges"]))
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(meta["tokenizer.chat_template"])

    tensors: list[tuple[str, str, tuple[int, int] | int]] = []
    q4, q6 = {"Q4_K_M": ("Q4_K", "Q6_K"), "Q8_0": ("Q8_0", "Q8_0"), "F16": ("F16", "F16")}[mix]
    tensors.append(("token_embd.weight", q6 if s.tied else q4, (s.vocab, s.hidden)))
    if not s.tied:
        tensors.append(("output.weight", q6, (s.vocab, s.hidden)))
    tensors.append(("output_norm.weight", "F32", s.hidden))
    kv = s.kv_heads * head
    for i in range(s.layers):
        more = q6 if _more_bits(i, s.layers) else q4
        p = f"blk.{i}."
        tensors += [
            (p + "attn_norm.weight", "F32", s.hidden),
            (p + "attn_q.weight", q4, (s.hidden, s.hidden)),
            (p + "attn_k.weight", q4, (kv, s.hidden)),
            (p + "attn_v.weight", more, (kv, s.hidden)),
            (p + "attn_output.weight", q4, (s.hidden, s.hidden)),
            (p + "ffn_norm.weight", "F32", s.hidden),
            (p + "ffn_gate.weight", q4, (s.ffn, s.hidden)),
            (p + "ffn_up.weight", q4, (s.ffn, s.hidden)),
            (p + "ffn_down.weight", more, (s.hidden, s.ffn)),
        ]
        if s.arch == "qwen2":
            tensors += [
                (p + f"attn_{x}.bias", "F32", n) for x, n in (("q", s.hidden), ("k", kv), ("v", kv))
            ]

    for name, kind, dims in tensors:
        raw = kind if kind == "F32" else gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            value = (
                np.zeros(dims, np.float32) if name.endswith("bias") else np.ones(dims, np.float32)
            )
            w.add_tensor_info(name, value.shape, value.dtype, value.nbytes)
        elif kind == "F16":
            w.add_tensor_info(name, dims, np.dtype(np.float16), 2 * dims[0] * dims[1])
        else:
            t = BLOCK_TYPES[kind]
            row_bytes = dims[1] // t.block_size * t.type_size
            w.add_tensor_info(
                name, (dims[0], row_bytes), np.dtype(np.uint8), dims[0] * row_bytes, raw_dtype=raw
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, kind, dims in tensors:
        if kind == "F32":
            value = (
                np.zeros(dims, np.float32) if name.endswith("bias") else np.ones(dims, np.float32)
            )
        elif kind == "F16":
            value = (0.02 * rng.standard_normal(dims, np.float32)).astype(np.float16)
        else:
            value = _blocks(rng, kind, dims[0], dims[1])
        w.write_tensor_data(value)
        del value
    w.close()
    return path
