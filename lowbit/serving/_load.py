"""Float reference models by name, GGUF file or Hugging Face directory.

Model specs: ``"smollm2"`` (SmolLM2-135M-Instruct from its Q4_1 GGUF, dequantized to float32:
the float baseline), ``"minilm"`` (all-MiniLM-L6-v2), a path to a decoder ``.gguf`` file, or a
checkpoint in the Hugging Face layout: a directory holding ``config.json``, ``tokenizer.json``
and ``model.safetensors`` (or shards listed in ``model.safetensors.index.json``), or the path of
its ``model.safetensors``. A ``config.json`` whose ``model_type`` is a decoder's
(`lowbit.models.HF_MODEL_TYPES`) loads as a language model, a BERT one as an encoder.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from lowbit import models
from lowbit.gguf import read_gguf

MODEL_NAMES = ("smollm2", "minilm")
KINDS = ("lm", "encoder")
HF_FILES = ("model.safetensors", "config.json", "tokenizer.json")
HF_INDEX = "model.safetensors.index.json"


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
      gguf_file: that file as read (`lowbit.gguf.GGUFFile`: its metadata, and its tensors as
        memory-mapped views), so the file's header is parsed once however many steps use it.
      rotation: the `lowbit.recipes.RotationConfig` its float weights were rotated by
        (`lowbit.serving.rotated_model`), or None.
      rotation_report: what that rotation did (`lowbit.models.RotationReport`), or None.
      abstract: the model's parameters are shapes only (`load_model(..., float_weights=False)`
        of a GGUF file): it runs with the file's own blocks (recipe ``"gguf"``) and nothing else.
    """

    name: str
    spec: str
    kind: str
    model: nnx.Module
    tokenizer: Any
    gguf_path: Path | None = None
    gguf_file: Any = None
    rotation: Any = None
    rotation_report: Any = None
    abstract: bool = False


def is_hf_directory(path: str | Path) -> bool:
    """Whether `path` is a directory holding a Hugging Face checkpoint: `HF_FILES`, or a
    sharded one (`HF_INDEX` in place of ``model.safetensors``)."""
    path = Path(path)
    weights = Path(path, HF_FILES[0]).is_file() or Path(path, HF_INDEX).is_file()
    return path.is_dir() and weights and all(Path(path, n).is_file() for n in HF_FILES[1:])


def _hf_decoder_type(directory: Path) -> bool:
    """Whether `directory`'s ``config.json`` names a decoder model type."""
    config = directory / "config.json"
    return (
        config.is_file()
        and models.read_hf_config(directory).get("model_type") in models.HF_MODEL_TYPES
    )


def _load_hf_decoder(directory: Path) -> LoadedModel:
    directory = directory.resolve()
    model, tokenizer = models.load_decoder_hf(directory)
    return LoadedModel(
        name=directory.name, spec=str(directory), kind="lm", model=model, tokenizer=tokenizer
    )


@functools.lru_cache(maxsize=4)
def load_model(spec: str, float_weights: bool = True) -> LoadedModel:
    """`lowbit.serving.load_model`: a float reference model by name or path (module docstring).

    Loaded models are cached per spec (they are never modified), so repeated commands in one
    process read the weights once.

    `float_weights=False` reads a ``.gguf`` file's shapes and tokenizer only (an `abstract`
    model): for serving the file's own blocks, which `apply_recipe(..., "gguf")` reads
    straight into their kernels' layout, without a float copy of the model. Other models
    ignore it.

    Raises:
      ValueError: for an unknown name or file type; FileNotFoundError for a missing file or
        an uninstalled model package.
    """
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
    if is_hf_directory(path):
        if _hf_decoder_type(path):
            return _load_hf_decoder(path)
        path = path / "model.safetensors"
    if path.suffix not in (".gguf", ".safetensors"):
        raise ValueError(
            f"MODEL {spec!r} is not a known model; accepted: {', '.join(MODEL_NAMES)}, a path "
            "to a .gguf or .safetensors file, or a Hugging Face checkpoint directory"
        )
    if not path.is_file():
        raise FileNotFoundError(f"model file {spec!r} does not exist")
    path = path.resolve()
    if path.suffix == ".gguf":
        gguf_file = read_gguf(path)
        model, tokenizer = models.load_decoder_gguf(gguf_file, weights=float_weights)
        return LoadedModel(
            name=path.stem,
            spec=str(path),
            kind="lm",
            model=model,
            tokenizer=tokenizer,
            gguf_path=path,
            gguf_file=gguf_file,
            abstract=not float_weights,
        )
    if path.name == "model.safetensors" and _hf_decoder_type(path.parent):
        return _load_hf_decoder(path.parent)
    missing = [n for n in HF_FILES[1:] if not (path.parent / n).is_file()]
    if path.name != "model.safetensors" or missing:
        raise ValueError(
            f"MODEL {spec!r}: a BERT checkpoint must be named model.safetensors with config.json "
            f"and tokenizer.json beside it" + (f"; missing {missing}" if missing else "")
        )
    model, tokenizer = models.load_hf_bert(path.parent)
    return LoadedModel(
        name=path.stem, spec=str(path), kind="encoder", model=model, tokenizer=tokenizer
    )


def model_fn(model: nnx.Module, kind: str) -> Callable[..., Any]:
    """``fn(params, *batch)`` calling the model (LM: tokens; encoder: tokens and mask)."""
    graphdef = nnx.graphdef(model)
    if kind == "lm":
        return lambda state, tokens: nnx.merge(graphdef, state)(tokens)
    return lambda state, tokens, mask: nnx.merge(graphdef, state)(tokens, mask)


def as_numpy_tokens(tokenizer: Any, text: str) -> np.ndarray:
    """[n] int32 token ids of `text` (no special tokens added)."""
    return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, np.int32)
