"""llama.cpp's per-tensor types: which GGML type its quantizer gives each tensor of a model in
each mix (``llama-quantize``'s file types), and the fallback for rows that are not whole blocks
of a type. Export (`lowbit.io._gguf_export`), size plans and QAT onto mixes read these rules.
"""

from __future__ import annotations

from lowbit.gguf import FLOAT_TYPES, block_type
from lowbit.models import DecoderConfig

K_FALLBACK = {
    "Q2_K": "Q4_0",
    "Q3_K": "Q4_0",
    "Q4_K": "Q5_0",
    "Q5_K": "Q5_1",
    "Q6_K": "Q8_0",
    "Q8_K": "Q8_0",
    "TQ1_0": "Q4_0",
    "TQ2_0": "Q4_0",
    "IQ4_NL": "Q5_0",
    "Q4_0": "Q5_0",
    "Q4_1": "Q5_1",
    "Q5_0": "Q8_0",
    "Q5_1": "Q8_0",
    "Q8_0": "F16",
}
"""Type -> what a tensor whose rows are not whole blocks of it is written as instead (llama.cpp's
choices; applied until the rows fit)."""

MIXES = ("Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M")
"""llama.cpp mixes an export type names (their names are no GGML type's)."""
LLAMA_MIXES = ("Q2_K", *MIXES, "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
"""Every llama.cpp mix (``llama-quantize`` file type) `mix_type` knows: `MIXES` and those
named like the GGML type most of their weights take."""
_MIX_BASE = {"Q2_K": "Q2_K", "Q3_K": "Q3_K", "Q4_K": "Q4_K", "Q5_K": "Q5_K"}


def _use_more_bits(i: int, n: int) -> bool:
    # llama.cpp's rule for the _M mixes.
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def check_mix(mix: str) -> str:
    """The canonical spelling of a llama.cpp mix name; ValueError listing `LLAMA_MIXES`."""
    canonical = str(mix).upper()
    if canonical not in LLAMA_MIXES:
        raise ValueError(
            f"{mix!r} is not a llama.cpp mix lowbit knows; accepted: {', '.join(LLAMA_MIXES)}"
        )
    return canonical


def mix_type(name: str, mix: str, config: DecoderConfig) -> str | None:
    """The type llama.cpp's quantizer gives GGUF tensor `name` in `mix` (before the fallback
    for rows that are not whole blocks, `_fitting`); None for a tensor it keeps float.

    Follows ``llama_tensor_get_type`` of llama.cpp for dense, non-Falcon models.

    Args:
      name: a GGUF tensor name (``blk.3.attn_v.weight``, ``output.weight``, ...).
      mix: one of `LLAMA_MIXES`.
      config: the model's `DecoderConfig` (layer count, grouped-query ratio, tied embedding).
    """
    if name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")):
        return None  # expert routers stay float, as llama.cpp's quantizer keeps them
    mix = check_mix(mix)
    base = _MIX_BASE.get(mix[:4], mix)
    n = config.n_layers
    if name == "output.weight" or (config.tie_embeddings and name == "token_embd.weight"):
        return "Q8_0" if base == "Q8_0" else "Q6_K"
    if not name.startswith("blk."):
        return base
    layer = int(name.split(".")[1])
    if name.endswith("attn_v.weight"):
        gqa = config.n_heads // config.n_kv_heads
        if mix == "Q2_K":
            return "Q4_K" if gqa >= 4 else "Q3_K"
        if mix == "Q3_K_M":
            return "Q5_K" if layer < 2 else "Q4_K"
        if mix == "Q3_K_L":
            return "Q5_K"
        if mix in ("Q4_K_M", "Q5_K_M") and _use_more_bits(layer, n):
            return "Q6_K"
        if mix == "Q4_K_S" and layer < 4:
            return "Q5_K"
        return base
    if name.endswith("ffn_down.weight"):
        if mix == "Q2_K":
            return "Q3_K"
        if mix == "Q3_K_M":
            return "Q5_K" if layer < n // 16 else "Q4_K"
        if mix == "Q3_K_L":
            return "Q5_K"
        if mix in ("Q4_K_M", "Q5_K_M") and _use_more_bits(layer, n):
            return "Q6_K"
        if mix == "Q4_K_S" and layer < n // 8:
            return "Q5_K"
        return base
    if name.endswith("attn_output.weight"):
        return {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(mix, base)
    return base


def fitting_type(type_: str, name: str, row: int, strict: bool) -> tuple[str, str]:
    """`type_` or its fallback for rows of `row` elements: (type, note)."""
    chosen = type_
    while chosen not in FLOAT_TYPES and row % block_type(chosen).block_size:
        if strict:
            raise ValueError(
                f"tensor {name!r}: rows of {row} elements are not a multiple of the "
                f"{chosen} block size {block_type(chosen).block_size}; drop strict "
                "(--strict) to fall back per tensor, or choose a type with blocks of 32"
            )
        chosen = K_FALLBACK[chosen]
    note = "" if chosen == type_ else f"rows of {row} are not whole {type_} blocks: {chosen}"
    return chosen, note
