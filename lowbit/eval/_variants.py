"""Reference models by name or file, and their quantized variants by recipe.

Model specs: ``"smollm2"`` (SmolLM2-135M-Instruct from its Q4_1 GGUF, dequantized to float32:
the float baseline), ``"minilm"`` (all-MiniLM-L6-v2), a path to a Llama ``.gguf`` file, or a
path to a BERT ``.safetensors`` file with its ``config.json`` and ``tokenizer.json`` beside it.

Recipe specs: a preset name (`lowbit.recipes.preset_names`), a path to a recipe ``.json`` file
(`Recipe.from_json`), or ``"gguf"``: the GGUF file's own quantized blocks imported directly
(GGUF models only).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

GGUF_RECIPE = "gguf"
FLOAT_RECIPE = "float"
MODEL_NAMES = ("smollm2", "minilm")
KINDS = ("lm", "encoder")


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedModel:
    """A float reference model.

    Attributes:
      name: short name for tables (``"smollm2"``, ``"minilm"``, or the file stem).
      spec: how to load it again (a model name or an absolute file path).
      kind: ``"lm"`` (causal LM: perplexity) or ``"encoder"`` (sentence embeddings: cosine).
      model: the float NNX module.
      tokenizer: its `tokenizers.Tokenizer`.
      gguf_path: the GGUF file it was read from, or None.
    """

    name: str
    spec: str
    kind: str
    model: nnx.Module
    tokenizer: Any
    gguf_path: Path | None = None


def _models():
    import lowbit.models as models  # the heavy model code loads only when a model is needed

    return models


@functools.lru_cache(maxsize=4)
def load_model(spec: str) -> LoadedModel:
    """Loads a reference model by name or path (see the module docstring).

    Loaded models are cached per spec (they are never modified), so repeated commands in one
    process read the weights once.

    Raises:
      ValueError: for an unknown name or file type; FileNotFoundError for a missing file or
        an uninstalled model package.
    """
    models = _models()
    if spec == "smollm2":
        model, tokenizer = models.load_smollm2()
        path = models.smollm2_gguf_path()
        return LoadedModel(
            name="smollm2", spec=spec, kind="lm", model=model, tokenizer=tokenizer, gguf_path=path
        )
    if spec == "minilm":
        model, tokenizer = models.load_minilm()
        return LoadedModel(
            name="minilm", spec=spec, kind="encoder", model=model, tokenizer=tokenizer
        )
    path = Path(spec)
    if path.suffix not in (".gguf", ".safetensors"):
        raise ValueError(
            f"MODEL {spec!r} is not a known model; accepted: {', '.join(MODEL_NAMES)}, or a path "
            "to a .gguf or .safetensors file"
        )
    if not path.is_file():
        raise FileNotFoundError(f"model file {spec!r} does not exist")
    path = path.resolve()
    if path.suffix == ".gguf":
        model, tokenizer = models.load_llama_gguf(path)
        return LoadedModel(
            name=path.stem,
            spec=str(path),
            kind="lm",
            model=model,
            tokenizer=tokenizer,
            gguf_path=path,
        )
    missing = [n for n in ("config.json", "tokenizer.json") if not (path.parent / n).is_file()]
    if path.name != "model.safetensors" or missing:
        raise ValueError(
            f"MODEL {spec!r}: a BERT checkpoint must be named model.safetensors with config.json "
            f"and tokenizer.json beside it" + (f"; missing {missing}" if missing else "")
        )
    model, tokenizer = models.load_hf_bert(path.parent)
    return LoadedModel(
        name=path.stem, spec=str(path), kind="encoder", model=model, tokenizer=tokenizer
    )


def load_recipe(spec: str) -> Any:
    """A `Recipe` from a preset name or a recipe JSON file.

    Raises:
      ValueError: for an unknown name (listing the presets) or a malformed file.
    """
    from lowbit.recipes import Recipe, preset, preset_names

    if spec.endswith(".json") or os.sep in spec:
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"recipe file {spec!r} does not exist")
        try:
            return Recipe.from_json(path.read_text(encoding="utf-8"))
        except ValueError as err:
            raise ValueError(f"recipe file {spec!r}: {err}") from None
    if spec not in preset_names():
        names = ", ".join([*preset_names(), GGUF_RECIPE])
        raise ValueError(
            f"recipe {spec!r} is neither a preset nor a .json file; accepted presets: {names}"
        )
    return preset(spec)


def check_recipe_spec(spec: str) -> None:
    """Raises the error `load_recipe` would, without a model: call before slow loading.

    Raises:
      ValueError / FileNotFoundError: for an unknown preset or a bad recipe file.
    """
    if spec != GGUF_RECIPE:
        load_recipe(spec)


def recipe_label(spec: str) -> str:
    """The name a recipe spec shows in tables: the preset name, or the JSON file's stem."""
    return Path(spec).stem if spec.endswith(".json") else spec


