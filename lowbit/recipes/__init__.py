"""Recipes: rules that say which parameters to quantize and how, and named presets."""

from lowbit.recipes._algorithm import ALGORITHMS, AWQ, GPTQ, HQQ, Algorithm, SmoothQuant
from lowbit.recipes._builders import (
    activation_config,
    contraction_axis,
    matmul_rules,
    weight_config,
)
from lowbit.recipes._candidates import (
    DEFAULT_CANDIDATES,
    GGUF_CANDIDATES,
    TARGETS,
    Candidate,
    default_candidates,
    parse_candidate,
    parse_candidates,
    plan_recipe,
    storable,
)
from lowbit.recipes._json import (
    format_calibration,
    format_granularity,
    parse_calibration_field,
    parse_config,
    parse_granularity,
)
from lowbit.recipes._kv_cache import FLOAT_KV_FORMATS, KV_FORMATS, KVCacheConfig, parse_kv_cache
from lowbit.recipes._maxtext import preset_from_maxtext_json
from lowbit.recipes._paths import map_params, param_leaves, path_string
from lowbit.recipes._presets import (
    float8_dynamic_activation_float8_weight,
    float8_weight_only,
    int4_weight_only,
    int8_dynamic_activation_int4_weight,
    int8_dynamic_activation_int8_weight,
    int8_weight_only,
    mxfp4,
    nf4,
    nvfp4,
    preset,
    preset_names,
)
from lowbit.recipes._recipe import Decision, Recipe, RecipeReport
from lowbit.recipes._rotation import RotationConfig, parse_rotation
from lowbit.recipes._rule import Rule, stack_granularity
from lowbit.recipes._select import (
    OPS,
    Select,
    check_regex,
    first_matches,
    no_match_error,
    select_params,
)

__all__ = [
    "Candidate",
    "DEFAULT_CANDIDATES",
    "GGUF_CANDIDATES",
    "TARGETS",
    "default_candidates",
    "parse_candidate",
    "parse_candidates",
    "plan_recipe",
    "storable",
    "ALGORITHMS",
    "AWQ",
    "GPTQ",
    "HQQ",
    "Algorithm",
    "Select",
    "SmoothQuant",
    "FLOAT_KV_FORMATS",
    "KV_FORMATS",
    "OPS",
    "KVCacheConfig",
    "RotationConfig",
    "Decision",
    "Recipe",
    "RecipeReport",
    "Rule",
    "activation_config",
    "contraction_axis",
    "float8_dynamic_activation_float8_weight",
    "float8_weight_only",
    "format_calibration",
    "format_granularity",
    "int4_weight_only",
    "int8_dynamic_activation_int4_weight",
    "int8_dynamic_activation_int8_weight",
    "int8_weight_only",
    "map_params",
    "matmul_rules",
    "mxfp4",
    "nf4",
    "nvfp4",
    "param_leaves",
    "parse_kv_cache",
    "parse_rotation",
    "parse_calibration_field",
    "parse_config",
    "parse_granularity",
    "path_string",
    "preset",
    "preset_from_maxtext_json",
    "preset_names",
    "select_params",
    "stack_granularity",
    "weight_config",
    "check_regex",
    "first_matches",
    "no_match_error",
]
