"""Float reference models by name, GGUF file or Hugging Face directory.

Model specs: ``"smollm2"`` (SmolLM2-135M-Instruct from its Q4_1 GGUF, dequantized to float32:
the float baseline), ``"minilm"`` (all-MiniLM-L6-v2), a path to a Llama ``.gguf`` file, or a
BERT checkpoint in the Hugging Face layout: a directory holding ``model.safetensors``,
``config.json`` and ``tokenizer.json``, or the path of its ``model.safetensors``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

MODEL_NAMES = ("smollm2", "minilm")
KINDS = ("lm", "encoder")
HF_FILES = ("model.safetensors", "config.json", "tokenizer.json")


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


def is_hf_directory(path: str | Path) -> bool:
    """Whether `path` is a directory holding a Hugging Face BERT checkpoint (`HF_FILES`)."""
    return Path(path).is_dir() and all(Path(path, name).is_file() for name in HF_FILES)


@functools.lru_cache(maxsize=4)
def load_model(spec: str) -> LoadedModel:
    """`lowbit.serving.load_model`: a float reference model by name or path (module docstring).

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
    if is_hf_directory(path):
        path = path / "model.safetensors"
    if path.suffix not in (".gguf", ".safetensors"):
        raise ValueError(
            f"MODEL {spec!r} is not a known model; accepted: {', '.join(MODEL_NAMES)}, or a path "
            "to a .gguf or .safetensors file"
        )
    if not path.is_file():
        raise FileNotFoundError(f"model file {spec!r} does not exist")
    path = path.resolve()
    if path.suffix == ".gguf":
        model, tokenizer = models.load_decoder_gguf(path)
        return LoadedModel(
            name=path.stem,
            spec=str(path),
            kind="lm",
            model=model,
            tokenizer=tokenizer,
            gguf_path=path,
        )
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
