"""The size of a GGUF export before it is written, and what a size-budgeted plan is charged.

`export_gguf` plans its file from shapes and metadata alone (the header precedes the data), so
the file's size is known before any tensor is encoded: the header, the metadata (a tokenizer's
vocabulary and merges are most of it), the tensor table and the padding to the data's
alignment (`lowbit.gguf.header_nbytes`), then each tensor's bytes in the type it is written as,
padded to the alignment (`lowbit.gguf.padded`).

A planned weight is charged what the export writes for it: its own GGML type when its format
maps onto one without requantizing (a GGUF block format; int8 / int4 symmetric in groups of
32 -> Q8_0 / Q4_0; uint4 or asymmetric int4 in groups of 32 -> Q4_1), else Q8_0 (requantized,
or llama.cpp's fallback when rows are not whole blocks). Everything else the file holds (norms
and other 1-D tensors as F32, weights no candidate fits as F32, the header) is the plan's fixed
cost (`gguf_plan_bytes`).
"""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import Any

from lowbit.api import FileBytes
from lowbit.gguf import GGUFFile, header_nbytes, padded
from lowbit.io._gguf_export import (
    check_type,
    export_layout,
    gguf_oriented,
    planned_tensor,
    tensor_specs,
    tensor_type,
)
from lowbit.models import DecoderConfig, gguf_param_map


def gguf_nbytes(
    params: Any,
    *,
    config: DecoderConfig,
    type: str | None = None,  # noqa: A002 - the GGUF term
    source: str | os.PathLike[str] | GGUFFile | None = None,
    strict: bool = False,
) -> int:
    """The size in bytes of the file `export_gguf` writes with the same arguments, from
    shapes and metadata alone (no tensor is read or encoded).

    Raises:
      ValueError: as `export_gguf` does before writing (an unknown type, a missing parameter,
        a tensor that cannot take the type with `strict`).
    """
    plan, metadata = export_layout(params, config, check_type(type), source, strict)
    specs = tensor_specs(plan)
    return header_nbytes(config.architecture, metadata, specs) + sum(
        padded(s.nbytes) for s in specs
    )


def gguf_plan_bytes(
    params: Any,
    planned: Collection[str],
    *,
    config: DecoderConfig,
    source: str | os.PathLike[str] | GGUFFile | None = None,
) -> FileBytes:
    """How the GGUF file `export_gguf` writes (no `type`) counts a plan of the weights at
    `planned` (``"layers/0/attn/q_proj/kernel"``, ...): the bytes it holds besides them, and
    the bytes each takes in the type its format is written as (see module docstring).

    The sum of the fixed bytes and each planned weight's charge is the file's size, to the
    byte (`gguf_nbytes` of the quantized params).

    Args:
      params: the float params (pure dicts or an ``nnx.State``; shapes are all that is read).
      planned: the parameter paths a plan chooses formats for.
      config: the model's `DecoderConfig`.
      source: the GGUF file whose metadata the export copies (`export_gguf`'s `source`).
    """
    planned = set(planned)
    plan, metadata = export_layout(params, config, None, source, False)
    specs = tensor_specs(plan)
    by_path = {"/".join(map(str, w.path)): (name, w) for name, w in gguf_param_map(config).items()}
    names = {by_path[p][0] for p in planned if p in by_path}
    fixed = header_nbytes(config.architecture, metadata, specs) + sum(
        padded(s.nbytes) for s in specs if s.name not in names
    )

    def nbytes(path: str, value: Any) -> int:
        if path not in by_path:
            return 0  # a parameter the export does not write
        name, where = by_path[path]
        oriented = gguf_oriented(name, where, value)
        written = tensor_type(name, oriented, None, config, False)
        return padded(tensor_specs([planned_tensor(name, where, written, oriented)])[0].nbytes)

    return FileBytes(fixed=fixed, nbytes=nbytes, what="GGUF file")
