"""Load all-MiniLM-L6-v2 (Hugging Face BERT safetensors) and embed sentences with it."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from lowbit._untrusted import load_json, read_text, require_regular

from ._assets import minilm_dir
from ._bert import Bert, BertConfig, mean_pool
from ._tokenizer import wordpiece_tokenizer
from ._weights import ParamMapping, assign_params

# Checkpoint entries the encoder does not use: a position-index buffer and the [CLS] pooler,
# which sentence-transformers' mean pooling ignores.
_UNUSED_PREFIXES = ("embeddings.position_ids", "pooler.")

# Hugging Face per-layer suffix (under encoder.layer.{i}.) -> module path under layers/{i}.
_LAYER_PARAMS = {
    "attention.self.query": ("attn", "query"),
    "attention.self.key": ("attn", "key"),
    "attention.self.value": ("attn", "value"),
    "attention.output.dense": ("attn", "out"),
    "attention.output.LayerNorm": ("attn_norm",),
    "intermediate.dense": ("mlp", "up"),
    "output.dense": ("mlp", "down"),
    "output.LayerNorm": ("mlp_norm",),
}

# Padded lengths are rounded up to this so batches of similar length share one compilation.
_LENGTH_BUCKET = 16


def bert_config_from_hf(hf_config: Mapping[str, Any]) -> BertConfig:
    """A `BertConfig` from a Hugging Face ``config.json`` dict."""
    if hf_config.get("model_type", "bert") != "bert":
        raise ValueError(f"config model_type is {hf_config.get('model_type')!r}; expected 'bert'")
    pos = hf_config.get("position_embedding_type", "absolute")
    if pos != "absolute":
        raise ValueError(f"config position_embedding_type is {pos!r}; expected 'absolute'")
    return BertConfig(
        vocab_size=int(hf_config["vocab_size"]),
        dim=int(hf_config["hidden_size"]),
        n_layers=int(hf_config["num_hidden_layers"]),
        n_heads=int(hf_config["num_attention_heads"]),
        activation=str(hf_config.get("hidden_act", "gelu")),
        ffn_dim=int(hf_config["intermediate_size"]),
        max_positions=int(hf_config["max_position_embeddings"]),
        type_vocab_size=int(hf_config.get("type_vocab_size", 2)),
        norm_eps=float(hf_config.get("layer_norm_eps", 1e-12)),
    )


def hf_bert_param_map(config: BertConfig) -> dict[str, ParamMapping]:
    """Hugging Face BERT tensor name -> where and how it goes in `Bert`.

    ``embeddings.{word,position,token_type}_embeddings.weight`` ->
    ``embeddings/{word,position,token_type}/embedding``; ``embeddings.LayerNorm.{weight,bias}``
    -> ``embeddings/norm/{scale,bias}``; ``encoder.layer.{i}.``: ``attention.self.{query,key,
    value}`` -> ``layers/{i}/attn/{query,key,value}``, ``attention.output.dense`` ->
    ``attn/out``, ``attention.output.LayerNorm`` -> ``attn_norm``, ``intermediate.dense`` ->
    ``mlp/up``, ``output.dense`` -> ``mlp/down``, ``output.LayerNorm`` -> ``mlp_norm``. Dense
    ``weight`` (``[out, in]``) is transposed into ``kernel``; LayerNorm ``weight`` is ``scale``.
    """
    mapping = {
        f"embeddings.{hf}_embeddings.weight": ParamMapping(("embeddings", ours, "embedding"))
        for hf, ours in (("word", "word"), ("position", "position"), ("token_type", "token_type"))
    }
    mapping["embeddings.LayerNorm.weight"] = ParamMapping(("embeddings", "norm", "scale"))
    mapping["embeddings.LayerNorm.bias"] = ParamMapping(("embeddings", "norm", "bias"))
    for i in range(config.n_layers):
        for hf, sub in _LAYER_PARAMS.items():
            prefix, path = f"encoder.layer.{i}.{hf}", ("layers", i, *sub)
            if hf.endswith("LayerNorm"):
                mapping[f"{prefix}.weight"] = ParamMapping((*path, "scale"))
            else:
                mapping[f"{prefix}.weight"] = ParamMapping((*path, "kernel"), transpose=True)
            mapping[f"{prefix}.bias"] = ParamMapping((*path, "bias"))
    return mapping


def load_hf_bert(
    model_dir: str | os.PathLike[str], dtype: Any = jnp.float32
) -> tuple[Bert, Tokenizer]:
    """Load ``config.json``, ``model.safetensors`` and ``tokenizer.json`` from `model_dir`."""
    model_dir = os.fspath(model_dir)
    config_file = os.path.join(model_dir, "config.json")
    config = bert_config_from_hf(load_json(read_text(config_file), config_file))
    weights = os.path.join(model_dir, "model.safetensors")
    require_regular(weights)  # load_file opens it by path: a FIFO would block it
    try:
        arrays = load_file(weights)
    except Exception as err:  # the safetensors error types are not public
        raise ValueError(
            f"{weights}: not a readable safetensors file (truncated or corrupt?): {err}"
        ) from None
    # Some exports prefix every name with the architecture ("bert.").
    arrays = {k.removeprefix("bert."): v for k, v in arrays.items()}
    mapping = hf_bert_param_map(config)
    unknown = [n for n in arrays if n not in mapping and not n.startswith(_UNUSED_PREFIXES)]
    if unknown:
        raise ValueError(f"checkpoint in {model_dir!r} has unexpected tensor {unknown[0]!r}")
    model = Bert.abstract(config, dtype=dtype, param_dtype=dtype)
    assign_params(model, arrays, mapping, dtype)
    return model, wordpiece_tokenizer(os.path.join(model_dir, "tokenizer.json"))


def load_minilm(dtype: Any = jnp.float32) -> tuple[Bert, Tokenizer]:
    """all-MiniLM-L6-v2 from the bundled safetensors: ``(model, tokenizer)``."""
    return load_hf_bert(minilm_dir(), dtype=dtype)


@functools.partial(jax.jit, static_argnums=0)
def _embed(graphdef: nnx.GraphDef, state: nnx.State, tokens, mask) -> jax.Array:
    hidden = nnx.merge(graphdef, state)(tokens, mask)
    return mean_pool(hidden, mask)


def embed_sentences(
    model: Bert, tokenizer: Tokenizer, sentences: Sequence[str], *, batch_size: int = 64
) -> np.ndarray:
    """Sentence embeddings ``[n, dim]`` float32: mean of the last hidden states over real
    tokens, L2-normalised (sentence-transformers' pipeline for all-MiniLM-L6-v2).

    Each batch is padded to its longest sentence (rounded up to a multiple of 16 so similar
    batches reuse one compilation); padding is masked out of attention and pooling.
    """
    if isinstance(sentences, str):
        raise TypeError("sentences is a str; pass a list of sentences")
    if batch_size < 1:
        raise ValueError(f"batch_size is {batch_size}; it must be at least 1")
    graphdef, state = nnx.split(model)
    out = []
    for start in range(0, len(sentences), batch_size):
        encs = tokenizer.encode_batch(list(sentences[start : start + batch_size]))
        longest = max(len(e.ids) for e in encs)
        width = -(-longest // _LENGTH_BUCKET) * _LENGTH_BUCKET
        tokens = np.zeros((len(encs), width), np.int32)
        mask = np.zeros((len(encs), width), np.int32)
        for row, e in enumerate(encs):
            tokens[row, : len(e.ids)] = e.ids
            mask[row, : len(e.ids)] = 1
        out.append(np.asarray(_embed(graphdef, state, jnp.asarray(tokens), jnp.asarray(mask))))
    if not out:
        return np.zeros((0, model.config.dim), np.float32)
    return np.concatenate(out).astype(np.float32)
