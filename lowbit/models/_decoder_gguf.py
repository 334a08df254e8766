"""Read a GGUF decoder (llama.cpp's architectures) into the float `Decoder` module.

`decoder_config_from_gguf` turns ``{arch}.*`` metadata into a `DecoderConfig`, filling in what
llama.cpp fixes per architecture rather than storing (Gemma 2's alternating sliding-window
layers, Gemma 3's 5 local : 1 global pattern and its local RoPE base, which routers
renormalize); `gguf_param_map` says where each tensor goes. Files converted by llama.cpp store
Gemma's norm weights with the 1 already added, so every norm here is a plain multiply; the
``llama`` architecture's query/key rows are interleaved for its RoPE and are un-interleaved on
the way in.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

from lowbit.gguf import GGUFFile, read_gguf

from ._assets import smollm2_gguf_path
from ._decoder import Decoder
from ._decoder_config import DecoderConfig
from ._tokenizer import tokenizer_from_gguf
from ._weights import ParamMapping, assign_params

ARCHITECTURES = (
    "llama",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3",
    "phi3",
    "qwen2moe",
    "qwen3moe",
)
"""``general.architecture`` values read (Mistral and Mixtral files are ``llama``)."""

_QK_NORM = ("qwen3", "qwen3moe", "gemma3")
_QKV_BIAS = ("qwen2", "qwen2moe")
_GEMMA = ("gemma", "gemma2", "gemma3")
# llama.cpp keys Gemma 2/3's 27B attention scale (``dim / n_heads`` instead of ``head_dim``)
# on the layer count of the 27B models.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

# Per-layer GGUF tensor suffix -> (module path under layers/i, output-row permutation heads,
# how its axes change: "T" a linear weight [out, in] -> [in, out], "experts" [E, out, in] ->
# [E, in, out], None as stored).
_LAYER_TENSORS = {
    "attn_norm.weight": (("attn_norm", "scale"), None, None),
    "attn_q.weight": (("attn", "q_proj", "kernel"), "n_heads", "T"),
    "attn_k.weight": (("attn", "k_proj", "kernel"), "n_kv_heads", "T"),
    "attn_v.weight": (("attn", "v_proj", "kernel"), None, "T"),
    "attn_q.bias": (("attn", "q_proj", "bias"), "n_heads", None),
    "attn_k.bias": (("attn", "k_proj", "bias"), "n_kv_heads", None),
    "attn_v.bias": (("attn", "v_proj", "bias"), None, None),
    "attn_qkv.weight": (("attn", "qkv_proj", "kernel"), None, "T"),
    "attn_q_norm.weight": (("attn", "q_norm", "scale"), None, None),
    "attn_k_norm.weight": (("attn", "k_norm", "scale"), None, None),
    "attn_output.weight": (("attn", "o_proj", "kernel"), None, "T"),
    "post_attention_norm.weight": (("post_attn_norm", "scale"), None, None),
    "ffn_norm.weight": (("mlp_norm", "scale"), None, None),
    "post_ffw_norm.weight": (("post_mlp_norm", "scale"), None, None),
    "ffn_gate.weight": (("mlp", "gate_proj", "kernel"), None, "T"),
    "ffn_up.weight": (("mlp", "up_proj", "kernel"), None, "T"),
    "ffn_down.weight": (("mlp", "down_proj", "kernel"), None, "T"),
    "ffn_gate_inp.weight": (("moe", "router"), None, "T"),
    "ffn_gate_exps.weight": (("moe", "gate_proj", "kernel"), None, "experts"),
    "ffn_up_exps.weight": (("moe", "up_proj", "kernel"), None, "experts"),
    "ffn_down_exps.weight": (("moe", "down_proj", "kernel"), None, "experts"),
    "ffn_gate_shexp.weight": (("moe", "shared", "gate_proj", "kernel"), None, "T"),
    "ffn_up_shexp.weight": (("moe", "shared", "up_proj", "kernel"), None, "T"),
    "ffn_down_shexp.weight": (("moe", "shared", "down_proj", "kernel"), None, "T"),
    "ffn_gate_inp_shexp.weight": (("moe", "shared_gate"), None, "T"),
}

# Tensors that configure the model rather than hold parameters: RoPE frequency factors
# (Llama 3 scaling) and precomputed rotary tables.
_CONFIG_TENSORS = re.compile(r"^(rope_freqs\.weight|blk\.\d+\.attn_rot_embd\.weight)$")


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


class _Metadata:
    """``{arch}.*`` lookups that name the file and the key when one is missing or bad."""

    def __init__(self, metadata: Mapping[str, Any], path: str):
        self.metadata, self.path = metadata, path
        self.arch = str(metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = ..., kind: type = int) -> Any:
        full = f"{self.arch}.{key}"
        if full not in self.metadata:
            if default is ...:
                raise ValueError(f"GGUF file {self.path!r} has no metadata key {full!r}")
            return default
        value = self.metadata[full]
        try:
            number = kind(value)
        except (TypeError, ValueError, OverflowError):
            number = None
        ok = number is not None and (kind is not float or math.isfinite(number))
        if not ok or number < 0:
            raise ValueError(
                f"GGUF file {self.path!r}: metadata {full!r} is {value!r}; expected a "
                f"non-negative {kind.__name__}"
            )
        return number


def _freq_factors(gguf_file: GGUFFile, head_dim: int) -> tuple[float, ...] | None:
    # Llama 3 files store their scaled frequencies as divisors.
    if "rope_factors_long.weight" in gguf_file.tensors:
        # Phi-3's long-context RoPE also scales cos/sin by an attention factor and switches
        # factors with the context: not expressed by `DecoderConfig`.
        raise ValueError(
            f"GGUF file {gguf_file.path!r} uses long-context RoPE (tensor "
            "'rope_factors_long.weight', Phi-3 128k / 3.5), which lowbit does not run; use a "
            "4k-context Phi-3 file"
        )
    name = "rope_freqs.weight"
    if name not in gguf_file.tensors:
        return None
    factors = np.asarray(gguf_file.tensors[name].dequantize(), np.float64).reshape(-1)
    if factors.size != head_dim // 2 or not np.all(np.isfinite(factors) & (factors > 0)):
        raise ValueError(
            f"GGUF file {gguf_file.path!r}: tensor {name!r} has {factors.size} entries (or "
            f"non-positive ones); head_dim={head_dim} needs {head_dim // 2} positive factors"
        )
    return tuple(float(f) for f in factors)


def decoder_config_from_gguf(gguf_file: GGUFFile) -> DecoderConfig:
    """A `DecoderConfig` from a GGUF file's ``{arch}.*`` metadata.

    Raises:
      ValueError: naming the file and key for an architecture not in `ARCHITECTURES`, a
        missing or out-of-range hyper-parameter, or tensors that disagree with them; and,
        before anything is built per layer, a ``block_count`` larger than the number of
        layers the file holds tensors for.
    """
    tensors = gguf_file.tensors
    _check_block_count(gguf_file)
    vocab = int(tensors["token_embd.weight"].shape[0]) if "token_embd.weight" in tensors else 0
    config = _config_from(
        gguf_file.metadata,
        gguf_file.path,
        vocab,
        "output.weight" not in tensors,
        lambda head_dim: _freq_factors(gguf_file, head_dim),
    )
    _check_declared_shapes(gguf_file, config)
    return config


def _check_declared_shapes(gguf_file: GGUFFile, c: DecoderConfig) -> None:
    """Refuses widths the tensors contradict, on the first layer's tensors.

    A model built from its own blocks (``weights=False``) takes its shapes from the metadata
    alone, so a declared width of 10**9 would reach the first matmul (or run a model whose
    metadata lies) instead of being refused here, naming the keys.
    """
    arch = c.architecture
    width = f"{arch}.embedding_length"
    heads = f"{arch}.attention.head_count, head_count_kv, key_length"
    expected = {"token_embd.weight": ((c.vocab_size, c.dim), width)}
    if c.fused_qkv:
        rows = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
        expected["blk.0.attn_qkv.weight"] = ((rows, c.dim), f"{width}, {heads}")
    else:
        expected["blk.0.attn_q.weight"] = ((c.n_heads * c.head_dim, c.dim), f"{width}, {heads}")
        expected["blk.0.attn_k.weight"] = ((c.n_kv_heads * c.head_dim, c.dim), f"{width}, {heads}")
    expected["blk.0.attn_output.weight"] = ((c.dim, c.n_heads * c.head_dim), f"{width}, {heads}")
    if not c.n_experts:
        up = 2 * c.ffn_dim if c.fused_gate_up else c.ffn_dim
        expected["blk.0.ffn_up.weight"] = ((up, c.dim), f"{width}, {arch}.feed_forward_length")
    for name, (shape, keys) in expected.items():
        tensor = gguf_file.tensors.get(name)
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(
                f"GGUF file {gguf_file.path!r}: tensor {name!r} has shape {tensor.shape}, but "
                f"the metadata ({keys}) declares {shape}; the file is corrupt"
            )


_LAYER_INDEX = re.compile(r"blk\.(\d+)\.")


def _check_block_count(gguf_file: GGUFFile) -> None:
    """Refuses a declared layer count the file cannot hold.

    The per-layer maps (`gguf_param_map`) and modules are built from ``block_count`` before any
    tensor is looked up, so a 5 MB file declaring 10**9 layers would otherwise take memory and
    time in proportion to the declaration, not to the file. Every layer has tensors
    (``blk.{i}.*``), so the count is bounded by the layers present.
    """
    key = f"{gguf_file.architecture}.block_count"
    declared = gguf_file.metadata.get(key)
    if not isinstance(declared, int) or isinstance(declared, bool):
        return  # missing or not a number: `_Metadata.get` names it
    present = {int(m.group(1)) for name in gguf_file.tensors if (m := _LAYER_INDEX.match(name))}
    if declared > len(present):
        raise ValueError(
            f"GGUF file {gguf_file.path!r}: metadata {key!r} declares {declared} layers, but the "
            f"file holds tensors for {len(present)} (blk.N.* names); the file is corrupt or "
            "truncated"
        )


def _config_from(
    metadata: Mapping[str, Any],
    path: str,
    vocab_size: int,
    tie_embeddings: bool,
    rope_freq_factors: Callable[[int], tuple[float, ...] | None],
) -> DecoderConfig:
    """`decoder_config_from_gguf` on metadata alone: the vocabulary size and tying come from
    the tensor table, `rope_freq_factors` (of head_dim) from a tensor."""
    arch = str(metadata.get("general.architecture", ""))
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF file {path!r} has general.architecture {arch!r}; supported: "
            f"{', '.join(ARCHITECTURES)} (Mistral and Mixtral files are 'llama')"
        )
    md = _Metadata(metadata, path)
    dim = md.get("embedding_length")
    n_heads = md.get("attention.head_count")
    if n_heads == 0:
        raise ValueError(f"GGUF file {path!r}: {arch}.attention.head_count is 0")
    head_dim = md.get("attention.key_length", dim // n_heads)
    n_layers = md.get("block_count")
    if vocab_size < 1:
        raise ValueError(f"GGUF file {path!r} has no tensor 'token_embd.weight'")
    fields: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=vocab_size,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=md.get("attention.head_count_kv", n_heads),
        head_dim=head_dim,
        ffn_dim=md.get("feed_forward_length", 0),
        rope_base=md.get("rope.freq_base", 10000.0, float),
        norm_eps=md.get("attention.layer_norm_rms_epsilon", 1e-6, float),
        tie_embeddings=tie_embeddings,
        context_length=md.get("context_length", 2048),
        qkv_bias=arch in _QKV_BIAS,
        qk_norm=arch in _QK_NORM,
        rope_freq_factors=rope_freq_factors(head_dim),
    )
    n_experts = md.get("expert_count", 0)
    if n_experts:
        fields.update(
            n_experts=n_experts,
            n_experts_used=md.get("expert_used_count"),
            expert_ffn_dim=md.get("expert_feed_forward_length", fields["ffn_dim"]),
            shared_ffn_dim=md.get("expert_shared_feed_forward_length", 0),
            # llama.cpp renormalizes the chosen experts' weights for Mixtral and Qwen3-MoE,
            # not for Qwen2-MoE.
            norm_topk=arch != "qwen2moe",
        )
    if arch in _GEMMA:
        fields.update(activation="gelu_tanh", embed_scale=True)
    if arch in ("gemma2", "gemma3"):
        fields.update(post_norms=True, sliding_window=md.get("attention.sliding_window", 4096))
        if n_layers == _GEMMA_27B_LAYERS[arch]:
            fields["query_scale"] = (dim / n_heads) ** -0.5
    if arch == "gemma2":
        fields.update(
            global_every=2,
            attn_softcap=md.get("attn_logit_softcapping", 50.0, float) or None,
            final_softcap=md.get("final_logit_softcapping", 30.0, float) or None,
        )
    if arch == "gemma3":
        fields.update(
            global_every=md.get("attention.sliding_window_pattern", 6), rope_base_local=10000.0
        )
        if metadata.get("gemma3.rope.scaling.type") == "linear":
            fields["rope_scale"] = md.get("rope.scaling.factor", 1.0, float)
    if arch == "phi3":
        # The converter writes Phi-3's sliding window, but llama.cpp attends globally, and
        # its outputs are the reference for a GGUF file.
        fields.update(fused_qkv=True, fused_gate_up=True)
    try:
        return DecoderConfig(**fields)
    except ValueError as err:
        raise ValueError(f"GGUF file {path!r}: {err}") from None


def gguf_metadata(config: DecoderConfig) -> dict[str, Any]:
    """The ``general.architecture`` and ``{arch}.*`` metadata llama.cpp reads for `config`
    (the inverse of `decoder_config_from_gguf`), as key -> Python value (int, float or str).

    Raises:
      ValueError: naming the field when `config` is not one llama.cpp's architecture of that
        name can express (e.g. q/k norms on ``llama``): reading the metadata back must give
        `config` again.
    """
    c = config
    arch = c.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"DecoderConfig.architecture is {arch!r}; GGUF export writes {', '.join(ARCHITECTURES)}"
        )
    md: dict[str, Any] = {
        "general.architecture": arch,
        f"{arch}.block_count": c.n_layers,
        f"{arch}.context_length": c.context_length,
        f"{arch}.embedding_length": c.dim,
        f"{arch}.feed_forward_length": c.ffn_dim,
        f"{arch}.attention.head_count": c.n_heads,
        f"{arch}.attention.head_count_kv": c.n_kv_heads,
        f"{arch}.attention.key_length": c.head_dim,
        f"{arch}.attention.value_length": c.head_dim,
        f"{arch}.rope.freq_base": float(c.rope_base),
        f"{arch}.rope.dimension_count": c.head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": float(c.norm_eps),
        f"{arch}.vocab_size": c.vocab_size,
    }
    if c.n_experts:
        md[f"{arch}.expert_count"] = c.n_experts
        md[f"{arch}.expert_used_count"] = c.n_experts_used
        md[f"{arch}.expert_feed_forward_length"] = c.expert_ffn_dim
        if c.shared_ffn_dim:
            md[f"{arch}.expert_shared_feed_forward_length"] = c.shared_ffn_dim
    if c.sliding_window is not None:
        md[f"{arch}.attention.sliding_window"] = c.sliding_window
    if arch == "gemma2":
        md["gemma2.attn_logit_softcapping"] = float(c.attn_softcap or 0.0)
        md["gemma2.final_logit_softcapping"] = float(c.final_softcap or 0.0)
    if arch == "gemma3" and c.rope_scale != 1.0:
        md["gemma3.rope.scaling.type"] = "linear"
        md["gemma3.rope.scaling.factor"] = float(c.rope_scale)
    back = _config_from(
        md, "<export>", c.vocab_size, c.tie_embeddings, lambda _: c.rope_freq_factors
    )
    for field in dataclasses.fields(c):
        if getattr(back, field.name) != getattr(c, field.name):
            raise ValueError(
                f"DecoderConfig.{field.name}={getattr(c, field.name)!r} cannot be written as "
                f"llama.cpp's {arch!r} architecture (it reads {getattr(back, field.name)!r})"
            )
    return md


def gguf_param_map(config: DecoderConfig) -> dict[str, ParamMapping]:
    """GGUF tensor name -> where and how it goes in `Decoder` (for `config`'s architecture).

    ``token_embd.weight`` -> ``embed/embedding`` (``[vocab, dim]`` as stored);
    ``output_norm.weight`` -> ``norm/scale``; ``output.weight`` -> ``lm_head/kernel`` (untied
    models only); ``blk.{i}.<t>`` -> ``layers/{i}/...`` (`_LAYER_TENSORS`), for the tensors
    the configuration has. Linear weights are transposed from GGUF's ``[out, in]`` to the
    kernel's ``[in, out]`` (experts ``[E, out, in]`` -> ``[E, in, out]``); the ``llama``
    architecture's query/key rows are first un-interleaved (`unpermute_rope_rows`).
    """
    mapping = {
        "token_embd.weight": ParamMapping(("embed", "embedding")),
        "output_norm.weight": ParamMapping(("norm", "scale")),
    }
    if not config.tie_embeddings:
        mapping["output.weight"] = ParamMapping(("lm_head", "kernel"), transpose=True)
    wanted = _layer_tensors(config)
    for i in range(config.n_layers):
        for suffix in wanted:
            sub, heads_attr, axes = _LAYER_TENSORS[suffix]
            permuted = heads_attr is not None and config.architecture == "llama"
            heads = getattr(config, heads_attr) if permuted else None
            mapping[f"blk.{i}.{suffix}"] = ParamMapping(
                ("layers", i, *sub), transpose=axes is not None, unpermute_heads=heads
            )
        if config.fused_gate_up:
            # Phi-3's ffn_up holds gate and up together (gate first).
            mapping[f"blk.{i}.ffn_up.weight"] = ParamMapping(
                ("layers", i, "mlp", "gate_up_proj", "kernel"), transpose=True
            )
    return mapping


def _layer_tensors(c: DecoderConfig) -> list[str]:
    """The per-layer GGUF tensor suffixes a model of `c` has."""
    names = ["attn_norm.weight", "attn_output.weight", "ffn_norm.weight"]
    names += (
        ["attn_qkv.weight"] if c.fused_qkv else ["attn_q.weight", "attn_k.weight", "attn_v.weight"]
    )
    if c.qkv_bias:
        names += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    if c.qk_norm:
        names += ["attn_q_norm.weight", "attn_k_norm.weight"]
    if c.post_norms:
        names += ["post_attention_norm.weight", "post_ffw_norm.weight"]
    if c.n_experts:
        names += [
            "ffn_gate_inp.weight",
            "ffn_gate_exps.weight",
            "ffn_up_exps.weight",
            "ffn_down_exps.weight",
        ]
        if c.shared_ffn_dim:
            names += [
                "ffn_gate_shexp.weight",
                "ffn_up_shexp.weight",
                "ffn_down_shexp.weight",
                "ffn_gate_inp_shexp.weight",
            ]
    elif c.fused_gate_up:
        names += ["ffn_up.weight", "ffn_down.weight"]
    else:
        names += ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
    return names


def load_decoder_gguf(
    source: str | os.PathLike[str] | GGUFFile, dtype: Any = jnp.float32, *, weights: bool = True
) -> tuple[Decoder, Tokenizer]:
    """Load a GGUF decoder file (a path, or one already read) as a float `Decoder` with
    dequantized weights, and its tokenizer.

    `weights=False` builds the model from the file's shapes alone (`jax.ShapeDtypeStruct`
    parameters, nothing dequantized or read): the skeleton that serving a file's own blocks
    (`lowbit.io.import_gguf`) fills in, with no float copy of the model in memory.

    Raises:
      ValueError: naming the file and the tensor or key: an unsupported architecture, a
        tensor the model does not have, a missing tensor, or a shape that disagrees with
        the metadata.
    """
    gguf_file = source if isinstance(source, GGUFFile) else read_gguf(source)
    config = decoder_config_from_gguf(gguf_file)
    mapping = gguf_param_map(config)
    unknown = [n for n in gguf_file.tensors if n not in mapping and not _CONFIG_TENSORS.match(n)]
    if unknown:
        raise ValueError(
            f"GGUF file {gguf_file.path!r} ({config.architecture}) has tensor {unknown[0]!r}, "
            "which this architecture does not use"
        )
    model = Decoder.abstract(config, dtype=dtype, param_dtype=dtype)
    try:
        if weights:
            assign_params(model, _Dequantized(gguf_file), mapping, dtype)
    except ValueError as err:
        raise ValueError(f"GGUF file {gguf_file.path!r}: {err}") from None
    try:
        tokenizer = tokenizer_from_gguf(gguf_file.metadata)
    except ValueError as err:
        raise ValueError(f"GGUF file {gguf_file.path!r}: {err}") from None
    return model, tokenizer


def load_smollm2(dtype: Any = jnp.float32) -> tuple[Decoder, Tokenizer]:
    """SmolLM2-135M-Instruct from the bundled Q4_1 GGUF, dequantized to `dtype`.

    Returns ``(model, tokenizer)``; prompts should use `chat_prompt` (ChatML).
    """
    return load_decoder_gguf(smollm2_gguf_path(), dtype=dtype)
