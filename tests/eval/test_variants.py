"""`lowbit.eval.quantize_variant`: `lowbit.serving.apply_recipe` calibrated on a text."""

import jax
from flax import nnx
from lm_support import WORDS, tiny_lm

from lowbit.eval import quantize_variant
from lowbit.ops import PreparedQArray
from lowbit.qarray import QArray


def test_gptq_variant_calibrates_on_the_given_text(tmp_path):
    loaded = tiny_lm(dim=64, ffn_dim=128)
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
