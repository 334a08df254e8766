"""A small Llama (matmuls big enough for the CPU kernels) and a word-level tokenizer."""

import pytest
from flax import nnx
from tokenizers import Tokenizer, models, pre_tokenizers

from lowbit import serving

WORDS = [f"w{i}" for i in range(63)]


@pytest.fixture
def tiny_lm():
    from lowbit.models import Llama, LlamaConfig

    config = LlamaConfig(
        vocab_size=64, dim=256, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512
    )
    tokenizer = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(["<unk>", *WORDS])}, "<unk>")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return serving.LoadedModel(
        name="tiny",
        spec="tiny",
        kind="lm",
        model=Llama(config, rngs=nnx.Rngs(0)),
        tokenizer=tokenizer,
    )
