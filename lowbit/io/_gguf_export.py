"""GGUF export: a decoder params tree (float or quantized) to a file llama.cpp runs.

Each weight is written in GGUF's layout (``[out, in]``, blocks along ``in``; query/key rows
re-interleaved for llama.cpp's RoPE) and in one of three ways:

  * **direct** (no requantization): a QArray whose codes map onto a GGML type as they are:
      - a GGUF block format (``q4_k``, ``q6_k``, ...) with blocks along the input axis: its
        bytes;
      - ``int8`` symmetric, groups of 32 along the input axis -> Q8_0;
      - ``int4`` symmetric, groups of 32 -> Q4_0;
      - ``uint4`` (or ``int4`` with a zero point), groups of 32 -> Q4_1 (``d = s``,
        ``m = -s z``).
    Q8_0 / Q4_0 / Q4_1 store fp16 scales: a float32 scale that is not a float16 value is
    rounded (printed). A Q4_1 block whose codes are all zero is written with ``d = 0``, as
    llama.cpp writes constant blocks, so an imported file exports byte for byte.
  * **requantized** to the requested type (or the type's fallback, below) from the weight's
    values, with llama.cpp's reference quantizer (`lowbit.gguf.encode`), printed.
  * **float**: 1-D tensors (norms) as F32; other float weights as F32 unless a type is asked.

Requested types: a GGML type (``Q8_0``, ``Q4_1``, ``Q4_K``, ``Q6_K``, ``IQ4_NL``, ``F16``,
...) for every 2-D weight, or a llama.cpp mix (`MIXES`: ``Q3_K_S`` .. ``Q5_K_M``) with
llama.cpp's per-tensor choices (`mix_type`): e.g. Q6_K for the output / tied embedding, and
for ``attn_v`` and ``ffn_down`` in the first and last eighth of the layers and every third
layer between (``Q4_K_M``, ``Q5_K_M``). `LLAMA_MIXES` adds the mixes named like a GGML type
(``Q2_K``, ``Q6_K``, ``Q4_0``, ``Q8_0``, ...): as an export type such a name means that type
for every weight; `mix_type` and `planned_types` take it as llama.cpp's quantizer does. A row
length that is not a multiple of the block size (256 for K-quants) falls back per tensor as
llama.cpp does (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K / Q3_K -> Q4_0, TQ -> Q4_0
...), printed, or raises with ``strict=True``.

Metadata: every key of the source GGUF (architecture, tokenizer, chat template, ...) is copied
with its type, except the file type, which is set for the output; without a source file the
architecture keys are built from the `DecoderConfig` (no tokenizer then). The file is written by
`lowbit.gguf.write_gguf`: to a temporary name beside the target, parsed back to check every
tensor, and renamed into place; on any error nothing is left behind.

Streaming: every tensor's type and byte shape is planned from shapes and metadata first (the
header precedes the data), then each leaf is read, encoded and written in turn, so with a lazy
`params` (`checkpoint_leaves`, `SourceParams`) one tensor is resident at a time.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import gguf
import jax
import numpy as np

from lowbit.formats import GGUFBlockFormat
from lowbit.gguf import (
    BLOCK_TYPES,
    FLOAT_TYPES,
    GGUFFile,
    TensorSpec,
    block_type,
    read_gguf,
    write_gguf,
)
from lowbit.gguf import encode as gguf_encode
from lowbit.io._gguf_mixes import MIXES, check_mix, fitting_type, mix_type
from lowbit.models import (
    DecoderConfig,
    decoder_config_from_gguf,
    gguf_metadata,
    gguf_param_map,
    swap_last,
)
from lowbit.ops import PreparedQArray
from lowbit.qarray import QArray

_FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16}
EXPORT_TYPES = (*FLOAT_TYPES, *BLOCK_TYPES, *MIXES)
"""Accepted `type` values (besides None: keep quantized weights, floats as F32)."""

_FILE_TYPES = {
    "F32": "ALL_F32",
    "F16": "MOSTLY_F16",
    "Q4_K_M": "MOSTLY_Q4_K_M",
    "Q4_K_S": "MOSTLY_Q4_K_S",
    "Q5_K_M": "MOSTLY_Q5_K_M",
    "Q5_K_S": "MOSTLY_Q5_K_S",
    "Q3_K": "MOSTLY_Q3_K_M",
}
# Set for the output (the writer adds the architecture itself).
_SKIP_KEYS = (
    "general.architecture",
    "general.file_type",
    "general.quantization_version",
    "general.alignment",
)


@dataclasses.dataclass(frozen=True)
class TensorNote:
    """How one tensor was written.

    Attributes:
      name: GGUF tensor name.
      ggml_type: the type written.
      how: ``"direct"`` (codes kept), ``"requantized"`` (a QArray re-encoded), ``"quantized"``
        (a float weight encoded), ``"float"`` (written as F32 / F16).
      note: what changed on the way, or ``""``.
    """

    name: str
    ggml_type: str
    how: str
    note: str = ""


@dataclasses.dataclass(frozen=True)
class ExportReport:
    """What `export_gguf` wrote: the path, the bytes, one `TensorNote` per tensor."""

    path: str
    nbytes: int
    tensors: tuple[TensorNote, ...]


def check_type(type_: str | None) -> str | None:
    """The canonical spelling of an export type (upper case); ValueError listing the accepted."""
    if type_ is None:
        return None
    canonical = type_.upper()
    if canonical not in EXPORT_TYPES:
        raise ValueError(
            f"GGUF export type {type_!r} is not supported; accepted: {', '.join(EXPORT_TYPES)}"
        )
    return canonical


def _requested(name: str, type_: str | None, config: DecoderConfig) -> str | None:
    """The type `type_` asks for tensor `name` (None: keep / float)."""
    if name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")):
        return None  # expert routers stay float, as llama.cpp's quantizer keeps them
    if type_ is None or type_ not in MIXES:
        return type_
    return mix_type(name, type_, config)


def planned_types(params: Any, config: DecoderConfig, mix: str) -> dict[str, str]:
    """Param path -> the GGML type llama.cpp's quantizer writes it as in `mix`: `mix_type`,
    then the fallback for rows that are not whole blocks (``F16`` where none fits). 1-D params
    (norms) and tensors llama.cpp keeps float are left out.

    Args:
      params: the `Decoder` params (arrays or shape structs: only shapes are read).
      config: its `DecoderConfig`.
      mix: one of `LLAMA_MIXES` (any case).
    Raises:
      ValueError: for a mix llama.cpp does not have, or a missing parameter.
    """
    mix = check_mix(mix)
    types = {}
    for name, where in gguf_param_map(config).items():
        value = _leaf(params, where.path, abstract=True)
        if value is None:
            raise ValueError(
                f"params have no {'/'.join(map(str, where.path))} for GGUF tensor {name!r}"
            )
        value = gguf_oriented(name, where, _abstract(value))
        requested = mix_type(name, mix, config)
        if len(value.shape) < 2 or requested is None:
            continue
        path = "/".join(map(str, where.path))
        types[path] = fitting_type(requested, name, value.shape[-1], strict=False)[0]
    return types


def _nibbles_ggml(codes: np.ndarray) -> np.ndarray:
    """codes [..., n] < 16 -> GGML 4-bit bytes [..., n/32, 16] (j low, j + 16 high)."""
    blocks = codes.reshape(*codes.shape[:-1], -1, 32).astype(np.uint8)
    return blocks[..., :16] | (blocks[..., 16:] << 4)


def _fp16(values: np.ndarray) -> tuple[np.ndarray, bool]:
    """float32 -> float16 bytes [..., 2], and whether that was exact."""
    half = values.astype(np.float16)
    exact = bool(np.array_equal(half.astype(np.float32), values.astype(np.float32)))
    return half[..., None].view(np.uint8), exact


def _direct_type(q: QArray) -> str | None:
    """The GGML type a QArray [..., out, in] maps onto without requantizing, else None.

    Decided from its metadata and shapes alone, so an abstract QArray (shape structs for
    arrays) plans a streaming export before any data is read.
    """
    fmt = q.fmt
    if q.input_scale is not None:
        return None  # llama.cpp has no per-input-channel factor: requantize the weight it means
    if isinstance(fmt, GGUFBlockFormat):
        return fmt.ggml_type if q.packed_axis == q.ndim - 1 else None
    if (
        q.ndim < 2
        or q.tensor_scale is not None
        or q.activation is not None
        or q.scale_encoding != "float"
        or q.block_shape != (1,) * (q.ndim - 1) + (32,)
        or fmt.name not in ("int8", "int4", "uint4")
    ):
        return None
    if fmt.name in ("int8", "int4") and q.zero_point is None:
        return "Q8_0" if fmt.name == "int8" else "Q4_0"
    return "Q4_1"


def _direct(q: QArray) -> tuple[str, np.ndarray, str] | None:
    """(type, raw bytes [..., out, row_bytes], note) for a QArray [..., out, in] (stacked
    experts have a leading axis) that maps onto a GGML type without requantizing, else
    None."""
    written = _direct_type(q)
    if written is None:
        return None
    if isinstance(q.fmt, GGUFBlockFormat):
        return written, np.asarray(q.codes, np.uint8), ""
    fmt = q.fmt
    codes = np.asarray(q.unpacked_codes())
    scale = np.asarray(q.scale, np.float32)
    zero = None if q.zero_point is None else np.asarray(q.zero_point, np.float32)
    d16, exact = _fp16(scale)
    note = "" if exact else "float32 scales rounded to float16"
    lead = q.shape[:-1]
    if fmt.name == "int8" and zero is None:
        qs = codes.view(np.int8).reshape(*lead, -1, 32).view(np.uint8)
        return "Q8_0", np.concatenate([d16, qs], -1).reshape(*lead, -1), note
    if fmt.name == "int4" and zero is None:
        values = codes.astype(np.int8)  # two's complement nibbles as uint8 bit patterns
        q4 = (values ^ 8) & 15  # v + 8
        return "Q4_0", np.concatenate([d16, _nibbles_ggml(q4)], -1).reshape(*lead, -1), note
    # Q4_1: x = d q + m with d = s and m = -s z (int4 with a zero point: q = v + 8, z + 8).
    q4 = codes.astype(np.uint8) & 15
    if fmt.name == "int4":
        q4 = (q4 ^ 8) & 15
        zero = zero + 8.0
    if zero is None:
        zero = np.zeros_like(scale)
    blocks_q = q4.reshape(*lead, -1, 32)
    flat = ~blocks_q.any(-1)
    m = -(scale * zero)
    d = np.where(flat, np.float32(0), scale)
    d16, _ = _fp16(d)
    m16, _ = _fp16(m)
    # m = -s z carries the float32 rounding of the zero point (about 2**-24 |m|), which the
    # float16 rounding removes; only a larger change is worth a note.
    moved = np.abs(m16.view(np.float16)[..., 0].astype(np.float32) - m) > 1e-6 * np.abs(m)
    if moved.any() and not note:
        note = "minimums rounded to float16"
    raw = np.concatenate([d16, m16, _nibbles_ggml(q4)], -1).reshape(*lead, -1)
    return "Q4_1", raw, note


def _float_bytes(values: np.ndarray, type_: str) -> np.ndarray:
    """float32 [out, in] -> the requested type's raw bytes (or a float array for F32/F16)."""
    if type_ == "F32":
        return values.astype(np.float32)
    if type_ == "F16":
        return values.astype(np.float16)
    return gguf_encode(type_, values)


