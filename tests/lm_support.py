"""A tiny word-level language model, loaded as `lowbit.serving` loads one, for the serving and
evaluation tests."""

from flax import nnx
from tokenizers import Tokenizer, models, pre_tokenizers

from lowbit import serving
from lowbit.models import Decoder, DecoderConfig

WORDS = [f"w{i}" for i in range(63)]


def tiny_lm(dim: int, ffn_dim: int) -> serving.LoadedModel:
    """A one-layer random Llama of width `dim` (vocabulary ``<unk>`` and `WORDS`)."""
    config = DecoderConfig(
        vocab_size=64,
        dim=dim,
        n_layers=1,
        n_heads=4,
        n_kv_heads=2,
        head_dim=dim // 4,
        ffn_dim=ffn_dim,
    )
    tokenizer = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(["<unk>", *WORDS])}, "<unk>")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    model = Decoder(config, rngs=nnx.Rngs(0))
    return serving.LoadedModel(
        name="tiny", spec="tiny", kind="lm", model=model, tokenizer=tokenizer
    )
