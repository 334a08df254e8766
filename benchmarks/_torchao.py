"""torchao peers for the kernel benchmark: quantized `torch.nn.Linear` stacks, compiled.

Optional: torch (CPU wheel) and torchao live in the benchmark environment only (`make bench`).
Each peer is the configuration torchao documents for CPU inference:

- int4 weight-only, group 128: `Int4OpaqueTensor` (the CPU tinygemm kernel,
  `_weight_int4pack_mm_for_cpu`), bfloat16 activations, as torchao requires for it;
- int8 weight-only: `Int8WeightOnlyConfig`, bfloat16 activations;
- w8a8: `Int8DynamicActivationInt8WeightConfig`, float32 activations (as lowbit's);
- float32: the plain `nn.Linear`.

All go through `torch.compile` (inductor), as torchao's CPU guidance does.
"""

from __future__ import annotations

import logging
import os
import warnings
from types import ModuleType

# Peer name -> (quantization, torch activation dtype name).
PEERS = {
    "torch f32": (None, "float32"),
    "torchao int4 g128": ("int4", "bfloat16"),
    "torchao int8": ("int8", "bfloat16"),
    "torchao w8a8": ("w8a8", "float32"),
}


def load() -> tuple[ModuleType, ModuleType] | None:
    """(torch, torchao) when both import, else None."""
    try:
        import torch
        import torchao
    except ImportError:
        return None
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 0)) or os.cpu_count() or 1)
    logging.getLogger("torch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="torch")
    warnings.filterwarnings("ignore", module="torchao")
    return torch, torchao


def version() -> str:
    import torch
    import torchao

    return f"torch {torch.__version__}, torchao {torchao.__version__}"


def _int4_config(group_size: int):
    """torchao's CPU int4 weight-only config across the versions that renamed it."""
    try:  # torchao >= 0.17: the CPU path moved to a prototype config
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        return PrototypeInt4WeightOnlyConfig(group_size=group_size)
    except ImportError:
        pass
    from torchao.quantization import Int4WeightOnlyConfig

    try:  # 0.14 - 0.16
        return Int4WeightOnlyConfig(group_size=group_size, int4_packing_format="opaque")
    except TypeError:  # older: the layout object
        from torchao.dtypes import Int4CPULayout

        return Int4WeightOnlyConfig(group_size=group_size, layout=Int4CPULayout())


def _config(quant: str):
    from torchao.quantization import (
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
    )

    if quant == "int4":
        return _int4_config(128)
    if quant == "int8":
        return Int8WeightOnlyConfig()
    return Int8DynamicActivationInt8WeightConfig()


def build(peer: str, widths: list[tuple[int, int]], seed: int = 0):
    """A compiled callable x -> y for a stack of linears [(in, out), ...] with SiLU between.

    Returns (fn, make_input) where make_input(m) gives an [m, in] tensor of the peer's dtype.
    """
    import torch
    from torchao.quantization import quantize_

    quant, dtype_name = PEERS[peer]
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (k, n) in enumerate(widths):
        if i:
            layers.append(torch.nn.SiLU())
        layers.append(torch.nn.Linear(k, n, bias=False))
    model = torch.nn.Sequential(*layers).to(dtype).eval()
    if quant is not None:
        quantize_(model, _config(quant))
    compiled = torch.compile(model)

    def fn(x):
        with torch.inference_mode():
            return compiled(x)

    def make_input(m: int):
        return torch.randn(m, widths[0][0], dtype=dtype)

    return fn, make_input