def _permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of `lowbit.models.unpermute_rope_rows`: rotate-half rows -> interleaved."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _lookup(tree: Any, path: tuple) -> Any:
    node = tree
    for key in path:
        if isinstance(node, dict):
            if key in node:
                node = node[key]
            elif str(key) in node:
                node = node[str(key)]
            else:
                return None
        elif isinstance(node, list | tuple) and isinstance(key, int) and key < len(node):
            node = node[key]
        else:
            node = getattr(node, str(key), None)
            if node is None:
                return None
        if hasattr(node, "value") and not isinstance(node, np.ndarray | QArray):
            node = node.value  # an nnx.Variable
    return node


def _config_metadata(config: DecoderConfig) -> dict[str, tuple[Any, gguf.GGUFValueType]]:
    types = {int: gguf.GGUFValueType.UINT32, float: gguf.GGUFValueType.FLOAT32}
    return {
        key: (value, types.get(type(value), gguf.GGUFValueType.STRING))
        for key, value in gguf_metadata(config).items()
    }


def _decoder_config(gguf_file: GGUFFile) -> DecoderConfig | None:
    try:
        return decoder_config_from_gguf(gguf_file)
    except ValueError:
        return None


def _source_metadata(gguf_file: GGUFFile) -> list[tuple[str, Any, Any, Any]]:
    """(key, value, type, array item type) of every metadata key of a GGUF file, in file
    order, but those set for the output."""
    fields = []
    for key, value in gguf_file.metadata.items():
        if key in _SKIP_KEYS:
            continue
        vtype, sub = gguf_file.value_types[key]
        if vtype == gguf.GGUFValueType.ARRAY and not value:
            continue  # the writer cannot write an empty array; llama.cpp reads none
        fields.append((key, value, vtype, sub))
    return fields


