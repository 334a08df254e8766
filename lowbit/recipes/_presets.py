"""Named recipes: MaxText's `quantization` flag values, torchao-style config names, demo names.

Mapping of MaxText's values (its AQT and Qwix paths):

  * ``int8``     — w8a8: int8 per-channel weights, int8 dynamic per-token activations.
  * ``int8w``    — int8 per-channel weights only.
  * ``int4w``    — int4 per-channel weights only.
  * ``int4``     — Qwix's ``int4`` rule quantizes weights *and* activations to int4: w4a4 with
    dynamic per-token activations (not w4a8).
  * ``fp8``      — float8 e4m3 weights (per-channel) and dynamic per-token e4m3 activations.
  * ``fp8_full`` — ``fp8`` plus e5m2 gradient matmuls in QAT (the DeepSeek-V3 fine-tuning
    recipe: e4m3 forward, e5m2 backward).
  * ``fp4``      — not a MaxText value; here fp4 e2m1 weights only, groups of 32 with float
    scales (use ``mxfp4`` / ``nvfp4`` for the standard block formats).
  * ``intmp``    — mixed precision from MaxText's JSON: `preset_from_maxtext_json`.

MaxText applies its rules to ``dot_general`` inside decoder layers only; these presets apply to
every 2-D+ weight with a ``kernel`` / ``embedding`` / ``weight`` path (see `_builders`) and leave
no op filter, so they work without tracing the model. Wrap them with `Recipe` rules placed
first (``Rule(path=".*embedding")`` keeps embeddings in float) to narrow them.

QAT gradients: only ``fp8_full`` quantizes gradients; the other presets train with float
gradients through the straight-through estimator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from lowbit.qarray import AbsMax, MinMax, QuantConfig
from lowbit.recipes._algorithm import AWQ, GPTQ, HQQ, Algorithm, SmoothQuant
from lowbit.recipes._builders import activation_config, matmul_rules
from lowbit.recipes._recipe import Recipe
from lowbit.recipes._rule import Rule

# Registered names of the non-integer formats the presets use.
E4M3 = "fp8_e4m3fn"
E5M2 = "fp8_e5m2"
E2M1 = "fp4_e2m1"
NF4 = "nf4"
MXFP4 = "mxfp4"
NVFP4 = "nvfp4"


def _recipe(name: str, rules: tuple[Rule, ...]) -> Recipe:
    return Recipe(rules=rules, name=name)


def float_recipe() -> Recipe:
    """Every parameter in float (a baseline)."""
    return _recipe("float", (Rule(path=".*"),))


def int8_weight_only() -> Recipe:
    """int8 symmetric per-channel weights; activations stay float."""
    return _recipe("int8_weight_only", matmul_rules("int8"))


def int4_weight_only(group_size: int = 128) -> Recipe:
    """uint4 asymmetric weights (zero point, min/max bounds) in groups of `group_size` along the
    contraction axis, as torchao's int4 weight-only layout; activations stay float."""
    return _recipe(
        f"int4_weight_only(group_size={group_size})",
        matmul_rules("uint4", group_size=group_size, symmetric=False, calibration=MinMax()),
    )


def int8_dynamic_activation_int8_weight() -> Recipe:
    """w8a8: int8 per-channel weights, int8 dynamic per-token activations."""
    return _recipe(
        "int8_dynamic_activation_int8_weight",
        matmul_rules("int8", activation=activation_config("int8")),
    )


def int8_dynamic_activation_int4_weight(group_size: int = 32) -> Recipe:
    """w4a8: int4 symmetric weights in groups of `group_size`, int8 per-token activations."""
    return _recipe(
        f"int8_dynamic_activation_int4_weight(group_size={group_size})",
        matmul_rules("int4", group_size=group_size, activation=activation_config("int8")),
    )


def float8_weight_only() -> Recipe:
    """float8 e4m3 per-channel weights; activations stay float."""
    return _recipe("float8_weight_only", matmul_rules(E4M3))


