"""`convert_checkpoint`: a GGUF or Hugging Face model file to a lowbit checkpoint, streaming.

One tensor at a time: read (memory-mapped GGUF blocks, or one safetensors tensor), placed
(transposed, RoPE rows un-interleaved), quantized by the recipe's rule for its path, written
to the checkpoint (`CheckpointWriter`) and dropped. So a model larger than memory converts
with about one tensor (and its quantization's scratch) resident, and the checkpoint is the one
``save_checkpoint(quantize_params(import_...(source), recipe))`` writes, bit for bit.

Only rules that decide by path and shape can stream one tensor at a time: a rule that filters
on the ops a weight feeds needs the model traced, and an algorithm (GPTQ, AWQ, SmoothQuant,
HQQ) runs over the loaded model. Given the decoder's config and calibration tokens
(``model=``, ``calibration=``), a decoder streams one *layer* at a time instead
(`lowbit.io._convert_layers`), and such rules run there; otherwise they are refused before
anything is written.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from lowbit._host_memory import release_free_memory
from lowbit.api import (
    AlgorithmOptions,
    as_recipe,
    check_decisions,
    fixed_bounds,
    quantize_weight,
)
from lowbit.io._checkpoint_writer import CheckpointWriter
from lowbit.io._convert_layers import convert_layers
from lowbit.io._placement import NameMap, nest
from lowbit.io._source import SourceParams
from lowbit.io._tree import path_name
from lowbit.models import DecoderConfig
from lowbit.qarray import QArray
from lowbit.recipes import Recipe


@dataclasses.dataclass(frozen=True)
class ConvertReport:
    """What `convert_checkpoint` wrote.

    Attributes:
      path: the checkpoint directory.
      tensors: leaves written.
      quantized: leaves the recipe quantized.
      kept: GGUF tensors kept quantized as stored.
      source_bytes: the source files' size.
      nbytes: the checkpoint's size.
      param_bytes: bytes the leaves hold (QArrays at their packed size, `QArray.nbytes`).
      float32_bytes: bytes the same parameters take as float32 (4 per logical element of a
        QArray or float array; other arrays at their size).
    """

    path: str
    tensors: int
    quantized: int
    kept: int
    source_bytes: int
    nbytes: int
    param_bytes: int
    float32_bytes: int


def _sizes(leaf: Any) -> tuple[int, int]:
    """(stored bytes, float32 bytes) of one leaf, as `ConvertReport` counts them."""
    elements = int(np.prod(leaf.shape))
    if isinstance(leaf, QArray):
        return leaf.nbytes, 4 * elements
    stored = elements * np.dtype(leaf.dtype).itemsize
    return stored, 4 * elements if jnp.issubdtype(leaf.dtype, jnp.floating) else stored


def streaming_problem(
    recipe: Recipe, paths: list[str] | None = None, *, by_layer: bool = False
) -> str | None:
    """Why `recipe` cannot quantize one tensor at a time (with `by_layer`: a decoder one layer
    at a time, on calibration data), or None if it can.

    Args:
      recipe: the recipe.
      paths: the parameter paths it will see; a rule that is the first match of none of them
        does not count. None: every rule counts.
      by_layer: whether the conversion runs layer by layer (`convert_checkpoint` with
        ``model=`` and ``calibration=``), where op filters and algorithms can run.
    """
    if getattr(recipe, "rotate", None) is not None:
        return (
            f"recipe {recipe.name!r} rotates the model (rotate={recipe.rotate.to_text()!r}), "
            "which mixes whole layers; it cannot be applied one tensor at a time: load the model"
        )
    used = None if paths is None else {recipe.match_index(p) for p in paths}
    for i, rule in enumerate(recipe.rules):
        if rule.weight is None or (used is not None and i not in used):
            continue
        why = None
        if rule.ops is not None and not by_layer:
            why = f"filters on the ops a weight feeds (ops={list(rule.ops)}), found by tracing"
        elif rule.algorithm is not None and not by_layer:
            why = (
                f"rounds with {rule.algorithm.name}, which runs on calibration data (give the "
                "decoder's config and calibration tokens to convert it layer by layer)"
            )
        elif rule.static_activation and fixed_bounds(rule.activation) is None:
            why = "needs static activation bounds measured on data (lowbit.calibrate)"
        if why:
            return (
                f"recipe {recipe.name!r} rule {i} (path={rule.path!r}) {why}; it cannot be "
                "applied one tensor at a time: load the model and use quantize_params, or use "
                "a recipe whose rules select by path only"
            )
    return None


def convert_checkpoint(
    source: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    recipe: Recipe | str | None,
    *,
    name_map: NameMap | Mapping[str, Any],
    quantized: bool = True,
    dtype: Any = None,
    metadata: Mapping[str, Any] | None = None,
    on_tensor: Callable[[int, int, str], None] | None = None,
    model: DecoderConfig | None = None,
    calibration: Sequence[Any] | None = None,
    algorithm_options: AlgorithmOptions | None = None,
) -> ConvertReport:
    """Converts a GGUF or safetensors model to a lowbit checkpoint, one tensor at a time (one
    layer at a time with ``model=`` and ``calibration=``).

    Args:
      source: a ``.gguf`` file, a ``.safetensors`` file, a shard index
        (``model.safetensors.index.json``), or a directory holding either.
      dest: the checkpoint directory (`save_checkpoint`'s rules: missing, empty or a lowbit
        checkpoint, replaced atomically).
      recipe: a `Recipe` or preset name, quantizing the float tensors its rules select; None
        keeps every tensor as stored. Rules must decide by path and shape
        (`streaming_problem`).
      name_map: file tensor name -> where it goes (`lowbit.io.Placement`, a path, or None to
        skip), or a mapping such as ``gguf_param_map(config)`` (names it lacks are skipped).
      quantized: GGUF only: keep its quantized tensors as QArrays (as `import_gguf`); False
        dequantizes them to float32 first, so the recipe quantizes them.
      dtype: safetensors only: cast floating tensors to this dtype first.
      metadata: JSON user metadata stored in the checkpoint.
      on_tensor: progress callback ``(done, total, path)`` after each tensor is written.
      model: the decoder's `DecoderConfig`: with `calibration`, the model runs one layer at a
        time (`lowbit.io._convert_layers`), so rules with algorithms (GPTQ, AWQ, SmoothQuant)
        and op filters apply; every tensor is then read as float (GGUF blocks decoded).
      calibration: token batches ``[batch, seq]`` for `model`'s layer-by-layer pass.
      algorithm_options: `lowbit.api.AlgorithmOptions` for that pass.
    Returns:
      A `ConvertReport`.
    Raises:
      ValueError: naming the rule, for a recipe that cannot stream; as `quantize_params` for
        parameters a rule cannot quantize (all named at once, before anything is written);
        for a malformed source or a `dest` that is not a checkpoint. On any error the
        destination is left as it was.
    """
    lookup = name_map.get if isinstance(name_map, Mapping) else name_map
    recipe = None if recipe is None else as_recipe(recipe)
    by_layer = model is not None or calibration is not None
    if by_layer and (model is None or calibration is None or recipe is None):
        raise ValueError(
            "convert_checkpoint: a layer-by-layer conversion needs the decoder's config "
            "(model=), calibration token batches (calibration=) and a recipe; got "
            f"model={'set' if model is not None else None}, calibration="
            f"{'set' if calibration is not None else None}, recipe={recipe}"
        )
    quantized = quantized and not by_layer
    with SourceParams(source, lookup, quantized=quantized, dtype=dtype) as params:
        floats = {path: params.abstract(path) for path in params if not params.is_kept(path)}
        decisions = {}
        if recipe is not None:
            names = [path_name(p) for p in floats]
            problem = streaming_problem(recipe, names, by_layer=by_layer)
            if problem:
                raise ValueError(problem)
            decisions = check_decisions(recipe, nest(floats.items()), None)
            if decisions and all(d.rule_index is None for d in decisions.values()):
                warnings.warn(
                    f"recipe {recipe.name!r} quantizes none of the {len(decisions)} float "
                    f"tensors of {os.fspath(source)!r} (e.g. {next(iter(decisions))!r}); check "
                    "its rules' paths against the name map's",
                    UserWarning,
                    stacklevel=2,
                )
        del floats
        counts = {"quantized": 0, "kept": 0, "param_bytes": 0, "float32_bytes": 0}
        written = []
        with CheckpointWriter(dest, recipe=recipe, metadata=metadata) as writer:

            def write(path: Any, leaf: Any) -> None:
                if isinstance(leaf, QArray) and not params.is_kept(path):
                    counts["quantized"] += 1
                elif params.is_kept(path):
                    counts["kept"] += 1
                writer.add(path, leaf)
                stored, as_float32 = _sizes(leaf)
                counts["param_bytes"] += stored
                counts["float32_bytes"] += as_float32
                written.append(path)
                if on_tensor is not None:
                    on_tensor(len(written), len(params), path_name(path))

            if by_layer:
                convert_layers(
                    params.__getitem__,
                    list(params),
                    write,
                    recipe,
                    model,
                    calibration,
                    options=algorithm_options,
                )
            else:
                for path in params:
                    leaf = params[path]
                    decision = decisions.get(path_name(path))
                    if decision is not None and decision.quantized:
                        rule = recipe.rules[decision.rule_index]
                        leaf = quantize_weight(leaf, decision.config, rule)
                    write(path, leaf)
                    del leaf
                    # What the last tensor's quantization freed goes back to the system
                    # before the next one is read.
                    release_free_memory()
        source_bytes = params.nbytes()
        tensors = len(params)
    dest = os.path.realpath(os.fspath(dest))
    nbytes = sum(os.path.getsize(os.path.join(dest, f)) for f in os.listdir(dest))
    return ConvertReport(
        path=dest,
        tensors=tensors,
        source_bytes=source_bytes,
        nbytes=nbytes,
        **counts,
    )