def export_gguf(
    params: Any,
    path: str | os.PathLike[str],
    *,
    config: DecoderConfig,
    type: str | None = None,  # noqa: A002 - the GGUF term
    source: str | os.PathLike[str] | GGUFFile | None = None,
    strict: bool = False,
    log: Callable[[str], None] | None = print,
) -> ExportReport:
    """Writes a `Decoder` params tree as a GGUF file llama.cpp can run (its architecture
    from `config`).

    Args:
      params: the model's parameters (pure dicts or an ``nnx.State``) with the `Decoder`
        module's paths (``embed/embedding``, ``layers/{i}/attn/q_proj/kernel``, ...): float
        arrays and QArrays, e.g. from `lowbit.quantize`, `load_checkpoint` or `import_gguf`.
      path: the ``.gguf`` file to write (replaced atomically).
      config: the model's `DecoderConfig`.
      type: None (keep quantized weights that map directly, the others as Q8_0; floats as
        F32), a GGML type, or a llama.cpp mix; see `EXPORT_TYPES` and the module docstring.
      source: a GGUF file (a path, or one already read) to copy metadata (tokenizer, chat
        template, ...) from, each key with its type. Its hyper-parameters are kept when they
        describe `config`; otherwise (another architecture or other shapes) only its
        ``general.*`` and ``tokenizer.*`` keys are.
      strict: raise instead of falling back when a tensor's rows are not whole blocks.
      log: called with one line per tensor that was not written directly (None: silent).
    Returns:
      An `ExportReport`.
    Raises:
      ValueError: for an unknown type, a missing parameter, a tensor that cannot take the
        type with `strict`, or a written file that does not read back.
      OSError: when the file cannot be written (nothing is left behind).
    """
    type_ = check_type(type)
    path = os.fspath(path)
    plan, metadata = export_layout(params, config, type_, source, strict)
    notes: list[TensorNote] = []

    def encoded() -> Iterator[np.ndarray]:
        for p in plan:
            if p.where is None:
                yield np.asarray(config.rope_freq_factors, np.float32)
                continue
            value = gguf_oriented(p.name, p.where, _leaf(params, p.where.path, abstract=False))
            raw, written, how, note = _tensor(p.name, value, type_, config, strict)
            del value
            if p.where.unpermute_heads is not None:
                raw = _permute_rope_rows(raw, p.where.unpermute_heads)
            if (written, tuple(raw.shape), raw.dtype) != (p.written, p.shape, p.dtype):
                raise ValueError(
                    f"GGUF tensor {p.name!r}: planned as {p.written} {p.shape} but encoded as "
                    f"{written} {tuple(raw.shape)}: its leaf changed while exporting"
                )
            notes.append(TensorNote(p.name, written, how, note))
            if log is not None and (how == "requantized" or note):  # not plain float -> type
                log(f"{p.name}: {how} as {written}" + (f" ({note})" if note else ""))
            yield raw

    write_gguf(path, config.architecture, metadata, tensor_specs(plan), encoded())
    return ExportReport(path=path, nbytes=os.path.getsize(path), tensors=tuple(notes))


