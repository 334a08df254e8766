"""llama.cpp's per-tensor types of its mixes (`planned_types`), checked against the types
llama.cpp's quantizer wrote for SmolLM2-135M (rows of 576: attention and gate/up fall back)."""

import pytest
from flax import nnx

from lowbit.io import LLAMA_MIXES, check_mix, planned_types
from lowbit.models import Decoder, DecoderConfig

SMOLLM2 = DecoderConfig(
    vocab_size=49152,
    dim=576,
    n_layers=30,
    n_heads=9,
    n_kv_heads=3,
    head_dim=64,
    ffn_dim=1536,
    tie_embeddings=True,
)
MORE_BITS = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}  # llama.cpp's use_more_bits


def _per_layer(fn):
    return [fn(i) for i in range(30)]


# What llama.cpp's quantizer wrote (read from its files for SmolLM2-135M): GGUF role ->
# type, or a list over the 30 layers.
WRITTEN = {
    "Q2_K": {
        "token_embd": "Q8_0",
        "attn_q": "Q4_0",
        "attn_k": "Q4_0",
        "attn_v": "Q4_0",
        "attn_output": "Q4_0",
        "ffn_gate": "Q4_0",
        "ffn_up": "Q4_0",
        "ffn_down": "Q3_K",
    },
    "Q3_K_M": {
        "token_embd": "Q8_0",
        "attn_q": "Q4_0",
        "attn_k": "Q4_0",
        "attn_v": _per_layer(lambda i: "Q5_1" if i < 2 else "Q5_0"),
        "attn_output": "Q5_0",
        "ffn_gate": "Q4_0",
        "ffn_up": "Q4_0",
        "ffn_down": _per_layer(lambda i: "Q5_K" if i < 1 else "Q4_K"),
    },
    "Q4_K_M": {
        "token_embd": "Q8_0",
        "attn_q": "Q5_0",
        "attn_k": "Q5_0",
        "attn_v": _per_layer(lambda i: "Q8_0" if i in MORE_BITS else "Q5_0"),
        "attn_output": "Q5_0",
        "ffn_gate": "Q5_0",
        "ffn_up": "Q5_0",
        "ffn_down": _per_layer(lambda i: "Q6_K" if i in MORE_BITS else "Q4_K"),
    },
    "Q5_K_M": {
        "token_embd": "Q8_0",
        "attn_q": "Q5_1",
        "attn_k": "Q5_1",
        "attn_v": _per_layer(lambda i: "Q8_0" if i in MORE_BITS else "Q5_1"),
        "attn_output": "Q5_1",
        "ffn_gate": "Q5_1",
        "ffn_up": "Q5_1",
        "ffn_down": _per_layer(lambda i: "Q6_K" if i in MORE_BITS else "Q5_K"),
    },
    "Q6_K": {
        "token_embd": "Q8_0",
        "attn_q": "Q8_0",
        "attn_k": "Q8_0",
        "attn_v": "Q8_0",
        "attn_output": "Q8_0",
        "ffn_gate": "Q8_0",
        "ffn_up": "Q8_0",
        "ffn_down": "Q6_K",
    },
}
PATHS = {
    "attn_q": "attn/q_proj/kernel",
    "attn_k": "attn/k_proj/kernel",
    "attn_v": "attn/v_proj/kernel",
    "attn_output": "attn/o_proj/kernel",
    "ffn_gate": "mlp/gate_proj/kernel",
    "ffn_up": "mlp/up_proj/kernel",
    "ffn_down": "mlp/down_proj/kernel",
}


@pytest.fixture(scope="module")
def smollm2_shapes():
    return nnx.split(Decoder.abstract(SMOLLM2))[1].to_pure_dict()


@pytest.mark.parametrize("mix", sorted(WRITTEN))
def test_mix_types_match_llama_cpp_files(smollm2_shapes, mix):
    types = planned_types(smollm2_shapes, SMOLLM2, mix.lower())
    want = {"embed/embedding": WRITTEN[mix]["token_embd"]}
    for role, path in PATHS.items():
        written = WRITTEN[mix][role]
        for i in range(SMOLLM2.n_layers):
            want[f"layers/{i}/{path}"] = written[i] if isinstance(written, list) else written
    assert types == want


def test_unknown_mix_names_the_accepted():
    with pytest.raises(ValueError, match="'Q3_K_XL' is not a llama.cpp mix.*Q2_K.*Q3_K_M"):
        check_mix("Q3_K_XL")
    assert set(LLAMA_MIXES) >= {"Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q6_K", "Q4_0", "Q8_0"}
