"""A recipe's rotation (`lowbit.recipes.RotationConfig`) applied to a loaded decoder.

Offline (`rotated_model`): the float model itself is rotated (`lowbit.models.rotate_model`),
which may change its structure (a tied head becomes an explicit ``lm_head``), so the rotated
`LoadedModel` is what calibration, quantization and evaluation then run.

Online (``RotationConfig.online``): the dense down_proj weights are quantized as ``Hᵀ W``
from statistics of ``x H`` (``Hᵀ G H`` for a Gram matrix ``G`` of ``x``: the float model is
not run again), and served as `lowbit.ops.HadamardInput`, whose matmul rotates its input. A
checkpoint stores ``Hᵀ W`` as it is (`storable`); reading it back wraps it again
(`wrap_online`), from the recipe the checkpoint names.
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.models import Decoder, rotate_model
from lowbit.ops import HadamardInput, hadamard_matrix, rotate_weight_input
from lowbit.qarray import EngineValue
from lowbit.recipes import param_leaves
from lowbit.serving._load import LoadedModel
from lowbit.serving._recipe_spec import FLOAT_RECIPE, GGUF_RECIPE, load_recipe

_ROTATED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# Dense MLP down projections (a shared expert's too): the weights an online rotation serves.
_ONLINE = {"down_proj": re.compile(r"layers/\d+/(mlp|moe/shared)/down_proj/kernel")}


def rotated_model(loaded: LoadedModel, recipe: Any) -> LoadedModel:
    """`loaded` with `recipe`'s offline rotation applied (a new `LoadedModel`), or `loaded`
    itself when the recipe rotates nothing or `loaded` is already rotated so.

    Raises:
      ValueError: for a rotation of a model that is not a decoder, or of one rotated
        otherwise; `lowbit.models.RotationError` for a strict rotation the fold refuses.
    """
    rotation = getattr(recipe, "rotate", None)
    if rotation is None or loaded.rotation == rotation:
        return loaded

    if loaded.rotation is not None:
        raise ValueError(
            f"model {loaded.name!r} is already rotated ({loaded.rotation.to_text()}); load it "
            f"again to rotate it as recipe {recipe.name!r} says ({rotation.to_text()})"
        )
    if not isinstance(loaded.model, Decoder):
        raise ValueError(
            f"recipe {recipe.name!r} has rotate={rotation.to_text()!r}, which rotates decoder "
            f"language models; {loaded.name!r} is a {type(loaded.model).__name__}. Drop "
            "'rotate' from the recipe"
        )
    # One rotated model per (model, rotation) in a process: recipes sharing a rotation share
    # its calibration statistics (cached per model object).
    per_model = _ROTATED.setdefault(loaded, {})
    if rotation not in per_model:
        model, report = rotate_model(loaded.model, rotation)
        per_model[rotation] = dataclasses.replace(
            loaded, model=model, rotation=rotation, rotation_report=report
        )
    return per_model[rotation]


def rotated_for_spec(loaded: LoadedModel, recipe_spec: str) -> LoadedModel:
    """`rotated_model` for a recipe spec (a preset name or JSON path; ``"float"`` and
    ``"gguf"`` rotate nothing)."""
    if recipe_spec in (FLOAT_RECIPE, GGUF_RECIPE):
        return loaded
    return rotated_model(loaded, load_recipe(recipe_spec))


def online_paths(params: Any, rotation: Any) -> tuple[str, ...]:
    """Paths of the weights `rotation` rotates online (``/``-joined, sorted)."""
    if rotation is None or not rotation.online:
        return ()

    patterns = [_ONLINE[target] for target in rotation.online]
    paths = [p for p, _ in param_leaves(params) if any(r.fullmatch(p) for r in patterns)]
    return tuple(sorted(paths))


def _map_paths(params: Any, paths: tuple[str, ...], fn: Any) -> Any:
    wanted = set(paths)

    def visit(path: tuple, leaf: Any) -> Any:
        name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        return fn(leaf) if name in wanted else leaf

    return jax.tree_util.tree_map_with_path(visit, params, is_leaf=_is_value)


def _is_value(x: Any) -> bool:

    return isinstance(x, EngineValue)


def rotate_online_inputs(params: Any, paths: tuple[str, ...]) -> Any:
    """Float `params` with the weights at `paths` replaced by ``Hᵀ W`` (rotated along their
    input axis 0), ready to be quantized."""
    return _map_paths(params, paths, lambda w: rotate_weight_input(jnp.asarray(w), 0))


def rotate_statistics(statistics: Any, paths: tuple[str, ...]) -> Any:
    """Calibration statistics of ``x`` turned into those of ``x H`` for the weights at
    `paths`: the Gram matrix ``Hᵀ G H`` and the sampled rows exactly; per-channel magnitudes
    estimated from the Gram's diagonal (root mean square); no foldable activation scale (a
    per-channel scale of ``x`` is no longer one of ``x H``)."""
    if statistics is None or not paths:
        return statistics

    wanted = set(paths)
    weights = dict(statistics.weights)
    for key, stats in statistics.weights.items():
        if key[0] not in wanted or stats.input_axes != (0,):
            continue
        h = jnp.asarray(hadamard_matrix(stats.gram.shape[0]))
        gram = h.T @ stats.gram @ h
        rms = jnp.sqrt(jnp.maximum(jnp.diagonal(gram), 0.0) / max(stats.count, 1))
        sample = None if stats.sample is None else np.asarray(stats.sample) @ np.asarray(h)
        weights[key] = dataclasses.replace(
            stats,
            gram=gram,
            abs_sum=rms * stats.count,
            abs_max=rms,
            sample=sample,
            activation_scale=None,
        )
    return dataclasses.replace(statistics, weights=weights)


def wrap_online(params: Any, paths: tuple[str, ...]) -> Any:
    """`params` with the weights at `paths` (holding ``Hᵀ W``) served as
    `lowbit.ops.HadamardInput`."""
    return _map_paths(params, paths, lambda w: HadamardInput(w, axis=0))


def storable(params: Any) -> Any:
    """`params` with every `lowbit.ops.HadamardInput` replaced by the ``Hᵀ W`` it holds (what
    a checkpoint stores; the recipe's rotation says which to wrap again)."""

    def unwrap(x: Any) -> Any:
        return x.inner if isinstance(x, HadamardInput) else x

    return jax.tree.map(unwrap, params, is_leaf=lambda x: isinstance(x, HadamardInput))
