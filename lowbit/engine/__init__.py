"""The engine: a jaxpr interpreter that runs unmodified JAX functions on quantized values.

`interpret(fn)` returns a function that accepts `QArray` / `QatWeight` leaves wherever `fn`
expects float arrays; every primitive that meets one either has a rule (quantized matmul, layout
op on packed values, recursion into jit / scan / while / cond / remat / custom derivatives) or
dequantizes it, counted in an `EngineReport` (or raised in strict mode). `probe(fn, ...)` runs
the same interpreter with parameters tagged by path (`Probe`) and reports each op that reads one
(`Use`) with its real activation: calibration statistics. Questions that need no values (which
ops a parameter feeds, which axis `kernel_axes` lays a weight out for) are reductions over one
abstract walk of the jaxpr (`_walker`), which follows every sub-jaxpr through one table.
"""

from lowbit.engine._axes import contraction_axes, kernel_axes
from lowbit.engine._compat import EXPLICIT_AXES_QUANTIZE, distributed_client
from lowbit.engine._interpreter import interpret, probe, trace_report
from lowbit.engine._probe import Probe, Scaled, Use
from lowbit.engine._report import EngineFallbackError, EngineReport
from lowbit.engine._values import is_quantized
from lowbit.engine._walker import Traced, ops_fed, trace

__all__ = [
    "EngineFallbackError",
    "EngineReport",
    "Probe",
    "Scaled",
    "Use",
    "interpret",
    "kernel_axes",
    "probe",
    "trace_report",
    "EXPLICIT_AXES_QUANTIZE",
    "Traced",
    "contraction_axes",
    "distributed_client",
    "is_quantized",
    "ops_fed",
    "trace",
]
