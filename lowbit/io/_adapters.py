"""LoRA adapters on disk: a checkpoint directory of their own, checked against the base at load.

The adapters are written with `save_checkpoint` (safetensors + manifest, sha256 per tensor,
atomic swap); the manifest's metadata holds the `LoraConfig` JSON and a fingerprint of the
base weights they were trained on (each adapted path's shape and format), so loading them onto
another model, another rank or a base quantized another way is refused with the reason.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from lowbit.api import (
    LoraConfig,
    LoraRule,
    as_lora_config,
    check_adapters,
    lora_apply,
    lora_plan,
)
from lowbit.io._checkpoint import load_checkpoint, read_manifest, save_checkpoint
from lowbit.io._manifest import CheckpointError
from lowbit.qarray import QArray
from lowbit.recipes import param_leaves

LORA_KEY = "lora"
ADAPTERS_DIR = "adapters"


def _describe(leaf: Any) -> dict[str, Any]:
    if isinstance(leaf, QArray):
        # The scale's shape tells granularities apart (nf4 in groups of 64 vs 128).
        return {"shape": list(leaf.shape), "format": leaf.format, "scale": list(leaf.scale.shape)}
    return {"shape": list(leaf.shape), "format": f"float:{np.dtype(leaf.dtype).name}"}


def base_fingerprint(params: Any, config: LoraConfig) -> dict[str, Any]:
    """{path: {"shape", "format"}} of the weights `config` adapts in `params`."""
    plans, full = lora_plan(params, config)
    leaves = dict(param_leaves(params))
    return {path: _describe(leaves[path]) for path in sorted([*plans, *full])}


def save_adapters(
    path: str | os.PathLike[str],
    adapters: Mapping[str, Mapping[str, Any]],
    config: LoraConfig | LoraRule,
    *,
    base: Any,
    metadata: Mapping[str, Any] | None = None,
) -> None:
    """`lowbit.save_adapters`: writes adapters as a checkpoint directory, atomically.

    Args:
      path: the directory (replaced as a whole if it is a checkpoint already).
      adapters: from `lowbit.lora_init` (trained).
      config: their `LoraConfig`.
      base: the base params they were trained on (only shapes and formats are recorded).
      metadata: extra JSON-serialisable metadata (e.g. model name and recipe).
    Raises:
      ValueError: if the adapters do not fit `base` and `config`, or as `save_checkpoint`.
    """
    config = as_lora_config(config)
    check_adapters(base, adapters, config)
    meta = dict(metadata or {})
    meta[LORA_KEY] = {"config": config.to_json(), "base": base_fingerprint(base, config)}
    tree = {p: {k: np.asarray(v) for k, v in entry.items()} for p, entry in adapters.items()}
    save_checkpoint(path, tree, metadata=meta)


def read_adapter_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The metadata of an adapter directory (with its ``"lora"`` entry).

    Raises:
      CheckpointError: if `path` is not an adapter checkpoint.
    """
    meta = read_manifest(path).get("metadata") or {}
    if not isinstance(meta, dict) or LORA_KEY not in meta:
        raise CheckpointError(f"{os.fspath(path)!r} is a checkpoint but holds no LoRA adapters")
    return meta


def load_adapters(
    path: str | os.PathLike[str], *, base: Any
) -> tuple[dict[str, dict[str, Any]], LoraConfig]:
    """`lowbit.load_adapters`: reads adapters and checks them against the base params.

    Args:
      path: a directory written by `save_adapters`.
      base: the base params to attach them to (float or quantized).
    Returns:
      (adapters, config), ready for `lowbit.lora_apply(base, adapters, config)`.
    Raises:
      CheckpointError: for a damaged checkpoint, or adapters made for another model, rank or
        base format (naming the path, what was stored and what `base` has).
    """
    meta = read_adapter_metadata(path)
    try:
        config = LoraConfig.from_json(meta[LORA_KEY]["config"])
        stored = meta[LORA_KEY]["base"]
        current = base_fingerprint(base, config)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(
            f"adapters at {os.fspath(path)!r} do not fit this model: {err}"
        ) from None
    for name in sorted(set(stored) | set(current)):
        if stored.get(name) != current.get(name):
            raise CheckpointError(
                f"adapters at {os.fspath(path)!r} were trained on base weight {name!r} = "
                f"{stored.get(name)}, but this model has {current.get(name)}: another model or "
                "recipe; load them onto the base they were trained on"
            )
    adapters = load_checkpoint(path)
    try:
        check_adapters(base, adapters, config, where=f"adapters at {os.fspath(path)!r}")
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    return adapters, config


def has_adapters(path: str | os.PathLike[str]) -> bool:
    """Whether checkpoint directory `path` has adapters in its ``adapters/`` subdirectory."""
    return os.path.isfile(os.path.join(os.fspath(path), ADAPTERS_DIR, "manifest.json"))


def load_adapted_checkpoint(path: str | os.PathLike[str], **load_options: Any) -> Any:
    """`lowbit.load_adapted_checkpoint`: a checkpoint with its adapters attached, if it has any.

    For directories written by `lowbit finetune` (the quantized base, adapters in
    ``path/adapters``); a checkpoint without adapters loads as `load_checkpoint` gives it.

    Args:
      path: the checkpoint directory.
      **load_options: passed to `load_checkpoint` for the base.
    Returns:
      The params, with a `lowbit.ops.LoraWeight` at each adapted path; run them with
      `lowbit.run` as any quantized params.
    Raises:
      CheckpointError: as `load_checkpoint` and `load_adapters`.
    """
    params = load_checkpoint(path, **load_options)
    if not has_adapters(path):
        return params
    adapters, config = load_adapters(os.path.join(os.fspath(path), ADAPTERS_DIR), base=params)
    return lora_apply(params, adapters, config)