@dataclasses.dataclass(frozen=True)
class PlannedTensor:
    """One tensor of the file, before its data: GGUF name, where its leaf is (None for the
    config's rope_freqs), the type written, and the written array's shape and dtype."""

    name: str
    where: Any
    written: str
    shape: tuple[int, ...]
    dtype: np.dtype


def export_layout(
    params: Any,
    config: DecoderConfig,
    type_: str | None,
    source: str | os.PathLike[str] | GGUFFile | None,
    strict: bool,
) -> tuple[list[PlannedTensor], list[tuple[str, Any, Any, Any]]]:
    """Every tensor of the file `export_gguf` writes (name, type, byte shape), from shapes and
    metadata alone, and the file's metadata keys: all that precedes the tensors' data."""
    # Pass 1 plans every tensor (name, type, byte shape) from shapes and metadata alone: the
    # file's header comes before its data. Pass 2 reads, encodes and writes one at a time.
    plan = []
    for name, where in gguf_param_map(config).items():
        value = _leaf(params, where.path, abstract=True)
        if value is None:
            raise ValueError(
                f"params have no {'/'.join(map(str, where.path))} for GGUF tensor {name!r}"
            )
        value = gguf_oriented(name, where, _abstract(value))
        plan.append(
            planned_tensor(name, where, tensor_type(name, value, type_, config, strict), value)
        )
    if config.rope_freq_factors is not None:
        # Llama 3's frequency divisors travel as a tensor, not as metadata.
        factors = np.asarray(config.rope_freq_factors, np.float32)
        plan.append(PlannedTensor("rope_freqs.weight", None, "F32", factors.shape, factors.dtype))
    file_type = _file_type(type_, [p.written for p in plan])
    metadata = None
    if source is not None:
        source_file = source if isinstance(source, GGUFFile) else read_gguf(source)
        metadata = _source_metadata(source_file)
        arch_keys = [m for m in metadata if m[0].startswith(f"{config.architecture}.")]
        if not arch_keys or _decoder_config(source_file) != config:
            # Another architecture's file (its tokenizer wanted), or other shapes: the
            # hyper-parameters come from `config`, everything else from the file.
            ours = [(k, v, t, None) for k, (v, t) in _config_metadata(config).items()]
            metadata = [m for m in metadata if m[0].startswith(("general.", "tokenizer."))]
            metadata += [m for m in ours if m[0] not in _SKIP_KEYS]
    if metadata is None:
        ours = _config_metadata(config).items()
        metadata = [(k, v, t, None) for k, (v, t) in ours if k not in _SKIP_KEYS]
    uint32 = gguf.GGUFValueType.UINT32
    metadata += [
        ("general.file_type", file_type, uint32, None),
        ("general.quantization_version", 2, uint32, None),
    ]
    return plan, metadata


