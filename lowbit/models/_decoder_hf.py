"""Read a Hugging Face decoder checkpoint (``config.json`` + safetensors) into `Decoder`.

`decoder_config_from_hf` turns a ``config.json`` into a `DecoderConfig`, reading both the
transformers 4 spelling (``rope_theta``, ``rope_scaling``) and the transformers 5 one
(``rope_parameters``, possibly per layer type) and deriving which layers slide from
``layer_types`` or each family's rule; `hf_param_map` says where each tensor goes;
`load_decoder_hf` reads one tensor at a time from ``model.safetensors`` or the shards
an index lists. Hugging Face stores the rotate-half query/key layout `Decoder` uses, so no
rows are permuted; Gemma's norms store ``w`` of the ``1 + w`` they multiply by, so 1 is added.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from tokenizers import Tokenizer

from lowbit._untrusted import load_json, read_text, require_regular

from ._decoder import Decoder, DecoderConfig
from ._weights import CheckpointError, ParamMapping, assign_params

HF_MODEL_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma3_text",
    "phi3",
)
"""``config.json`` ``model_type`` values `decoder_config_from_hf` reads."""

# What transformers assumes for the ``config.json`` fields a file leaves out, per model type
# (a data file: the config classes' defaults, on which transformers 4.x and 5.x agree, for the
# fields `decoder_config_from_hf` reads). ``save_pretrained`` may write only the fields that
# differ from them (Gemma 3's nested ``text_config`` routinely omits head counts, ``head_dim``,
# ``query_pre_attn_scalar`` and RoPE bases), so reading a file faithfully needs them. Fields
# transformers derives from others (``head_dim`` as ``hidden_size / num_attention_heads``,
# ``num_key_value_heads`` as ``num_attention_heads``) are derived below instead. Only absent
# keys take these values: an explicit ``null`` stays.
HF_DEFAULTS: dict[str, dict[str, Any]] = json.loads(
    Path(__file__).with_name("hf_defaults.json").read_text()
)

_GEMMA = ("gemma", "gemma2", "gemma3_text")
_MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
_QK_NORM = ("qwen3", "qwen3_moe", "gemma3_text")
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}
_FLOAT_DTYPES = ("F32", "F16", "BF16")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# Per-layer tensor suffix (under ``model.layers.{i}.``) -> module path under layers/{i};
# every one is a ``weight`` or ``bias`` and linear weights are [out, in].
_ATTN = {
    "self_attn.q_proj": ("attn", "q_proj"),
    "self_attn.k_proj": ("attn", "k_proj"),
    "self_attn.v_proj": ("attn", "v_proj"),
}
_MLP = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
# Mixtral's per-expert names: w1 is the gate, w3 the up and w2 the down projection.
_MIXTRAL_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class _Fields:
    """``config.json`` lookups whose errors name the file and the field."""

    def __init__(self, config: Mapping[str, Any], path: str):
        self.config = config
        self.path = path

    def error(self, field: str, message: str) -> ValueError:
        return ValueError(f"{self.path}: field {field!r} {message}")

    def get(self, field: str, default: Any = ..., kind: type = int, minimum: float = 1) -> Any:
        value = self.config.get(field)
        if value is None:
            if default is ...:
                raise self.error(field, "is missing")
            return default
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and (kind is float or float(value).is_integer())
        if not ok or not math.isfinite(value) or value < minimum:
            raise self.error(
                field,
                f"is {value!r}; expected {'a number' if kind is float else 'an integer'} "
                f">= {minimum}",
            )
        return kind(value)

    def flag(self, field: str, default: bool) -> bool:
        value = self.config.get(field, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(field, f"is {value!r}; expected true or false")
        return value


def _text_config(config: Mapping[str, Any], path: str) -> dict[str, Any]:
    """The language model's fields (Gemma 3's multimodal config nests them in text_config)."""
    if config.get("model_type") != "gemma3":
        return dict(config)
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{path}: model_type 'gemma3' needs a 'text_config' object")
    return {**text, "model_type": "gemma3_text"}


def _rope_parameters(f: _Fields, model_type: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """RoPE settings ``{rope_type, rope_theta, ...}`` of full-attention layers and of
    sliding-window layers (None where they are the same), from transformers 5's
    ``rope_parameters`` (flat, or per layer type) or 4's ``rope_theta`` / ``rope_scaling`` /
    ``rope_local_base_freq``."""
    c = f.config
    params = c.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise f.error("rope_parameters", f"is {params!r}; expected an object")
    local = None
    if params and all(isinstance(v, dict) for v in params.values()):
        full = dict(params.get("full_attention") or {})
        if params.get("sliding_attention") is not None:
            local = dict(params["sliding_attention"])
    else:
        full = dict(params or {})
        scaling = c.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise f.error("rope_scaling", f"is {scaling!r}; expected an object or null")
        full.update(scaling or {})
    if model_type == "gemma3_text" and local is None:
        # Gemma 3's scaling applies to its global layers; local ones have their own base.
        local = {"rope_theta": c.get("rope_local_base_freq", 10000.0)}
    for kind in (full, local or {}):
        kind.setdefault("rope_type", kind.get("type", "default"))
        kind.setdefault("rope_theta", c.get("rope_theta", 10000.0))
    return full, local


def _llama3_freq_factors(f: _Fields, rope: dict[str, Any], head_dim: int) -> tuple[float, ...]:
    """Llama 3's RoPE scaling as per-frequency divisors: wavelengths shorter than
    ``original_max_position_embeddings / high_freq_factor`` keep their frequency, those longer
    than ``... / low_freq_factor`` are divided by ``factor``, and those between blend the two
    (transformers' ``_compute_llama3_parameters``)."""
    sub = _Fields(rope, f"{f.path} (rope scaling)")
    factor = sub.get("factor", kind=float, minimum=1e-9)
    low = sub.get("low_freq_factor", kind=float, minimum=1e-9)
    high = sub.get("high_freq_factor", kind=float, minimum=1e-9)
    original = sub.get("original_max_position_embeddings", kind=float)
    if high <= low:
        raise sub.error("high_freq_factor", f"is {high}; it must exceed low_freq_factor={low}")
    theta = float(rope["rope_theta"])
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    scaled = np.where(medium, blended, scaled)
    return tuple(float(x) for x in inv_freq / scaled)


def _layer_types(f: _Fields, model_type: str, n_layers: int) -> tuple[list[bool], str]:
    """Whether each layer attends through the sliding window: ``layer_types`` when the file
    lists them, else each family's rule as transformers applies it; and the field that
    decided it (for messages)."""
    c = f.config
    window = c.get("sliding_window")
    if "layer_types" in c and c["layer_types"] is not None:
        types = c["layer_types"]
        allowed = ("full_attention", "sliding_attention")
        if (
            not isinstance(types, list)
            or len(types) != n_layers
            or any(t not in allowed for t in types)
        ):
            raise f.error(
                "layer_types",
                f"is {types!r}; expected {n_layers} entries, each one of {allowed}",
            )
        return [t == "sliding_attention" for t in types], "layer_types"
    if model_type in ("mistral", "mixtral", "phi3"):
        return [bool(window)] * n_layers, "sliding_window"
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if not f.flag("use_sliding_window", False) or not window:
            return [False] * n_layers, "use_sliding_window"
        first = f.get("max_window_layers", n_layers, minimum=0)
        return [i >= first for i in range(n_layers)], "max_window_layers"
    if model_type == "gemma2":
        return [i % 2 == 0 for i in range(n_layers)], "model_type"
    if model_type == "gemma3_text":
        every = f.get("sliding_window_pattern", 6)
        return [(i + 1) % every != 0 for i in range(n_layers)], "sliding_window_pattern"
    return [False] * n_layers, "model_type"


def _window_fields(f: _Fields, sliding: list[bool], source: str) -> dict[str, Any]:
    """`sliding_window` and `global_every` for a per-layer sliding pattern (decided by the
    field `source`)."""
    if not any(sliding):
        return {}
    window = f.get("sliding_window")
    if all(sliding):
        return dict(sliding_window=window, global_every=0)
    every = sliding.index(False) + 1
    if sliding != [(i + 1) % every != 0 for i in range(len(sliding))]:
        raise f.error(
            source,
            f"makes layers {['sliding' if s else 'full' for s in sliding]}: a pattern other "
            "than every k-th layer global, which is the only one the decoder supports",
        )
    return dict(sliding_window=window, global_every=every)


def _activation(f: _Fields, model_type: str) -> str:
    field = "hidden_activation" if f.config.get("hidden_activation") else "hidden_act"
    name = f.config.get(field, "gelu_pytorch_tanh" if model_type in _GEMMA else "silu")
    if model_type in _GEMMA and name == "gelu":
        # Gemma's first configs say "gelu"; transformers runs them with the tanh approximation.
        name = "gelu_pytorch_tanh"
    if name not in _ACTIVATIONS:
        raise f.error(field, f"is {name!r}; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _moe_fields(f: _Fields, model_type: str, n_layers: int) -> dict[str, Any]:
    n_experts_field = "num_local_experts" if "num_local_experts" in f.config else "num_experts"
    fields: dict[str, Any] = dict(
        n_experts=f.get(n_experts_field),
        n_experts_used=f.get("num_experts_per_tok"),
    )
    if model_type == "mixtral":
        fields.update(expert_ffn_dim=f.get("intermediate_size"), norm_topk=True)
        return fields
    fields.update(
        expert_ffn_dim=f.get("moe_intermediate_size"),
        norm_topk=f.flag("norm_topk_prob", False),
        shared_ffn_dim=f.get("shared_expert_intermediate_size", 0, minimum=0)
        if model_type == "qwen2_moe"
        else 0,
    )
    step = f.get("decoder_sparse_step", 1)
    if any((i + 1) % step for i in range(n_layers)):
        raise f.error(
            "decoder_sparse_step", f"is {step}: some layers are dense; only all-MoE models load"
        )
    dense = f.config.get("mlp_only_layers") or []
    if dense:
        raise f.error(
            "mlp_only_layers", f"is {dense!r}: those layers are dense; only all-MoE models load"
        )
    return fields


def decoder_config_from_hf(
    config_json: Mapping[str, Any], path: str | os.PathLike[str] = "config.json"
) -> DecoderConfig:
    """A `DecoderConfig` from a Hugging Face ``config.json`` dict read from `path`.

    Fields the file leaves out take transformers' defaults for its model type
    (`HF_DEFAULTS`), as transformers itself reads them.

    Raises:
      ValueError: naming `path` and the field: an unknown ``model_type`` (the message lists
        `HF_MODEL_TYPES`), a missing or out-of-range field, or a feature the decoder lacks
        (partial rotary embeddings, RoPE scaling other than linear and llama3, output-projection
        or MLP biases, a layer pattern other than every k-th layer global, dense layers in a
        mixture of experts).
    """
    path = os.fspath(path)
    model_type = config_json.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(
            f"{path}: field 'model_type' is {model_type!r}; supported: {', '.join(HF_MODEL_TYPES)}"
        )
    c = _text_config(config_json, path)
    model_type = c["model_type"]
    c = {**HF_DEFAULTS[model_type], **c}
    f = _Fields(c, path)
    dim = f.get("hidden_size")
    n_heads = f.get("num_attention_heads")
    n_layers = f.get("num_hidden_layers", minimum=0)
    head_dim = f.get("head_dim", dim // n_heads)
    for field in ("attention_bias", "mlp_bias"):
        if model_type not in ("qwen2", "qwen2_moe") and f.flag(field, False):
            raise f.error(field, "is true; biases on o_proj / MLP projections are not supported")
    if f.flag("use_bidirectional_attention", False):
        raise f.error("use_bidirectional_attention", "is true; the decoder is causal")
    full, local = _rope_parameters(f, model_type)
    partial = full.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise f.error(
            "partial_rotary_factor", f"is {partial!r}; only full rotary embeddings (1.0) load"
        )
    fields: dict[str, Any] = dict(
        architecture=model_type,
        vocab_size=f.get("vocab_size"),
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=f.get("num_key_value_heads", n_heads),
        head_dim=head_dim,
        ffn_dim=f.get("intermediate_size"),
        rope_base=_Fields(full, f"{path} (rope parameters)").get("rope_theta", kind=float),
        norm_eps=f.get("rms_norm_eps", 1e-6, kind=float, minimum=1e-30),
        tie_embeddings=f.flag("tie_word_embeddings", model_type in _GEMMA),
        context_length=f.get("max_position_embeddings", 2048),
        qkv_bias=model_type in ("qwen2", "qwen2_moe"),
        qk_norm=model_type in _QK_NORM,
        activation=_activation(f, model_type),
        fused_qkv=model_type == "phi3",
        fused_gate_up=model_type == "phi3",
    )
    rope_type = full["rope_type"]
    if rope_type == "linear":
        fields["rope_scale"] = _Fields(full, f"{path} (rope scaling)").get(
            "factor", kind=float, minimum=1e-9
        )
    elif rope_type == "llama3":
        fields["rope_freq_factors"] = _llama3_freq_factors(f, full, head_dim)
    elif rope_type != "default":
        raise f.error(
            "rope_parameters" if c.get("rope_parameters") else "rope_scaling",
            f"has rope_type {rope_type!r}; supported: default, linear, llama3",
        )
    sliding, source = _layer_types(f, model_type, n_layers)
    fields.update(_window_fields(f, sliding, source))
    if any(sliding) and local is not None and local != full:
        if local["rope_type"] != "default":
            raise f.error(
                "rope_parameters",
                f"scales sliding layers' RoPE ({local['rope_type']!r}); only default loads",
            )
        fields["rope_base_local"] = _Fields(local, f"{path} (sliding rope parameters)").get(
            "rope_theta", kind=float
        )
    if model_type in _GEMMA:
        fields["embed_scale"] = True
    if model_type in ("gemma2", "gemma3_text"):
        fields.update(
            post_norms=True,
            query_scale=f.get("query_pre_attn_scalar", kind=float, minimum=1e-9) ** -0.5,
            attn_softcap=f.get("attn_logit_softcapping", None, kind=float, minimum=1e-9),
            final_softcap=f.get("final_logit_softcapping", None, kind=float, minimum=1e-9),
        )
    if model_type in _MOE:
        fields.update(_moe_fields(f, model_type, n_layers))
    try:
        return DecoderConfig(**fields)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def hf_param_map(
    config: DecoderConfig, *, fused_experts: bool = False
) -> dict[str, ParamMapping | tuple[ParamMapping, ...]]:
    """Hugging Face tensor name -> where and how it goes in `Decoder`.

    ``model.embed_tokens.weight`` -> ``embed/embedding``; ``model.norm.weight`` ->
    ``norm/scale``; ``lm_head.weight`` -> ``lm_head/kernel`` (untied models only);
    ``model.layers.{i}.`` ``input_layernorm`` -> ``attn_norm``, ``self_attn.{q,k,v,o}_proj``
    (or Phi-3's ``qkv_proj``) -> ``attn/...``, ``self_attn.{q,k}_norm`` -> ``attn/{q,k}_norm``,
    the pre-MLP norm (``post_attention_layernorm``, Gemma 2/3's ``pre_feedforward_layernorm``)
    -> ``mlp_norm``, Gemma 2/3's ``post_attention_layernorm`` / ``post_feedforward_layernorm``
    -> ``post_attn_norm`` / ``post_mlp_norm``, ``mlp.{gate,up,down}_proj`` (Phi-3's
    ``gate_up_proj``) -> ``mlp/...``. Linear weights (``[out, in]``) are transposed into
    kernels; Gemma's norm weights get 1 added.

    Experts: the router (Mixtral's ``block_sparse_moe.gate``, else ``mlp.gate``) ->
    ``moe/router``; each expert's tensor (``block_sparse_moe.experts.{e}.w1/w3/w2`` or
    ``mlp.experts.{e}.gate_proj/up_proj/down_proj``) fills slice ``e`` of the stacked
    ``moe/{gate,up,down}_proj/kernel`` (`ParamMapping.expert`). With `fused_experts`
    (transformers 5's own layout, ``save_original_format=False``): ``mlp.experts.gate_up_proj``
    ``[E, 2F, dim]`` maps to two parameters, gate then up (a tuple of `ParamMapping`\\ s with
    `ParamMapping.part`), and ``mlp.experts.down_proj`` ``[E, dim, F]`` to one. Qwen2-MoE's
    ``mlp.shared_expert.*`` -> ``moe/shared/...`` and ``mlp.shared_expert_gate`` ->
    ``moe/shared_gate``.
    """
    c = config
    gemma = c.architecture in _GEMMA
    norm_offset = 1.0 if gemma else 0.0

    def linear(path: tuple, **kw: Any) -> ParamMapping:
        return ParamMapping((*path, "kernel"), transpose=True, **kw)

    def norm(path: tuple) -> ParamMapping:
        return ParamMapping((*path, "scale"), offset=norm_offset)

    mapping: dict[str, ParamMapping | tuple[ParamMapping, ...]] = {
        "model.embed_tokens.weight": ParamMapping(("embed", "embedding")),
        "model.norm.weight": norm(("norm",)),
    }
    if not c.tie_embeddings:
        mapping["lm_head.weight"] = linear(("lm_head",))
    for i in range(c.n_layers):
        pre, at = f"model.layers.{i}.", ("layers", i)
        mapping[pre + "input_layernorm.weight"] = norm((*at, "attn_norm"))
        mapping[pre + "self_attn.o_proj.weight"] = linear((*at, "attn", "o_proj"))
        if c.fused_qkv:
            mapping[pre + "self_attn.qkv_proj.weight"] = linear((*at, "attn", "qkv_proj"))
        for hf, sub in ({} if c.fused_qkv else _ATTN).items():
            mapping[f"{pre}{hf}.weight"] = linear((*at, *sub))
            if c.qkv_bias:
                mapping[f"{pre}{hf}.bias"] = ParamMapping((*at, *sub, "bias"))
        if c.qk_norm:
            for qk in ("q_norm", "k_norm"):
                mapping[f"{pre}self_attn.{qk}.weight"] = norm((*at, "attn", qk))
        if c.post_norms:
            mapping[pre + "post_attention_layernorm.weight"] = norm((*at, "post_attn_norm"))
            mapping[pre + "pre_feedforward_layernorm.weight"] = norm((*at, "mlp_norm"))
            mapping[pre + "post_feedforward_layernorm.weight"] = norm((*at, "post_mlp_norm"))
        else:
            mapping[pre + "post_attention_layernorm.weight"] = norm((*at, "mlp_norm"))
        if c.n_experts:
            mapping.update(_expert_map(c, i, fused_experts))
        elif c.fused_gate_up:
            mapping[pre + "mlp.gate_up_proj.weight"] = linear((*at, "mlp", "gate_up_proj"))
            mapping[pre + "mlp.down_proj.weight"] = linear((*at, "mlp", "down_proj"))
        else:
            for hf, ours in _MLP.items():
                mapping[f"{pre}mlp.{hf}.weight"] = linear((*at, "mlp", ours))
    return mapping


def _expert_map(
    c: DecoderConfig, i: int, fused: bool
) -> dict[str, ParamMapping | tuple[ParamMapping, ...]]:
    """Layer `i`'s router, experts and shared expert (`hf_param_map`)."""
    moe = ("layers", i, "moe")
    kernel = lambda name: (*moe, name, "kernel")  # noqa: E731
    mixtral_names = c.architecture == "mixtral" and not fused
    block = f"model.layers.{i}." + ("block_sparse_moe" if mixtral_names else "mlp")
    out: dict[str, ParamMapping | tuple[ParamMapping, ...]] = {
        f"{block}.gate.weight": ParamMapping((*moe, "router"), transpose=True)
    }
    if fused:
        out[f"{block}.experts.gate_up_proj"] = tuple(
            ParamMapping(kernel(name), transpose=True, part=(k, 2))
            for k, name in enumerate(("gate_proj", "up_proj"))
        )
        out[f"{block}.experts.down_proj"] = ParamMapping(kernel("down_proj"), transpose=True)
    else:
        names = _MIXTRAL_EXPERTS if mixtral_names else _MLP
        for e in range(c.n_experts):
            for hf, ours in names.items():
                out[f"{block}.experts.{e}.{hf}.weight"] = ParamMapping(
                    kernel(ours), transpose=True, expert=e
                )
    if c.shared_ffn_dim:
        for hf, ours in _MLP.items():
            out[f"{block}.shared_expert.{hf}.weight"] = ParamMapping(
                (*moe, "shared", ours, "kernel"), transpose=True
            )
        out[f"{block}.shared_expert_gate.weight"] = ParamMapping(
            (*moe, "shared_gate"), transpose=True
        )
    return out


# Gemma 3's multimodal checkpoints: the language model's tensors under another prefix
# (transformers 5, then 4), and the vision tower's, which a text decoder does not read.
_GEMMA3_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
_GEMMA3_VISION = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def _our_name(name: str, model_type: str) -> str | None:
    """A checkpoint tensor's name as `hf_param_map` spells it; None for one to skip."""
    if name.endswith(".rotary_emb.inv_freq"):
        return None  # a buffer older exports saved; recomputed from the config
    if model_type == "gemma3":
        if name.startswith(_GEMMA3_VISION):
            return None
        for old, new in _GEMMA3_PREFIXES.items():
            if name.startswith(old):
                return new + name[len(old) :]
    return name


class _Checkpoint(Mapping[str, np.ndarray]):
    """The tensors of ``model.safetensors`` or of the shards an index lists, by the names
    `hf_param_map` uses, read one at a time as float32. `listing` is the file that lists
    them (the index, or ``model.safetensors`` itself), for messages."""

    def __init__(self, directory: Path, model_type: str, stack: contextlib.ExitStack):
        index = directory / INDEX_FILE
        single = directory / SINGLE_FILE
        where_from_index = index.is_file()
        if where_from_index:
            where = _read_index(index)
        elif single.is_file():
            where = None
        else:
            raise FileNotFoundError(
                f"{directory}: no {SINGLE_FILE} and no {INDEX_FILE}; a Hugging Face checkpoint "
                "needs one of them"
            )
        files = sorted(set(where.values())) if where is not None else [SINGLE_FILE]
        handles = {}
        for name in files:
            shard = directory / name
            if not shard.exists():
                raise FileNotFoundError(f"{index}: shard {name!r} does not exist in {directory}")
            require_regular(shard)  # safe_open opens it by path: a FIFO would block it
            try:
                handles[name] = stack.enter_context(safe_open(str(shard), framework="numpy"))
            except Exception as err:  # the safetensors error types are not public
                raise ValueError(
                    f"{shard}: not a readable safetensors file (truncated or corrupt?): {err}"
                ) from None
        if where is None:
            where = {t: SINGLE_FILE for t in handles[SINGLE_FILE].keys()}
        else:
            for tensor, name in where.items():
                if tensor not in handles[name].keys():
                    raise ValueError(
                        f"{index}: tensor {tensor!r} is listed in shard {name!r}, which does "
                        "not hold it"
                    )
        self._directory = directory
        self.listing = index if where_from_index else single
        self._handles = handles
        self._where: dict[str, tuple[str, str]] = {}
        for tensor, name in where.items():
            ours = _our_name(tensor, model_type)
            if ours is not None:
                self._where[ours] = (name, tensor)

    def __getitem__(self, name: str) -> np.ndarray:
        shard, tensor = self._where[name]
        handle = self._handles[shard]
        dtype = handle.get_slice(tensor).get_dtype()
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"{self._directory / shard}: tensor {tensor!r} is {dtype}; only "
                f"{', '.join(_FLOAT_DTYPES)} checkpoints load"
            )
        try:
            array = handle.get_tensor(tensor)
        except Exception as err:
            raise ValueError(f"{self._directory / shard}: tensor {tensor!r}: {err}") from None
        return np.asarray(array, np.float32)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def file_of(self, name: str) -> Path:
        return self._directory / self._where[name][0]


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = load_json(read_text(index), str(index)).get("weight_map")
    except (OSError, ValueError, AttributeError) as err:
        raise ValueError(f"{index}: not a safetensors index ({err})") from None
    ok = isinstance(weight_map, dict) and all(
        isinstance(k, str) and isinstance(v, str) and "/" not in v and "\\" not in v
        for k, v in weight_map.items()
    )
    if not ok or not weight_map:
        raise ValueError(
            f"{index}: field 'weight_map' must map tensor names to shard file names in the "
            "same directory"
        )
    return weight_map


# The fewest bytes a layer's tensors take in safetensors files: each tensor has a header entry
# (``"n":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}``, over 40 bytes) and its data.
_MIN_LAYER_BYTES = 48


def _check_declared_layers(config_json: Mapping[str, Any], directory: Path) -> None:
    """Refuses a ``num_hidden_layers`` the weight files are too small to hold, before the
    per-layer lists and maps are built from it (their cost follows the declaration, so a
    small directory declaring 10**9 layers would take gigabytes)."""
    try:
        declared = _text_config(config_json, str(directory / "config.json")).get(
            "num_hidden_layers"
        )
    except ValueError:
        return  # `decoder_config_from_hf` names the problem
    if not isinstance(declared, int) or isinstance(declared, bool) or declared <= 0:
        return
    index = directory / INDEX_FILE
    if not index.is_file() and not (directory / SINGLE_FILE).is_file():
        raise FileNotFoundError(
            f"{directory}: no {SINGLE_FILE} and no {INDEX_FILE}; a Hugging Face checkpoint "
            "needs one of them"
        )
    files = sorted(set(_read_index(index).values())) if index.is_file() else [SINGLE_FILE]
    size = sum(os.path.getsize(directory / n) for n in files if (directory / n).is_file())
    if declared * _MIN_LAYER_BYTES > size:
        raise ValueError(
            f"{directory / 'config.json'}: field 'num_hidden_layers' is {declared}, but the "
            f"weight files hold {size} bytes, room for at most {size // _MIN_LAYER_BYTES} "
            "layers; the config does not belong to these weights (or they are truncated)"
        )


def read_hf_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """``config.json`` of a Hugging Face checkpoint directory, as a dict."""
    path = Path(directory) / "config.json"
    try:
        config = load_json(read_text(path), str(path))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a JSON object ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return config


def load_decoder_hf(
    directory: str | os.PathLike[str], dtype: Any = jnp.float32, *, tokenizer: bool = True
) -> tuple[Decoder, Tokenizer | None]:
    """Load a Hugging Face decoder checkpoint directory as a float `Decoder` in `dtype`.

    Reads ``config.json``, ``model.safetensors`` or the shards ``model.safetensors.index.json``
    lists (float32 / float16 / bfloat16 tensors, one at a time), and ``tokenizer.json``
    (skipped, and None returned in its place, with ``tokenizer=False``). ``config.json``'s
    ``torch_dtype`` / ``dtype`` is informational: each tensor's own dtype is read.

    Raises:
      FileNotFoundError: naming the file: no ``config.json``, no weights, a shard the index
        lists, or ``tokenizer.json`` (when `tokenizer`).
      ValueError: naming the file and the field or tensor: `decoder_config_from_hf`'s errors,
        a truncated or corrupt shard, a tensor the index lists that its shard lacks, a tensor
        the model does not use, a missing tensor, or a shape that disagrees with the config.
    """
    directory = Path(directory)
    config_json = read_hf_config(directory)
    _check_declared_layers(config_json, directory)
    config = decoder_config_from_hf(config_json, directory / "config.json")
    tokenizer_path = directory / "tokenizer.json"
    if tokenizer and not tokenizer_path.is_file():
        raise FileNotFoundError(
            f"{tokenizer_path} does not exist; pass tokenizer=False to load the model alone"
        )
    with contextlib.ExitStack() as stack:
        checkpoint = _Checkpoint(directory, config_json["model_type"], stack)
        fused = "model.layers.0.mlp.experts.gate_up_proj" in checkpoint
        mapping = hf_param_map(config, fused_experts=fused)
        unknown = [n for n in checkpoint if n not in mapping]
        if unknown:
            raise ValueError(
                f"{checkpoint.file_of(unknown[0])}: tensor {unknown[0]!r} is not used by a "
                f"{config.architecture} model of this config.json"
            )
        model = Decoder.abstract(config, dtype=dtype, param_dtype=dtype)
        try:
            assign_params(model, checkpoint, mapping, dtype)
        except CheckpointError as err:
            found = err.tensor is not None and err.tensor in checkpoint
            raise ValueError(
                f"{checkpoint.file_of(err.tensor) if found else checkpoint.listing}: {err}"
            ) from None
    return model, Tokenizer.from_file(str(tokenizer_path)) if tokenizer else None
