"""A Hugging Face ``config.json`` read into a `DecoderConfig` (`decoder_config_from_hf`).

Both spellings are read: transformers 4's (``rope_theta``, ``rope_scaling``) and transformers
5's (``rope_parameters``, possibly per layer type). Which layers slide comes from
``layer_types`` or each family's rule; unset fields take the family's defaults
(``hf_defaults.json``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ._decoder_config import DecoderConfig

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