def float8_dynamic_activation_float8_weight(per_row: bool = False) -> Recipe:
    """e4m3 weights and dynamic e4m3 activations; per-tensor scales (torchao's default), or
    per-channel weights and per-token activations with `per_row`."""
    return _recipe(
        "float8_dynamic_activation_float8_weight",
        matmul_rules(
            E4M3,
            per_tensor=not per_row,
            activation=activation_config(E4M3, per_tensor=not per_row),
        ),
    )


def nf4(group_size: int = 64) -> Recipe:
    """NF4 weights (QLoRA's normal-float grid) in groups of `group_size`, absmax scales."""
    return _recipe(f"nf4(group_size={group_size})", matmul_rules(NF4, group_size=group_size))


def mxfp4() -> Recipe:
    """MXFP4 weights: e2m1 elements in blocks of 32 along the contraction axis, E8M0 scales."""
    return _recipe("mxfp4", matmul_rules(MXFP4, group_size=32))


def nvfp4() -> Recipe:
    """NVFP4 weights: e2m1 elements in blocks of 16, e4m3 block scales and a tensor scale."""
    return _recipe("nvfp4", matmul_rules(NVFP4, group_size=16))


def _maxtext(name: str, fmt: str, act: str | None, grad: str | None = None) -> Recipe:
    activation = None if act is None else activation_config(act)
    gradient = (
        None if grad is None else QuantConfig(format=grad, granularity=activation.granularity)
    )
    return _recipe(name, matmul_rules(fmt, activation=activation, gradient=gradient))


def _intmp() -> Recipe:
    raise ValueError(
        "preset 'intmp' reads a MaxText mixed-precision JSON: use "
        "preset_from_maxtext_json(path_or_dict)"
    )


# name -> (builder, one-line description)
_PRESETS: dict[str, tuple[Callable[..., Recipe], str]] = {
    # MaxText
    "int8": (
        lambda: _maxtext("int8", "int8", "int8"),
        "w8a8: int8 per-channel weights, int8 dynamic per-token activations (MaxText int8)",
    ),
    "int8w": (lambda: _maxtext("int8w", "int8", None), "int8 per-channel weights only"),
    "int4w": (lambda: _maxtext("int4w", "int4", None), "int4 per-channel weights only"),
    "int4": (
        lambda: _maxtext("int4", "int4", "int4"),
        "w4a4: int4 weights and int4 dynamic per-token activations (MaxText/Qwix int4)",
    ),
    "fp8": (lambda: _maxtext("fp8", E4M3, E4M3), "e4m3 weights and dynamic e4m3 activations"),
    "fp8_full": (
        lambda: _maxtext("fp8_full", E4M3, E4M3, E5M2),
        "fp8 plus e5m2 gradient matmuls in QAT",
    ),
    "fp4": (
        lambda: _recipe("fp4", matmul_rules(E2M1, group_size=32)),
        "e2m1 weights only, groups of 32 with float scales",
    ),
    "intmp": (_intmp, "MaxText mixed precision from JSON (preset_from_maxtext_json)"),
    # torchao-style
    "int8_weight_only": (int8_weight_only, "int8 per-channel weights only"),
    "int4_weight_only": (
        int4_weight_only,
        "uint4 asymmetric weights, groups of 128 (group_size=...)",
    ),
    "int8_dynamic_activation_int8_weight": (
        int8_dynamic_activation_int8_weight,
        "w8a8 dynamic per-token activations",
    ),
    "int8_dynamic_activation_int4_weight": (
        int8_dynamic_activation_int4_weight,
        "w4a8: int4 groups of 32, int8 per-token activations (group_size=...)",
    ),
    "float8_weight_only": (float8_weight_only, "e4m3 per-channel weights only"),
    "float8_dynamic_activation_float8_weight": (
        float8_dynamic_activation_float8_weight,
        "e4m3 weights and activations, per-tensor scales (per_row=True for per-channel/token)",
    ),
    "nf4": (nf4, "NF4 weights, groups of 64 (group_size=...)"),
    "mxfp4": (mxfp4, "MXFP4 weights: e2m1 blocks of 32 with E8M0 scales"),
    "nvfp4": (nvfp4, "NVFP4 weights: e2m1 blocks of 16, e4m3 scales and a tensor scale"),
    # demo names
    "float": (float_recipe, "everything in float (baseline)"),
    "int4w_g32_asym": (
        lambda: _demo_4bit(
            "int4w_g32_asym",
            matmul_rules("uint4", group_size=32, symmetric=False, calibration=MinMax()),
        ),
        "uint4 asymmetric weights, groups of 32, min/max bounds; int8 embeddings",
    ),
    "int4w_g64": (
        lambda: _demo_4bit("int4w_g64", matmul_rules("int4", group_size=64)),
        "int4 symmetric weights, groups of 64; int8 embeddings",
    ),
    "nf4_g64": (
        lambda: _demo_4bit("nf4_g64", nf4(64).rules),
        "NF4 weights, groups of 64; int8 embeddings",
    ),
}