def tensor_specs(plan: list[PlannedTensor]) -> list[TensorSpec]:
    """The writer's declaration of each planned tensor."""
    return [TensorSpec(p.name, p.written, p.shape, p.dtype) for p in plan]


def planned_tensor(name: str, where: Any, written: str, value: Any) -> PlannedTensor:
    shape = tuple(value.shape)
    if written in FLOAT_TYPES:
        return PlannedTensor(name, where, written, shape, np.dtype(_FLOAT_DTYPES[written]))
    t = block_type(written)
    row_bytes = shape[-1] // t.block_size * t.type_size
    return PlannedTensor(name, where, written, (*shape[:-1], row_bytes), np.dtype(np.uint8))


def _leaf(params: Any, path: tuple, *, abstract: bool) -> Any:
    """The leaf at `path` of a params tree, or of a lazy mapping {path tuple: leaf} such as
    `SourceParams` (read only when not `abstract`; its ``abstract(path)`` otherwise)."""
    if isinstance(params, Mapping) and callable(getattr(params, "abstract", None)):
        key = tuple(path)
        if key not in params:
            return None
        return params.abstract(key) if abstract else params[key]
    leaf = _lookup(params, path)
    if isinstance(leaf, PreparedQArray):
        # GGUF holds the logical form (as checkpoints do): recovered from the kernel layout,
        # as shapes only while planning.
        return jax.eval_shape(PreparedQArray.logical, leaf) if abstract else leaf.logical()
    return leaf