def quantize_variant(
    loaded: LoadedModel,
    float_params: Any,
    recipe_spec: str,
    *,
    calibration_file: str | None = None,
    calibration_sequences: int | None = None,
    on_batch: Callable[[int, int], None] | None = None,
    on_weight: Callable[[int, int], None] | None = None,
    on_report: Callable[[Any], None] | None = None,
) -> tuple[Any, Any]:
    """The parameters of `loaded` under a recipe.

    Recipes whose rules run a data-driven algorithm (GPTQ, ...) are calibrated on the default
    calibration set (`lowbit.eval.calibration_text`, disjoint from the evaluation text) or on
    `calibration_file`; the statistics are cached per model and calibration set, so recipes of
    one model share one calibration pass.

    Args:
      loaded: the float model.
      float_params: its float parameters (``nnx.split(model)[1]``).
      recipe_spec: a preset name, a recipe JSON path, ``"float"`` or ``"gguf"``.
      calibration_file: a text file to calibrate on instead of the default speeches.
      calibration_sequences: number of calibration sequences (default 128 of 512 tokens; for
        an encoder, sentences: default 4096).
      on_batch / on_weight: progress callbacks ``(done, total)``.
      on_report: called with the `lowbit.algorithms.AlgorithmReport` of a recipe with
        algorithms (what every such weight got).
    Returns:
      ``(params, recipe)``: a pure-dict parameter tree with QArrays where the recipe quantizes,
      and the `Recipe` (None for ``"gguf"``).
    Raises:
      ValueError: for ``"gguf"`` on a model not read from a GGUF file, or a bad recipe.
    """
    pure = nnx.to_pure_dict(float_params)
    if recipe_spec == GGUF_RECIPE:
        if loaded.gguf_path is None:
            raise ValueError(
                f"recipe 'gguf' imports a GGUF file's own quantization; model {loaded.name!r} "
                "was not read from a GGUF file"
            )
        from lowbit.io import import_gguf

        mapping = _models().gguf_llama_param_map(loaded.model.config)
        params, _ = import_gguf(
            loaded.gguf_path, name_map=mapping.get, kernel_axes=serving_axes(loaded)
        )
        return params, None
    from lowbit.api import quantize_params

    recipe = load_recipe(recipe_spec)
    if recipe_spec == FLOAT_RECIPE:
        return pure, recipe
    if not any(r.algorithm is not None for r in recipe.rules):
        return _served(loaded, quantize_params(pure, recipe)), recipe
    from lowbit.algorithms import AlgorithmReport, capture, sample_rows
    from lowbit.api import AlgorithmOptions, algorithm_weights
    from lowbit.eval import _calibration_set as calib
    from lowbit.eval._corpus import read_text

    data_paths = tuple(
        sorted(
            p
            for p, (_, rule) in algorithm_weights(recipe, pure).items()
            if rule.algorithm.needs_data
        )
    )
    statistics = None
    if data_paths:
        text = None if calibration_file is None else read_text(calibration_file)
        if loaded.kind == "lm":
            n = calib.SEQUENCES if calibration_sequences is None else calibration_sequences
            batches = calib.lm_batches(loaded.tokenizer, text, sequences=n)
        else:
            n = calib.ENCODER_SENTENCES if calibration_sequences is None else calibration_sequences
            batches = calib.encoder_batches(loaded.tokenizer, text, sequences=n)
        fn = calib.model_fn(loaded.model, loaded.kind)
        progress = None if on_batch is None else (lambda done: on_batch(done, len(batches)))
        key = (calibration_file, n, data_paths, sample_rows(recipe))
        statistics = calib.cached_statistics(
            loaded.model,
            key,
            lambda: capture(
                fn,
                pure,
                batches,
                paths=data_paths,
                sample_rows=sample_rows(recipe),
                row_mask=calib.row_mask(loaded.kind),
                on_batch=progress,
            ),
        )
    report = AlgorithmReport()
    params = quantize_params(
        pure,
        recipe,
        algorithm_options=AlgorithmOptions(statistics=statistics, on_weight=on_weight),
        report=report,
    )
    if on_report is not None:
        on_report(report)
    return _served(loaded, params), recipe


def _served(loaded: LoadedModel, params: Any) -> Any:
    """`params` with the weights the CPU kernels run laid out for them (replacing the codes)."""
    from lowbit.ops import prepare_weights

    return prepare_weights(params, serving_axes(loaded)(params))


def serving_axes(loaded: LoadedModel) -> Any:
    """``params -> {key path: contraction axis}`` of the model's forward, traced abstractly:
    what `load_checkpoint` / `import_gguf` / `prepare_weights` need to lay the quantized
    weights out for the CPU kernels once (in place of their codes)."""
    import jax
    import jax.numpy as jnp

    from lowbit.api import kernel_axes_of

    graphdef = nnx.graphdef(loaded.model)
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    if loaded.kind == "lm":
        return lambda p: kernel_axes_of(lambda s, t: nnx.merge(graphdef, s)(t), p, tokens)
    return lambda p: kernel_axes_of(lambda s, t, m: nnx.merge(graphdef, s)(t, m), p, tokens, tokens)


def as_numpy_tokens(tokenizer: Any, text: str) -> np.ndarray:
    """[n] int32 token ids of `text` (no special tokens added)."""
    return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, np.int32)