def _demo_4bit(name: str, rules: tuple[Rule, ...]) -> Recipe:
    # The embedding table is read by a lookup and, tied, by the logits: 4 bits there costs far
    # more than in the linear layers, so the 4-bit demo recipes keep it at int8 per row (as
    # GGUF's Q4 files keep `token_embd` at Q8_0). The first rule of `matmul_rules` is the
    # embedding rule; an int8 one takes its place.
    embedding = matmul_rules("int8")[0]
    return _recipe(name, (embedding, *rules[1:]))


def _with_algorithm(name: str, base: Recipe, algorithm: Algorithm) -> Recipe:
    # The embedding rule (first) stays round-to-nearest int8: it is a lookup table and, tied,
    # the logits; the algorithm rounds the linear layers.
    rules = (base.rules[0], *(dataclasses.replace(r, algorithm=algorithm) for r in base.rules[1:]))
    return _recipe(name, rules)


def _gptq(name: str, base: Recipe, **extra: bool) -> Recipe:
    # GPTQ keeps the grid it is given, so the grid matters. The presets fold AWQ's scales
    # first and choose each group's range by AWQ's clipping search on the calibration Gram
    # matrix: on SmolLM2 (32 calibration sequences) int4 g64 went from +14.4% perplexity
    # (ranges from a per-group weight-MSE search) to +10.2% (clip search) and +8.7% (both).
    # One refinement sweep then moved it from +6.75% to +6.17% (128 sequences); three sweeps
    # fit the calibration set better and the evaluation text worse (+6.42%).
    return _with_algorithm(name, base, GPTQ(clip=True, scale=True, refine=1, **extra))


def _int_g64(bits: int) -> Recipe:
    return _demo_4bit(f"int{bits}w_g64", matmul_rules(f"int{bits}", group_size=64))


def _w4a8_g32() -> Recipe:
    # int4 weights with int8 per-token activations run on the integer (VNNI) kernels, several
    # times faster than weight-only int4 for prompts. The tied embedding is int8 per row; as
    # the logits projection it takes int8 activations too (the w8a8 kernel).
    act = activation_config("int8")
    embedding = matmul_rules("int8", activation=act)[0]
    rules = matmul_rules("int4", group_size=32, activation=act)
    return _recipe("w4a8_g32", (embedding, *rules[1:]))


def _uint4_g64_asym() -> Recipe:
    rules = matmul_rules("uint4", group_size=64, symmetric=False, calibration=MinMax())
    return _demo_4bit("int4w_g64_asym", rules)