def _abstract(value: Any) -> Any:
    """`value` with every array replaced by its shape and dtype (nothing computed)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), value)


def gguf_oriented(name: str, where: Any, value: Any) -> Any:
    """The leaf in GGUF's axis order; expert routers as floats (llama.cpp reads no other)."""
    abstract = any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(value))
    if where.transpose:
        value = jax.eval_shape(swap_last, value) if abstract else swap_last(value)
    if name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")) and isinstance(
        value, QArray
    ):
        value = (
            jax.ShapeDtypeStruct(value.shape, np.float32)
            if abstract
            else value.dequantize(np.float32)
        )
    return value


def tensor_type(
    name: str, value: Any, type_: str | None, config: DecoderConfig, strict: bool
) -> str:
    """The type tensor `name` is written as, from its shape and metadata (`_tensor`'s rule)."""
    requested = _requested(name, type_, config)
    if isinstance(value, QArray):
        direct = _direct_type(value)
        if direct is not None:
            return direct
        return fitting_type(requested or "Q8_0", name, value.shape[-1], strict)[0]
    if len(value.shape) == 1 or requested is None:
        return "F32"
    return fitting_type(requested, name, value.shape[-1], strict)[0]


def _tensor(name, value, type_, config, strict) -> tuple[np.ndarray, str, str, str]:
    """One tensor in GGUF layout -> (raw or float array, type, how, note)."""
    requested = _requested(name, type_, config)
    if isinstance(value, QArray):
        direct = _direct(value)
        if direct is not None:
            written, raw, note = direct
            return raw, written, "direct", note
        values = np.asarray(value.dequantize(np.float32))
        what = f"{value.format} {'x'.join(map(str, value.block_shape))} blocks"
        target = requested or "Q8_0"
    else:
        values = np.asarray(value, np.float32)
        what = None
        target = requested
        if values.ndim == 1 or target is None:
            return values.astype(np.float32), "F32", "float", ""
    chosen, note = fitting_type(target, name, values.shape[-1], strict)
    if what is not None:
        note = f"from {what}" + (f"; {note}" if note else "")
    if what is not None:
        how = "requantized"
    else:
        how = "float" if chosen in FLOAT_TYPES else "quantized"
    return _float_bytes(values, chosen), chosen, how, note


def _file_type(type_: str | None, written: list[str]) -> int:
    if type_ is not None:
        key = _FILE_TYPES.get(type_, f"MOSTLY_{type_}")
    else:
        counts = {t: written.count(t) for t in set(written) if t != "F32"}
        common = max(counts, key=counts.get) if counts else "F32"
        key = _FILE_TYPES.get(common, f"MOSTLY_{common}")
    member = getattr(gguf.LlamaFileType, key, gguf.LlamaFileType.GUESSED)
    return int(member)
