"""QArray: quantized arrays as pytree values, and `quantize` / `dequantize` / `fake_quant`."""

from lowbit.qarray._amax_history import (
    AmaxHistory,
    amax_history_bounds,
    amax_history_init,
    amax_history_update,
)
from lowbit.qarray._calibration import (
    MSE,
    RMS,
    AbsMax,
    AbsMean,
    Calibration,
    Fixed,
    MinMax,
    Percentile,
    parse_calibration,
)
from lowbit.qarray._fake_quant import fake_quant
from lowbit.qarray._gguf_fake_quant import gguf_fake_quant, gguf_grid_init, gguf_pack
from lowbit.qarray._granularity import (
    Granularity,
    PerBlock,
    PerChannel,
    PerGroup,
    PerTensor,
    PerToken,
)
from lowbit.qarray._qarray import (
    DATA_FIELDS,
    META_FIELDS,
    QArray,
    broadcast_blocks,
    decode_scale,
    is_qarray,
)
from lowbit.qarray._quantize import (
    QuantConfig,
    blocks_view,
    check_tiles_within_shards,
    check_values,
    dequantize,
    quantize,
)
from lowbit.qarray._sparse import NMSparse, meta_bits, nm_mask, nm_sparsify
from lowbit.qarray._value import ArrayBacked, EngineValue, NoRule

__all__ = [
    "DATA_FIELDS",
    "ArrayBacked",
    "EngineValue",
    "NoRule",
    "META_FIELDS",
    "NMSparse",
    "meta_bits",
    "nm_mask",
    "nm_sparsify",
    "MSE",
    "RMS",
    "AbsMax",
    "AbsMean",
    "AmaxHistory",
    "Calibration",
    "Fixed",
    "Granularity",
    "MinMax",
    "PerBlock",
    "PerChannel",
    "PerGroup",
    "PerTensor",
    "PerToken",
    "Percentile",
    "QArray",
    "QuantConfig",
    "amax_history_bounds",
    "amax_history_init",
    "amax_history_update",
    "blocks_view",
    "broadcast_blocks",
    "check_values",
    "decode_scale",
    "dequantize",
    "fake_quant",
    "gguf_fake_quant",
    "gguf_grid_init",
    "gguf_pack",
    "is_qarray",
    "parse_calibration",
    "quantize",
    "check_tiles_within_shards",
]
