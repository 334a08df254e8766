"""What transformers assumes for ``config.json`` fields a file leaves out, per model type.

``save_pretrained`` may write only the fields that differ from the config class's defaults
(Gemma 3's nested ``text_config`` routinely omits head counts, ``head_dim``,
``query_pre_attn_scalar`` and RoPE bases), so reading a file faithfully needs the class
defaults. These are transformers' (4.x and 5.x agree on them) for the fields
`decoder_config_from_hf` reads; fields transformers derives from others (``head_dim`` as
``hidden_size / num_attention_heads``, ``num_key_value_heads`` as ``num_attention_heads``)
are derived there instead. Only absent keys take these values: an explicit ``null`` stays.
"""

from __future__ import annotations

from typing import Any

_LLAMA_LIKE: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
)
_QWEN: dict[str, Any] = dict(
    _LLAMA_LIKE,
    vocab_size=151936,
    max_position_embeddings=32768,
    use_sliding_window=False,
    max_window_layers=28,
)
_QWEN_MOE: dict[str, Any] = dict(
    _QWEN,
    hidden_size=2048,
    num_hidden_layers=24,
    norm_topk_prob=False,
    decoder_sparse_step=1,
)
_MISTRAL: dict[str, Any] = dict(
    _LLAMA_LIKE,
    intermediate_size=14336,
    num_key_value_heads=8,
    max_position_embeddings=131072,
)
_GEMMA: dict[str, Any] = dict(
    vocab_size=256000,
    head_dim=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
# Gemma 2's shapes and local attention, which Gemma 3's text model keeps.
_GEMMA2_LIKE: dict[str, Any] = dict(
    _GEMMA,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    sliding_window=4096,
    query_pre_attn_scalar=256,
)

HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(_LLAMA_LIKE, intermediate_size=11008, max_position_embeddings=2048),
    "mistral": dict(_MISTRAL, sliding_window=4096),
    "mixtral": dict(
        _MISTRAL, rms_norm_eps=1e-5, rope_theta=1e6, num_local_experts=8, num_experts_per_tok=2
    ),
    "qwen2": dict(_QWEN, intermediate_size=22016, num_key_value_heads=32),
    "qwen3": dict(_QWEN, intermediate_size=22016, num_key_value_heads=32, head_dim=128),
    "qwen2_moe": dict(
        _QWEN_MOE,
        intermediate_size=5632,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=60,
        num_experts_per_tok=4,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
    ),
    "qwen3_moe": dict(
        _QWEN_MOE,
        intermediate_size=6144,
        num_attention_heads=32,
        num_key_value_heads=4,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
    "gemma": dict(
        _GEMMA,
        hidden_size=3072,
        intermediate_size=24576,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=16,
    ),
    "gemma2": dict(_GEMMA2_LIKE, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3_text": dict(
        _GEMMA2_LIKE,
        vocab_size=262208,
        rope_theta=1e6,
        rope_local_base_freq=10000.0,
        sliding_window_pattern=6,
        max_position_embeddings=131072,
    ),
    "phi3": dict(
        _LLAMA_LIKE,
        vocab_size=32064,
        hidden_size=3072,
        intermediate_size=8192,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
    ),
}
"""model_type -> the config class's default for each field it has (see the module)."""
