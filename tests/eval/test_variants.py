"""`lowbit.eval.quantize_variant`: `lowbit.serving.apply_recipe` calibrated on a text."""

import jax
from flax import nnx
from tokenizers import Tokenizer, models, pre_tokenizers

from lowbit import serving
from lowbit.eval import quantize_variant
from lowbit.ops import PreparedQArray
from lowbit.qarray import QArray

WORDS = [f"w{i}" for i in range(63)]


def _tiny_lm():
    from lowbit.models import Llama, LlamaConfig

    config = LlamaConfig(
        vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128
    )
    tokenizer = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(["<unk>", *WORDS])}, "<unk>")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    model = Llama(config, rngs=nnx.Rngs(0))
    return serving.LoadedModel(name="t", spec="t", kind="lm", model=model, tokenizer=tokenizer)


def test_gptq_variant_calibrates_on_the_given_text(tmp_path):
    loaded = _tiny_lm()
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(WORDS[i % 11] for i in range(600)))
    batches = []
    params, recipe = quantize_variant(
        loaded,
        nnx.state(loaded.model),
        "int4w_g64_gptq",
        calibration_file=str(text),
        calibration_sequences=1,
        on_batch=lambda done, total: batches.append((done, total)),
    )
    assert batches[-1] == (1, 1)
    is_q = lambda x: isinstance(x, QArray | PreparedQArray)
    assert any(is_q(x) for x in jax.tree.leaves(params, is_leaf=is_q))
    # The statistics are cached per model and calibration set: no second pass.
    quantize_variant(
        loaded,
        nnx.state(loaded.model),
        "int4w_g64_gptq",
        calibration_file=str(text),
        calibration_sequences=1,
        on_batch=lambda done, total: batches.append(None),
    )
    assert None not in batches
