"""A recipe applied to a loaded model: quantized (and calibrated) parameters, ready to run."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from flax import nnx

from lowbit.algorithms import AlgorithmReport, sample_rows
from lowbit.api import AlgorithmOptions, algorithm_weights, quantize_params
from lowbit.io import import_gguf
from lowbit.models import gguf_param_map
from lowbit.ops import with_int8_activations
from lowbit.serving._load import LoadedModel
from lowbit.serving._ready import kernel_axes_fn, ready
from lowbit.serving._recipe_spec import FLOAT_RECIPE, GGUF_RECIPE, load_recipe
from lowbit.serving._rotation import (
    online_paths,
    rotate_online_inputs,
    rotate_statistics,
    wrap_online,
)

# ``calibrate(loaded, params, paths, sample_rows) -> statistics``: runs the model on
# calibration data and captures what the data-driven algorithms of the weights at `paths`
# need (`lowbit.algorithms.capture`); `params` is the float pure-dict tree.
Calibrate = Callable[[LoadedModel, Any, tuple[str, ...], Any], Any]


def apply_recipe(
    loaded: LoadedModel,
    float_params: Any,
    recipe_spec: str,
    *,
    calibrate: Calibrate | None = None,
    on_weight: Callable[[int, int], None] | None = None,
    on_report: Callable[[Any], None] | None = None,
    program_dir: str | None = None,
) -> tuple[Any, Any]:
    """`lowbit.serving.apply_recipe`: the parameters of `loaded` under a recipe, ready to run.

    Args:
      loaded: the float model.
      float_params: its float parameters (``nnx.split(model)[1]``).
      recipe_spec: a preset name, a recipe JSON path, ``"float"`` or ``"gguf"``.
      calibrate: what runs calibration data through the model, for recipes whose rules run a
        data-driven algorithm (GPTQ, ...): `Calibrate`. `lowbit.eval.calibrator` gives the
        default calibration set's.
      on_weight: progress callback ``(done, total)`` over the algorithms' weights.
      on_report: called with the `lowbit.algorithms.AlgorithmReport` of a recipe with
        algorithms (what every such weight got).
      program_dir: where compiled programs are kept (`lowbit.api.program_directory()`): the
        contraction axes the weights are laid out by are kept there too (`kernel_axes`), so
        a second start of the same model does not trace it.
    Returns:
      ``(params, recipe)``: a pure-dict parameter tree with the weights the recipe quantizes
      laid out for the CPU kernels (`ready`), and the `Recipe` (None for ``"gguf"``).
    Raises:
      ValueError: for ``"gguf"`` on a model not read from a GGUF file, a bad recipe, or a
        recipe that needs calibration data given no `calibrate`.
    """
    if loaded.abstract and recipe_spec != GGUF_RECIPE:
        raise ValueError(
            f"model {loaded.name!r} was loaded without float weights (load_model(..., "
            f"float_weights=False)); recipe {recipe_spec!r} quantizes float weights: load it "
            "with float_weights=True, or use recipe 'gguf'"
        )
    if recipe_spec == GGUF_RECIPE:
        if loaded.gguf_path is None:
            raise ValueError(
                f"recipe 'gguf' imports a GGUF file's own quantization; model {loaded.name!r} "
                "was not read from a GGUF file"
            )

        mapping = gguf_param_map(loaded.model.config)
        # Laid out as each tensor is read, so the tree is resident once.
        params, _ = import_gguf(
            loaded.gguf_file or loaded.gguf_path,
            name_map=mapping.get,
            kernel_axes=kernel_axes_fn(loaded, program_dir),
            int8_activations=True,
        )
        # Every quantized tensor multiplies as llama.cpp multiplies it: activations in its Q8_0 /
        # Q8_K blocks, integer dots. That holds for the Q8_0 / Q4_0 / Q4_1 tensors imported as
        # int8 / int4 / uint4 in groups of 32 too (the kernels quantize the activations per
        # weight group: Q8_0 blocks); on float activations they ran 1.3-1.7x slower
        # (`with_int8_activations(params, False)` for float activations everywhere).
        return with_int8_activations(params), None

    pure = nnx.to_pure_dict(float_params)
    recipe = load_recipe(recipe_spec)
    if recipe_spec == FLOAT_RECIPE:
        return pure, recipe
    if recipe.rotate is not None and loaded.rotation != recipe.rotate:
        raise ValueError(
            f"serving.apply_recipe: recipe {recipe_spec!r} rotates the model "
            f"(rotate={recipe.rotate.to_text()!r}), which changes its structure; pass the "
            "rotated model: loaded = lowbit.serving.rotated_model(loaded, recipe) and its "
            "float params"
        )
    online = online_paths(pure, recipe.rotate)
    float_pure, pure = pure, rotate_online_inputs(pure, online)
    # The rotation is done (the model, and the online inputs here); what is left is the rules.
    rules_only = dataclasses.replace(recipe, rotate=None)
    if not any(r.algorithm is not None for r in recipe.rules):
        quantized = quantize_params(pure, rules_only)
        return wrap_online(ready(loaded, quantized, program_dir), online), recipe

    data_paths = tuple(
        sorted(
            p
            for p, (_, rule) in algorithm_weights(rules_only, pure).items()
            if rule.algorithm.needs_data
        )
    )
    statistics = None
    if data_paths:
        if calibrate is None:
            raise ValueError(
                f"serving.apply_recipe: recipe {recipe_spec!r} runs data-driven algorithms on "
                f"{len(data_paths)} weights (e.g. {data_paths[0]}) and needs calibration data; "
                "pass calibrate= (lowbit.eval.calibrator() gives the default calibration set)"
            )
        # Statistics of the float model as it runs (x, not x H), turned into those of the
        # online-rotated inputs.
        statistics = calibrate(loaded, float_pure, data_paths, sample_rows(rules_only))
        statistics = rotate_statistics(statistics, online)
    report = AlgorithmReport()
    params = quantize_params(
        pure,
        rules_only,
        algorithm_options=AlgorithmOptions(statistics=statistics, on_weight=on_weight),
        report=report,
    )
    if on_report is not None:
        on_report(report)
    return wrap_online(ready(loaded, params, program_dir), online), recipe
