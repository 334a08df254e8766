"""Checkpoints written by `lowbit quantize` / `lowbit finetune`, read back ready to run.

Their manifest's metadata names the float model they were quantized from (`META_MODEL`, a
model spec for `load_model`) and the recipe (`META_RECIPE`); a `lowbit finetune` directory also
holds LoRA adapters.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lowbit.io import has_adapters, load_adapted_checkpoint, read_manifest
from lowbit.recipes import Recipe
from lowbit.serving._load import LoadedModel
from lowbit.serving._ready import ready
from lowbit.serving._rotation import online_paths, wrap_online

# Metadata keys stored in a checkpoint manifest to find the float model again.
META_MODEL = "model"
META_RECIPE = "recipe"
META_KIND = "kind"
MANIFEST = "manifest.json"


def is_checkpoint(target: str | os.PathLike[str]) -> bool:
    """Whether `target` is a checkpoint directory (it holds a manifest)."""
    return Path(target, MANIFEST).is_file()


def checkpoint_metadata(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's metadata, which names its float model.

    Raises:
      ValueError: for a checkpoint without `META_MODEL` (not written by `lowbit quantize`).
    """
    meta = read_manifest(directory).get("metadata") or {}
    if META_MODEL not in meta:
        raise ValueError(
            f"checkpoint {os.fspath(directory)!r} has no '{META_MODEL}' in its metadata; it was "
            "not written by `lowbit quantize`, so its float model is unknown"
        )
    return meta


def checkpoint_recipe_label(directory: str | os.PathLike[str]) -> str:
    """The recipe label of a checkpoint (``+lora`` when it holds adapters)."""
    label = str(checkpoint_metadata(directory).get(META_RECIPE, "custom"))
    return f"{label}+lora" if has_adapters(directory) else label


def checkpoint_recipe(directory: str | os.PathLike[str]) -> Any:
    """The `Recipe` a checkpoint was written with, or None when it stores none."""
    text = read_manifest(directory).get("recipe")
    return None if text is None else Recipe.from_json(text)


def read_checkpoint(
    directory: str | os.PathLike[str], loaded: LoadedModel, program_dir: str | None = None
) -> Any:
    """The checkpoint's parameters (with its LoRA adapters, if any) for `loaded`, laid out
    for the CPU kernels (`ready`, which keeps the axes it traces in `program_dir`); the
    weights its recipe rotates online served as `lowbit.ops.HadamardInput`.

    Raises:
      ValueError: for a checkpoint of a rotated model read for `loaded` not rotated so (load
        it through `rotated_model(loaded, checkpoint_recipe(directory))`).
    """
    recipe = checkpoint_recipe(directory)
    rotation = None if recipe is None else recipe.rotate
    if rotation is not None and loaded.rotation != rotation:
        raise ValueError(
            f"checkpoint {os.fspath(directory)!r} holds a rotated model "
            f"(rotate={rotation.to_text()!r}); read it for "
            "lowbit.serving.rotated_model(loaded, checkpoint_recipe(directory))"
        )
    params = load_adapted_checkpoint(directory)
    online = online_paths(params, rotation)
    return wrap_online(ready(loaded, params, program_dir), online)
