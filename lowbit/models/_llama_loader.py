"""Load a Llama-architecture GGUF file (SmolLM2) into the float `Llama` module."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

from ._assets import smollm2_gguf_path
from ._gguf_reader import GGUFFile, read_gguf
from ._llama import Llama, LlamaConfig
from ._tokenizer import tokenizer_from_gguf
from ._weights import ParamMapping, assign_params

# Per-layer GGUF tensor suffix -> (module path under layers/i, output-row permutation heads).
_LAYER_TENSORS = {
    "attn_norm.weight": (("attn_norm", "scale"), None),
    "attn_q.weight": (("attn", "q_proj", "kernel"), "n_heads"),
    "attn_k.weight": (("attn", "k_proj", "kernel"), "n_kv_heads"),
    "attn_v.weight": (("attn", "v_proj", "kernel"), None),
    "attn_output.weight": (("attn", "o_proj", "kernel"), None),
    "ffn_norm.weight": (("mlp_norm", "scale"), None),
    "ffn_gate.weight": (("mlp", "gate_proj", "kernel"), None),
    "ffn_up.weight": (("mlp", "up_proj", "kernel"), None),
    "ffn_down.weight": (("mlp", "down_proj", "kernel"), None),
}

# Tensors llama.cpp may store that this model does not use (precomputed rotary tables).
_UNUSED = re.compile(r"^(rope_freqs\.weight|blk\.\d+\.attn_rot_embd\.weight)$")


class _Dequantized(Mapping[str, np.ndarray]):
    """A GGUF file's tensors as float32, dequantized only when looked up."""

    def __init__(self, gguf_file: GGUFFile):
        self._file = gguf_file

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._file.tensors:
            raise KeyError(name)
        return self._file.tensors[name].dequantize()

    def __contains__(self, name: object) -> bool:
        return name in self._file.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._file.tensors)

    def __len__(self) -> int:
        return len(self._file.tensors)


def llama_config_from_gguf(gguf_file: GGUFFile) -> LlamaConfig:
    """A `LlamaConfig` from ``llama.*`` metadata; ValueError for other architectures."""
    arch = gguf_file.architecture
    if arch != "llama":
        raise ValueError(
            f"GGUF file {gguf_file.path!r} has general.architecture {arch!r}; expected 'llama'"
        )
    md = gguf_file.metadata

    def get(key: str, default: Any = None) -> Any:
        if f"llama.{key}" in md:
            return md[f"llama.{key}"]
        if default is None:
            raise ValueError(f"GGUF file {gguf_file.path!r} has no metadata key 'llama.{key}'")
        return default

    dim = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    embed = gguf_file.tensor("token_embd.weight")
    return LlamaConfig(
        vocab_size=int(embed.shape[0]),
        dim=dim,
        n_layers=int(get("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=int(get("attention.key_length", dim // n_heads)),
        ffn_dim=int(get("feed_forward_length")),
        rope_base=float(get("rope.freq_base", 10000.0)),
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in gguf_file.tensors,
        context_length=int(get("context_length", 2048)),
    )


def gguf_llama_param_map(config: LlamaConfig) -> dict[str, ParamMapping]:
    """GGUF tensor name -> where and how it goes in `Llama`.

    ``token_embd.weight`` -> ``embed/embedding`` (``[vocab, dim]`` as stored);
    ``output_norm.weight`` -> ``norm/scale``; ``output.weight`` -> ``lm_head/kernel`` (untied
    models only); ``blk.{i}.<t>`` -> ``layers/{i}/...``: ``attn_norm`` -> ``attn_norm/scale``,
    ``attn_q|k|v|output`` -> ``attn/q_proj|k_proj|v_proj|o_proj/kernel``, ``ffn_norm`` ->
    ``mlp_norm/scale``, ``ffn_gate|up|down`` -> ``mlp/gate_proj|up_proj|down_proj/kernel``.
    Linear weights are transposed from GGUF's ``[out, in]`` to the kernel's ``[in, out]``;
    query/key rows are first un-interleaved (`unpermute_rope_rows`) to the rotate-half layout.
    """
    mapping = {
        "token_embd.weight": ParamMapping(("embed", "embedding")),
        "output_norm.weight": ParamMapping(("norm", "scale")),
    }
    if not config.tie_embeddings:
        mapping["output.weight"] = ParamMapping(("lm_head", "kernel"), transpose=True)
    for i in range(config.n_layers):
        for suffix, (sub, heads_attr) in _LAYER_TENSORS.items():
            heads = getattr(config, heads_attr) if heads_attr else None
            mapping[f"blk.{i}.{suffix}"] = ParamMapping(
                ("layers", i, *sub), transpose=sub[-1] == "kernel", unpermute_heads=heads
            )
    return mapping


def load_llama_gguf(
    source: str | os.PathLike[str] | GGUFFile, dtype: Any = jnp.float32
) -> tuple[Llama, Tokenizer]:
    """Load a Llama GGUF file (a path, or one already read) as a float `Llama` with
    dequantized weights, and its tokenizer."""
    gguf_file = source if isinstance(source, GGUFFile) else read_gguf(source)
    config = llama_config_from_gguf(gguf_file)
    mapping = gguf_llama_param_map(config)
    unknown = [n for n in gguf_file.tensors if n not in mapping and not _UNUSED.match(n)]
    if unknown:
        raise ValueError(f"GGUF file {gguf_file.path!r} has unexpected tensor {unknown[0]!r}")
    arrays = _Dequantized(gguf_file)
    model = Llama.abstract(config, dtype=dtype, param_dtype=dtype)
    assign_params(model, arrays, mapping, dtype)
    return model, tokenizer_from_gguf(gguf_file.metadata)


def load_smollm2(dtype: Any = jnp.float32) -> tuple[Llama, Tokenizer]:
    """SmolLM2-135M-Instruct from the bundled Q4_1 GGUF, dequantized to `dtype`.

    Returns ``(model, tokenizer)``; prompts should use `chat_prompt` (ChatML).
    """
    return load_llama_gguf(smollm2_gguf_path(), dtype=dtype)
