"""`LayerStack.abstract`: one traced layer, cloned, equals `nnx.eval_shape`'s model."""

import jax.numpy as jnp
import pytest
from flax import nnx

from lowbit import models

CASES = [
    (
        models.Decoder,
        models.DecoderConfig(
            vocab_size=97, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48
        ),
    ),
    (models.Bert, models.BertConfig(n_layers=2, vocab_size=100, dim=24, n_heads=4, ffn_dim=48)),
]


def _shapes(module):
    return [(p, v.shape, v.dtype) for p, v in nnx.to_flat_state(nnx.state(module))]


@pytest.mark.parametrize("cls, config", CASES, ids=lambda v: getattr(v, "__name__", ""))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_abstract_matches_eval_shape(cls, config, dtype):
    got = cls.abstract(config, dtype=dtype, param_dtype=dtype)
    want = nnx.eval_shape(lambda: cls(config, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)))
    assert nnx.graphdef(got) == nnx.graphdef(want)
    assert _shapes(got) == _shapes(want)
    assert got.config == config
