"""Serving: a model from a name, a GGUF file, a lowbit checkpoint or a Hugging Face directory,
with a recipe applied, ready to run (its quantized weights laid out for the CPU kernels by
`lowbit.prepare`).

The commands that run models (`lowbit generate`, `export`, `bench`, `eval`) and `lowbit.eval`
load through this layer; it sits below evaluation and never imports it. Calibration data for
data-driven recipes is an argument (`apply_recipe`'s ``calibrate``).
"""

from lowbit.serving._apply import Calibrate, apply_recipe
from lowbit.serving._checkpoint import (
    MANIFEST,
    META_KIND,
    META_MODEL,
    META_RECIPE,
    checkpoint_metadata,
    checkpoint_recipe,
    checkpoint_recipe_label,
    is_checkpoint,
    read_checkpoint,
)
from lowbit.serving._load import (
    HF_FILES,
    KINDS,
    MODEL_NAMES,
    LoadedModel,
    as_numpy_tokens,
    is_hf_directory,
    load_model,
    model_fn,
)
from lowbit.serving._ready import fallback_report, kernel_axes_fn, ready
from lowbit.serving._recipe_spec import (
    FLOAT_RECIPE,
    GGUF_RECIPE,
    check_recipe_spec,
    load_recipe,
    recipe_label,
)
from lowbit.serving._rotation import rotated_for_spec, rotated_model, storable, wrap_online

__all__ = [
    "FLOAT_RECIPE",
    "GGUF_RECIPE",
    "HF_FILES",
    "KINDS",
    "MANIFEST",
    "META_KIND",
    "META_MODEL",
    "META_RECIPE",
    "MODEL_NAMES",
    "Calibrate",
    "LoadedModel",
    "apply_recipe",
    "as_numpy_tokens",
    "check_recipe_spec",
    "checkpoint_metadata",
    "checkpoint_recipe",
    "checkpoint_recipe_label",
    "is_checkpoint",
    "is_hf_directory",
    "fallback_report",
    "kernel_axes_fn",
    "load_model",
    "rotated_for_spec",
    "rotated_model",
    "storable",
    "wrap_online",
    "load_recipe",
    "model_fn",
    "read_checkpoint",
    "ready",
    "recipe_label",
]