_PRESETS.update(
    {
        "int4w_g64_asym": (
            _uint4_g64_asym,
            "uint4 asymmetric weights, groups of 64, min/max bounds; int8 embeddings",
        ),
        "int3w_g64": (lambda: _int_g64(3), "int3 symmetric weights, groups of 64; int8 embeddings"),
        "int4w_g64_gptq": (
            lambda: _gptq("int4w_g64_gptq", _int_g64(4)),
            "int4w_g64 with clip-searched scales, rounded by GPTQ (needs calibration data)",
        ),
        "int4w_g64_asym_gptq": (
            lambda: _gptq("int4w_g64_asym_gptq", _uint4_g64_asym()),
            "uint4 asymmetric g64 with clip-searched scales and zero points, rounded by GPTQ "
            "(needs calibration data)",
        ),
        "nf4_g64_gptq": (
            lambda: _gptq("nf4_g64_gptq", _demo_4bit("nf4_g64", nf4(64).rules)),
            "nf4_g64 with clip-searched scales, rounded by GPTQ (needs calibration data)",
        ),
        "int3w_g64_gptq": (
            # int3's extra negative level (-4): +48.3% -> +42.7% (128 sequences).
            lambda: _gptq("int3w_g64_gptq", _int_g64(3), full_range=True),
            "int3w_g64 with clip-searched scales, rounded by GPTQ (needs calibration data)",
        ),
        "int4w_g64_awq": (
            # AWQ's own format: AutoAWQ quantizes with zero points (as the HQQ preset does).
            # On SmolLM2 (128 sequences) +8.07% perplexity; on the symmetric int4 grid
            # (`int4w_g64_sym_awq`) +13.90%.
            lambda: _with_algorithm("int4w_g64_awq", _uint4_g64_asym(), AWQ()),
            "uint4 asymmetric g64 (int4w_g64_asym) with AWQ scales folded into the norms and up "
            "projections, and AWQ's clipping search (needs calibration data)",
        ),
        "int4w_g64_sym_awq": (
            lambda: _with_algorithm("int4w_g64_sym_awq", _int_g64(4), AWQ()),
            "int4w_g64 (symmetric) with AWQ scales folded into the norms and up projections, "
            "and AWQ's clipping search (needs calibration data)",
        ),
        "int8_smoothquant": (
            lambda: _with_algorithm(
                "int8_smoothquant", _maxtext("int8", "int8", "int8"), SmoothQuant(grid=10)
            ),
            "int8 (w8a8) with SmoothQuant scales folded into the norms and up projections, alpha "
            "searched per layer (needs calibration data)",
        ),
        "int4w_g32_asym_gptq": (
            # Plain GPTQ on the min/max grid (with the sweep): on MiniLM the clip search lowered
            # the cosine (0.9907 -> 0.9897, 4096 calibration sentences).
            lambda: _with_algorithm(
                "int4w_g32_asym_gptq", _PRESETS["int4w_g32_asym"][0](), GPTQ(refine=1)
            ),
            "int4w_g32_asym rounded by GPTQ (needs calibration data)",
        ),
        "w4a8_g32": (
            _w4a8_g32,
            "w4a8: int4 symmetric weights, groups of 32, int8 per-token activations; "
            "int8 embeddings (integer kernels)",
        ),
        "w4a8_g32_gptq": (
            lambda: _gptq("w4a8_g32_gptq", _w4a8_g32()),
            "w4a8_g32 with clip-searched scales, rounded by GPTQ (needs calibration data)",
        ),
        "int4w_g64_hqq": (
            lambda: _with_algorithm("int4w_g64_hqq", _uint4_g64_asym(), HQQ()),
            "uint4 asymmetric g64 with HQQ zero points (data-free)",
        ),
    }
)


def _w4a4_g32() -> Recipe:
    # w4a4: int4 weights and int4 activations, with a 4-bit KV cache; the tied embedding stays
    # int8 (with int8 activations as the logits projection), as in w4a8. The activations take
    # one scale per 32 features of a token (as MXFP4 / NVFP4 activations do), each range
    # clipped to 0.9 of its absmax (QuaRot's activation clipping). On SmolLM2, rotated, GPTQ,
    # 32 calibration sequences, int8 head activations: one scale a token +77.9% perplexity,
    # clipped +56.2% (0.8: +53.5%), groups of 32 +37.9%, both +33.9%.
    act = activation_config("int4", group_size=32, calibration=AbsMax(clip=0.9))
    embedding = matmul_rules("int8", activation=activation_config("int8"))[0]
    rules = matmul_rules("int4", group_size=32, activation=act)
    return Recipe(rules=(embedding, *rules[1:]), name="w4a4_g32", kv_cache="int4")


def _w4a4_gptq(name: str) -> Recipe:
    return dataclasses.replace(_gptq(name, _w4a4_g32()), kv_cache="int4")


