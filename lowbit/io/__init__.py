"""Quantized checkpoints (safetensors + JSON manifest, atomic, validated, never pickled) and
importers from GGUF and Hugging Face safetensors files, and export to GGUF."""

from lowbit.io._adapters import (
    ADAPTERS_DIR,
    has_adapters,
    load_adapted_checkpoint,
    load_adapters,
    read_adapter_metadata,
    save_adapters,
)
from lowbit.io._checkpoint import (
    check_save_path,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from lowbit.io._checkpoint_leaves import CheckpointLeaves, checkpoint_leaves
from lowbit.io._checkpoint_writer import CheckpointWriter
from lowbit.io._config_dict import quant_config_from_dict, quant_config_to_dict
from lowbit.io._convert import ConvertReport, convert_checkpoint, streaming_problem
from lowbit.io._gguf_export import (
    EXPORT_TYPES,
    ExportReport,
    TensorNote,
    export_gguf,
    planned_types,
)
from lowbit.io._gguf_export import check_type as check_export_type
from lowbit.io._gguf_import import gguf_tensor_to_qarray, import_gguf
from lowbit.io._gguf_mixes import LLAMA_MIXES, check_mix, mix_type
from lowbit.io._gguf_size import gguf_nbytes, gguf_plan_bytes
from lowbit.io._hf_import import import_safetensors
from lowbit.io._manifest import CheckpointError
from lowbit.io._placement import Placement
from lowbit.io._processes import ProcessError
from lowbit.io._source import SourceParams
from lowbit.models import unpermute_rope_rows

__all__ = [
    "ADAPTERS_DIR",
    "EXPORT_TYPES",
    "LLAMA_MIXES",
    "check_mix",
    "mix_type",
    "planned_types",
    "CheckpointError",
    "CheckpointLeaves",
    "CheckpointWriter",
    "ConvertReport",
    "ExportReport",
    "Placement",
    "ProcessError",
    "SourceParams",
    "TensorNote",
    "check_save_path",
    "checkpoint_leaves",
    "convert_checkpoint",
    "export_gguf",
    "gguf_nbytes",
    "gguf_plan_bytes",
    "gguf_tensor_to_qarray",
    "has_adapters",
    "import_gguf",
    "import_safetensors",
    "load_adapted_checkpoint",
    "load_adapters",
    "load_checkpoint",
    "quant_config_from_dict",
    "quant_config_to_dict",
    "read_adapter_metadata",
    "read_manifest",
    "save_adapters",
    "save_checkpoint",
    "streaming_problem",
    "unpermute_rope_rows",
    "check_export_type",
]
