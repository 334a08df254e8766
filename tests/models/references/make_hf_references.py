"""Write the tiny Hugging Face decoder checkpoints and reference logits that
`tests/models/test_decoder_hf.py` compares lowbit's `load_decoder_hf` against.

Run with an environment that has ``torch`` and ``transformers`` (never a test dependency):

    python tests/models/references/make_hf_references.py

For each model type it builds a tiny random model (hidden 64, 4 heads, 2 key/value heads,
head_dim 16, vocabulary 256, 2-3 layers, windows of 8 so a 24-token prompt exercises them),
saves it with ``save_pretrained(safe_serialization=True)`` into ``hf/<type>/`` with a tiny
word-level ``tokenizer.json`` (``t0`` .. ``t255``), and stores the float32 logits of a fixed
24-token prompt (eager attention, the saved checkpoint read back in float32) in
``hf_logits.npz`` under the type's name. Four checkpoints are bfloat16 (to keep the directory
small), Llama's is split into shards with an index, Qwen3-MoE's is saved with transformers 5's
fused expert tensors (``save_original_format=False``) and the other mixtures of experts per
expert (the original format).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

HERE = Path(__file__).parent
OUT = HERE / "hf"
PROMPT = np.random.RandomState(0).randint(0, 256, size=24)

SHAPES = dict(
    vocab_size=256,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)

# model_type -> (config class, model class, config overrides, save options)
SPECS = {
    "llama": (
        "DecoderConfig",
        "LlamaForCausalLM",
        dict(
            num_hidden_layers=2,
            tie_word_embeddings=False,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
            rope_theta=10000.0,
        ),
        dict(max_shard_size="200KB"),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(num_hidden_layers=2, sliding_window=8),
        dict(bf16=True),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            num_hidden_layers=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=24,
            sliding_window=8,
        ),
        {},
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(num_hidden_layers=2, tie_word_embeddings=True),
        {},
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(num_hidden_layers=2, tie_word_embeddings=True),
        dict(bf16=True),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(num_hidden_layers=2, shared_expert_intermediate_size=64, norm_topk_prob=False, **MOE),
        dict(bf16=True),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_hidden_layers=2, norm_topk_prob=True, **MOE),
        dict(save_original_format=False),
    ),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(num_hidden_layers=2), dict(bf16=True)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_hidden_layers=2,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
        {},
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=3,
            sliding_window=8,
            sliding_window_pattern=3,
            query_pre_attn_scalar=16,
            rope_scaling=dict(rope_type="linear", factor=4.0),
            rope_local_base_freq=10000.0,
            rope_theta=1000000.0,
        ),
        {},
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(num_hidden_layers=2, sliding_window=8, tie_word_embeddings=False),
        {},
    ),
}


def _tokenizer() -> Tokenizer:
    """A word-level tokenizer over the 256 words ``t0`` .. ``t255``."""
    vocab = {f"t{i}": i for i in range(256)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def _randomize(model: torch.nn.Module) -> None:
    # Norm weights start at 1 (0 for Gemma's 1 + w): perturb every parameter so a wrong
    # mapping or a forgotten offset changes the logits.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    logits = {}
    for seed, (name, (config_cls, model_cls, overrides, save)) in enumerate(SPECS.items()):
        torch.manual_seed(seed)
        shapes = dict(SHAPES)
        if name.endswith("moe"):
            shapes["intermediate_size"] = 64
        config = getattr(transformers, config_cls)(**{**shapes, **overrides})
        config._attn_implementation = "eager"
        model = getattr(transformers, model_cls)(config).eval()
        _randomize(model)
        save = dict(save)
        if save.pop("bf16", False):
            model = model.to(torch.bfloat16)
        target = OUT / name
        model.save_pretrained(target, safe_serialization=True, **save)
        _tokenizer().save(str(target / "tokenizer.json"))
        # The reference runs the saved checkpoint read back in float32 (so bfloat16 weights
        # are rounded as the loader sees them, and RoPE tables are computed afresh).
        reloaded = (
            getattr(transformers, model_cls)
            .from_pretrained(target, dtype=torch.float32, attn_implementation="eager")
            .eval()
        )
        with torch.no_grad():
            out = reloaded(torch.tensor(PROMPT[None]), use_cache=False).logits
        logits[name] = out[0].numpy().astype(np.float32)
        print(name, sorted(p.name for p in target.iterdir()))
    np.savez_compressed(HERE / "hf_logits.npz", prompt=PROMPT.astype(np.int32), **logits)
    (HERE / "hf_versions.json").write_text(
        json.dumps({"torch": torch.__version__, "transformers": transformers.__version__}) + "\n"
    )


if __name__ == "__main__":
    main()
