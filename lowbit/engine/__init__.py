"""The engine: a jaxpr interpreter that runs unmodified JAX functions on quantized values.

`interpret(fn)` returns a function that accepts `QArray` / `QatWeight` leaves wherever `fn`
expects float arrays; every primitive that meets one either has a rule (quantized matmul, layout
op on packed values, recursion into jit / scan / while / cond / remat / custom derivatives) or
dequantizes it, counted in an `EngineReport` (or raised in strict mode).
"""

from lowbit.engine._interpreter import interpret, trace_report
from lowbit.engine._report import EngineFallbackError, EngineReport

__all__ = ["EngineFallbackError", "EngineReport", "interpret", "trace_report"]
