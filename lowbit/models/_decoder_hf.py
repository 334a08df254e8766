"""Read a Hugging Face decoder checkpoint (``config.json`` + safetensors) into `Decoder`.

`decoder_config_from_hf` (`_hf_config`) turns a ``config.json`` into a `DecoderConfig`;
`hf_param_map` says where each tensor goes;
`load_decoder_hf` reads one tensor at a time from ``model.safetensors`` or the shards
an index lists. Hugging Face stores the rotate-half query/key layout `Decoder` uses, so no
rows are permuted; Gemma's norms store ``w`` of the ``1 + w`` they multiply by, so 1 is added.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from tokenizers import Tokenizer

from lowbit._untrusted import load_json, read_text, require_regular

from ._decoder import Decoder
from ._decoder_config import DecoderConfig
from ._hf_config import _GEMMA, _text_config, decoder_config_from_hf
from ._weights import CheckpointError, ParamMapping, assign_params

_FLOAT_DTYPES = ("F32", "F16", "BF16")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# Per-layer tensor suffix (under ``model.layers.{i}.``) -> module path under layers/{i};
# every one is a ``weight`` or ``bias`` and linear weights are [out, in].
_ATTN = {
    "self_attn.q_proj": ("attn", "q_proj"),
    "self_attn.k_proj": ("attn", "k_proj"),
    "self_attn.v_proj": ("attn", "v_proj"),
}
_MLP = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
# Mixtral's per-expert names: w1 is the gate, w3 the up and w2 the down projection.
_MIXTRAL_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def hf_param_map(
    config: DecoderConfig, *, fused_experts: bool = False
) -> dict[str, ParamMapping | tuple[ParamMapping, ...]]:
    """Hugging Face tensor name -> where and how it goes in `Decoder`.

    ``model.embed_tokens.weight`` -> ``embed/embedding``; ``model.norm.weight`` ->
    ``norm/scale``; ``lm_head.weight`` -> ``lm_head/kernel`` (untied models only);
    ``model.layers.{i}.`` ``input_layernorm`` -> ``attn_norm``, ``self_attn.{q,k,v,o}_proj``
    (or Phi-3's ``qkv_proj``) -> ``attn/...``, ``self_attn.{q,k}_norm`` -> ``attn/{q,k}_norm``,
    the pre-MLP norm (``post_attention_layernorm``, Gemma 2/3's ``pre_feedforward_layernorm``)
    -> ``mlp_norm``, Gemma 2/3's ``post_attention_layernorm`` / ``post_feedforward_layernorm``
    -> ``post_attn_norm`` / ``post_mlp_norm``, ``mlp.{gate,up,down}_proj`` (Phi-3's
    ``gate_up_proj``) -> ``mlp/...``. Linear weights (``[out, in]``) are transposed into
    kernels; Gemma's norm weights get 1 added.

    Experts: the router (Mixtral's ``block_sparse_moe.gate``, else ``mlp.gate``) ->
    ``moe/router``; each expert's tensor (``block_sparse_moe.experts.{e}.w1/w3/w2`` or
    ``mlp.experts.{e}.gate_proj/up_proj/down_proj``) fills slice ``e`` of the stacked
    ``moe/{gate,up,down}_proj/kernel`` (`ParamMapping.expert`). With `fused_experts`
    (transformers 5's own layout, ``save_original_format=False``): ``mlp.experts.gate_up_proj``
    ``[E, 2F, dim]`` maps to two parameters, gate then up (a tuple of `ParamMapping`\\ s with
    `ParamMapping.part`), and ``mlp.experts.down_proj`` ``[E, dim, F]`` to one. Qwen2-MoE's
    ``mlp.shared_expert.*`` -> ``moe/shared/...`` and ``mlp.shared_expert_gate`` ->
    ``moe/shared_gate``.
    """
    c = config
    gemma = c.architecture in _GEMMA
    norm_offset = 1.0 if gemma else 0.0

    def linear(path: tuple, **kw: Any) -> ParamMapping:
        return ParamMapping((*path, "kernel"), transpose=True, **kw)

    def norm(path: tuple) -> ParamMapping:
        return ParamMapping((*path, "scale"), offset=norm_offset)

    mapping: dict[str, ParamMapping | tuple[ParamMapping, ...]] = {
        "model.embed_tokens.weight": ParamMapping(("embed", "embedding")),
        "model.norm.weight": norm(("norm",)),
    }
    if not c.tie_embeddings:
        mapping["lm_head.weight"] = linear(("lm_head",))
    for i in range(c.n_layers):
        pre, at = f"model.layers.{i}.", ("layers", i)
        mapping[pre + "input_layernorm.weight"] = norm((*at, "attn_norm"))
        mapping[pre + "self_attn.o_proj.weight"] = linear((*at, "attn", "o_proj"))
        if c.fused_qkv:
            mapping[pre + "self_attn.qkv_proj.weight"] = linear((*at, "attn", "qkv_proj"))
        for hf, sub in ({} if c.fused_qkv else _ATTN).items():
            mapping[f"{pre}{hf}.weight"] = linear((*at, *sub))
            if c.qkv_bias:
                mapping[f"{pre}{hf}.bias"] = ParamMapping((*at, *sub, "bias"))
        if c.qk_norm:
            for qk in ("q_norm", "k_norm"):
                mapping[f"{pre}self_attn.{qk}.weight"] = norm((*at, "attn", qk))
        if c.post_norms:
            mapping[pre + "post_attention_layernorm.weight"] = norm((*at, "post_attn_norm"))
            mapping[pre + "pre_feedforward_layernorm.weight"] = norm((*at, "mlp_norm"))
            mapping[pre + "post_feedforward_layernorm.weight"] = norm((*at, "post_mlp_norm"))
        else:
            mapping[pre + "post_attention_layernorm.weight"] = norm((*at, "mlp_norm"))
        if c.n_experts:
            mapping.update(_expert_map(c, i, fused_experts))
        elif c.fused_gate_up:
            mapping[pre + "mlp.gate_up_proj.weight"] = linear((*at, "mlp", "gate_up_proj"))
            mapping[pre + "mlp.down_proj.weight"] = linear((*at, "mlp", "down_proj"))
        else:
            for hf, ours in _MLP.items():
                mapping[f"{pre}mlp.{hf}.weight"] = linear((*at, "mlp", ours))
    return mapping


def _expert_map(
    c: DecoderConfig, i: int, fused: bool
) -> dict[str, ParamMapping | tuple[ParamMapping, ...]]:
    """Layer `i`'s router, experts and shared expert (`hf_param_map`)."""
    moe = ("layers", i, "moe")
    kernel = lambda name: (*moe, name, "kernel")  # noqa: E731
    mixtral_names = c.architecture == "mixtral" and not fused
    block = f"model.layers.{i}." + ("block_sparse_moe" if mixtral_names else "mlp")
    out: dict[str, ParamMapping | tuple[ParamMapping, ...]] = {
        f"{block}.gate.weight": ParamMapping((*moe, "router"), transpose=True)
    }
    if fused:
        out[f"{block}.experts.gate_up_proj"] = tuple(
            ParamMapping(kernel(name), transpose=True, part=(k, 2))
            for k, name in enumerate(("gate_proj", "up_proj"))
        )
        out[f"{block}.experts.down_proj"] = ParamMapping(kernel("down_proj"), transpose=True)
    else:
        names = _MIXTRAL_EXPERTS if mixtral_names else _MLP
        for e in range(c.n_experts):
            for hf, ours in names.items():
                out[f"{block}.experts.{e}.{hf}.weight"] = ParamMapping(
                    kernel(ours), transpose=True, expert=e
                )
    if c.shared_ffn_dim:
        for hf, ours in _MLP.items():
            out[f"{block}.shared_expert.{hf}.weight"] = ParamMapping(
                (*moe, "shared", ours, "kernel"), transpose=True
            )
        out[f"{block}.shared_expert_gate.weight"] = ParamMapping(
            (*moe, "shared_gate"), transpose=True
        )
    return out


# Gemma 3's multimodal checkpoints: the language model's tensors under another prefix
# (transformers 5, then 4), and the vision tower's, which a text decoder does not read.
_GEMMA3_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
_GEMMA3_VISION = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def _our_name(name: str, model_type: str) -> str | None:
    """A checkpoint tensor's name as `hf_param_map` spells it; None for one to skip."""
    if name.endswith(".rotary_emb.inv_freq"):
        return None  # a buffer older exports saved; recomputed from the config
    if model_type == "gemma3":
        if name.startswith(_GEMMA3_VISION):
            return None
        for old, new in _GEMMA3_PREFIXES.items():
            if name.startswith(old):
                return new + name[len(old) :]
    return name


class _Checkpoint(Mapping[str, np.ndarray]):
    """The tensors of ``model.safetensors`` or of the shards an index lists, by the names
    `hf_param_map` uses, read one at a time as float32. `listing` is the file that lists
    them (the index, or ``model.safetensors`` itself), for messages."""

    def __init__(self, directory: Path, model_type: str, stack: contextlib.ExitStack):
        index = directory / INDEX_FILE
        single = directory / SINGLE_FILE
        where_from_index = index.is_file()
        if where_from_index:
            where = _read_index(index)
        elif single.is_file():
            where = None
        else:
            raise FileNotFoundError(
                f"{directory}: no {SINGLE_FILE} and no {INDEX_FILE}; a Hugging Face checkpoint "
                "needs one of them"
            )
        files = sorted(set(where.values())) if where is not None else [SINGLE_FILE]
        handles = {}
        for name in files:
            shard = directory / name
            if not shard.exists():
                raise FileNotFoundError(f"{index}: shard {name!r} does not exist in {directory}")
            require_regular(shard)  # safe_open opens it by path: a FIFO would block it
            try:
                handles[name] = stack.enter_context(safe_open(str(shard), framework="numpy"))
            except Exception as err:  # the safetensors error types are not public
                raise ValueError(
                    f"{shard}: not a readable safetensors file (truncated or corrupt?): {err}"
                ) from None
        if where is None:
            where = {t: SINGLE_FILE for t in handles[SINGLE_FILE].keys()}
        else:
            for tensor, name in where.items():
                if tensor not in handles[name].keys():
                    raise ValueError(
                        f"{index}: tensor {tensor!r} is listed in shard {name!r}, which does "
                        "not hold it"
                    )
        self._directory = directory
        self.listing = index if where_from_index else single
        self._handles = handles
        self._where: dict[str, tuple[str, str]] = {}
        for tensor, name in where.items():
            ours = _our_name(tensor, model_type)
            if ours is not None:
                self._where[ours] = (name, tensor)

    def __getitem__(self, name: str) -> np.ndarray:
        shard, tensor = self._where[name]
        handle = self._handles[shard]
        dtype = handle.get_slice(tensor).get_dtype()
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"{self._directory / shard}: tensor {tensor!r} is {dtype}; only "
                f"{', '.join(_FLOAT_DTYPES)} checkpoints load"
            )
        try:
            array = handle.get_tensor(tensor)
        except Exception as err:
            raise ValueError(f"{self._directory / shard}: tensor {tensor!r}: {err}") from None
        return np.asarray(array, np.float32)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def file_of(self, name: str) -> Path:
        return self._directory / self._where[name][0]


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = load_json(read_text(index), str(index)).get("weight_map")
    except (OSError, ValueError, AttributeError) as err:
        raise ValueError(f"{index}: not a safetensors index ({err})") from None
    ok = isinstance(weight_map, dict) and all(
        isinstance(k, str) and isinstance(v, str) and "/" not in v and "\\" not in v
        for k, v in weight_map.items()
    )
    if not ok or not weight_map:
        raise ValueError(
            f"{index}: field 'weight_map' must map tensor names to shard file names in the "
            "same directory"
        )
    return weight_map


# The fewest bytes a layer's tensors take in safetensors files: each tensor has a header entry
# (``"n":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}``, over 40 bytes) and its data.
_MIN_LAYER_BYTES = 48


def _check_declared_layers(config_json: Mapping[str, Any], directory: Path) -> None:
    """Refuses a ``num_hidden_layers`` the weight files are too small to hold, before the
    per-layer lists and maps are built from it (their cost follows the declaration, so a
    small directory declaring 10**9 layers would take gigabytes)."""
    try:
        declared = _text_config(config_json, str(directory / "config.json")).get(
            "num_hidden_layers"
        )
    except ValueError:
        return  # `decoder_config_from_hf` names the problem
    if not isinstance(declared, int) or isinstance(declared, bool) or declared <= 0:
        return
    index = directory / INDEX_FILE
    if not index.is_file() and not (directory / SINGLE_FILE).is_file():
        raise FileNotFoundError(
            f"{directory}: no {SINGLE_FILE} and no {INDEX_FILE}; a Hugging Face checkpoint "
            "needs one of them"
        )
    files = sorted(set(_read_index(index).values())) if index.is_file() else [SINGLE_FILE]
    size = sum(os.path.getsize(directory / n) for n in files if (directory / n).is_file())
    if declared * _MIN_LAYER_BYTES > size:
        raise ValueError(
            f"{directory / 'config.json'}: field 'num_hidden_layers' is {declared}, but the "
            f"weight files hold {size} bytes, room for at most {size // _MIN_LAYER_BYTES} "
            "layers; the config does not belong to these weights (or they are truncated)"
        )


def read_hf_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """``config.json`` of a Hugging Face checkpoint directory, as a dict."""
    path = Path(directory) / "config.json"
    try:
        config = load_json(read_text(path), str(path))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a JSON object ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return config


def load_decoder_hf(
    directory: str | os.PathLike[str], dtype: Any = jnp.float32, *, tokenizer: bool = True
) -> tuple[Decoder, Tokenizer | None]:
    """Load a Hugging Face decoder checkpoint directory as a float `Decoder` in `dtype`.

    Reads ``config.json``, ``model.safetensors`` or the shards ``model.safetensors.index.json``
    lists (float32 / float16 / bfloat16 tensors, one at a time), and ``tokenizer.json``
    (skipped, and None returned in its place, with ``tokenizer=False``). ``config.json``'s
    ``torch_dtype`` / ``dtype`` is informational: each tensor's own dtype is read.

    Raises:
      FileNotFoundError: naming the file: no ``config.json``, no weights, a shard the index
        lists, or ``tokenizer.json`` (when `tokenizer`).
      ValueError: naming the file and the field or tensor: `decoder_config_from_hf`'s errors,
        a truncated or corrupt shard, a tensor the index lists that its shard lacks, a tensor
        the model does not use, a missing tensor, or a shape that disagrees with the config.
    """
    directory = Path(directory)
    config_json = read_hf_config(directory)
    _check_declared_layers(config_json, directory)
    config = decoder_config_from_hf(config_json, directory / "config.json")
    tokenizer_path = directory / "tokenizer.json"
    if tokenizer and not tokenizer_path.is_file():
        raise FileNotFoundError(
            f"{tokenizer_path} does not exist; pass tokenizer=False to load the model alone"
        )
    with contextlib.ExitStack() as stack:
        checkpoint = _Checkpoint(directory, config_json["model_type"], stack)
        fused = "model.layers.0.mlp.experts.gate_up_proj" in checkpoint
        mapping = hf_param_map(config, fused_experts=fused)
        unknown = [n for n in checkpoint if n not in mapping]
        if unknown:
            raise ValueError(
                f"{checkpoint.file_of(unknown[0])}: tensor {unknown[0]!r} is not used by a "
                f"{config.architecture} model of this config.json"
            )
        model = Decoder.abstract(config, dtype=dtype, param_dtype=dtype)
        try:
            assign_params(model, checkpoint, mapping, dtype)
        except CheckpointError as err:
            found = err.tensor is not None and err.tensor in checkpoint
            raise ValueError(
                f"{checkpoint.file_of(err.tensor) if found else checkpoint.listing}: {err}"
            ) from None
    return model, Tokenizer.from_file(str(tokenizer_path)) if tokenizer else None
