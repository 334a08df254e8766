"""Quantized checkpoints (safetensors + JSON manifest, atomic, validated, never pickled) and
importers from GGUF and Hugging Face safetensors files."""

from lowbit.io._checkpoint import load_checkpoint, read_manifest, save_checkpoint
from lowbit.io._config_dict import quant_config_from_dict, quant_config_to_dict
from lowbit.io._manifest import CheckpointError

__all__ = [
    "CheckpointError",
    "load_checkpoint",
    "quant_config_from_dict",
    "quant_config_to_dict",
    "read_manifest",
    "save_checkpoint",
]