def _rotated(name: str, base: Recipe) -> Recipe:
    # QuaRot-style rotations (`RotationConfig`: residual stream, value heads, down_proj's input
    # online) before calibrating. The rotation folds the final norm into the output head, so a
    # tied embedding comes back untied: the new `lm_head` gets int8 per output channel with
    # the activations the tied table had as the logits projection (int8 in w4a8 and w4a4;
    # w4a4's int4 activations there cost SmolLM2 +97.5% perplexity against +77.9%, 32
    # calibration sequences); the rest is the base recipe.
    kernel_rule = matmul_rules("int8", activation=base.rules[0].activation)[1]
    head = dataclasses.replace(kernel_rule, path=r"(.*/)?lm_head/kernel")
    return Recipe(rules=(head, *base.rules), name=name, kv_cache=base.kv_cache, rotate="hadamard")


_PRESETS.update(
    {
        "int4w_g64_rot_gptq": (
            lambda: _rotated("int4w_g64_rot_gptq", _gptq("int4w_g64_gptq", _int_g64(4))),
            "int4w_g64_gptq on a Hadamard-rotated decoder (residual stream, value heads, "
            "down_proj input online); int8 output head",
        ),
        "int3w_g64_rot_gptq": (
            lambda: _rotated(
                "int3w_g64_rot_gptq", _gptq("int3w_g64_gptq", _int_g64(3), full_range=True)
            ),
            "int3w_g64_gptq on a Hadamard-rotated decoder; int8 output head",
        ),
        "w4a8_g32_rot_gptq": (
            lambda: _rotated("w4a8_g32_rot_gptq", _gptq("w4a8_g32_gptq", _w4a8_g32())),
            "w4a8_g32_gptq on a Hadamard-rotated decoder; int8 output head",
        ),
        "w4a4_g32_gptq": (
            lambda: _w4a4_gptq("w4a4_g32_gptq"),
            "w4a4: int4 g32 weights rounded by GPTQ, int4 activations (a scale per 32 "
            "features, clipped to 0.9), int4 KV cache; int8 embeddings (needs calibration data)",
        ),
        "w4a4_g32_rot_gptq": (
            lambda: _rotated("w4a4_g32_rot_gptq", _w4a4_gptq("w4a4_g32_gptq")),
            "w4a4_g32_gptq on a Hadamard-rotated decoder; int8 output head",
        ),
    }
)


def preset_names() -> dict[str, str]:
    """Preset names with a one-line description each."""
    return {name: description for name, (_, description) in _PRESETS.items()}


def preset(name: str, *, stacked_axes: int = 0, **options) -> Recipe:
    """A named recipe.

    Args:
      name: one of `preset_names()`.
      stacked_axes: leading layer axes of the model's stacked (scanned) weights; every rule
        then keeps one set of scales per layer (see `Rule.stacked_axes`).
      **options: options of the callable forms, e.g. ``preset("int4_weight_only",
        group_size=32)``.
    Returns:
      The `Recipe`.
    Raises:
      ValueError: for an unknown name (listing the accepted ones) or options the preset does
        not take.

    Example:
      >>> preset("int4_weight_only", group_size=32).rules[1].weight.granularity
      PerGroup(size=32, axis=-2)
    """
    if name not in _PRESETS:
        raise ValueError(f"preset {name!r} is unknown; accepted: {', '.join(_PRESETS)}")
    builder = _PRESETS[name][0]
    if not options:
        recipe = builder()
    else:
        try:
            recipe = builder(**options)
        except TypeError as err:
            raise ValueError(
                f"preset {name!r} does not take options {sorted(options)}: {err}"
            ) from None
        except ValueError as err:
            shown = ", ".join(f"{k}={v!r}" for k, v in sorted(options.items()))
            raise ValueError(f"preset {name!r} with {shown}: {err}") from None
    if stacked_axes:
        rules = tuple(dataclasses.replace(r, stacked_axes=stacked_axes) for r in recipe.rules)
        recipe = Recipe(rules=rules, name=f"{recipe.name}(stacked_axes={stacked_axes})")
    return recipe
