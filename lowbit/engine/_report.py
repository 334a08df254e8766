"""`EngineReport`: what the interpreter did with quantized values, and `EngineFallbackError`."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any


class EngineFallbackError(ValueError):
    """Raised in strict mode when a quantized value meets a primitive without a rule.

    Attributes:
      primitive: the JAX primitive name, e.g. ``"cumsum"``.
      value: a short description of the quantized value (format, shape).
      location: ``file:line (function)`` of the user code, or ``"unknown"``.
      reason: why no rule applied.
    """

    def __init__(
        self, primitive: str, value: str, location: str, reason: str, *, fix: str | None = None
    ):
        self.primitive = primitive
        self.value = value
        self.location = location
        self.reason = reason
        fix = fix or (
            "in strict mode the engine does not dequantize. Keep this weight in float (exclude "
            "it from the recipe), or run with strict=False to dequantize it here."
        )
        super().__init__(
            f"primitive {primitive!r} at {location} received quantized value {value} and "
            f"{reason}; {fix}"
        )


@dataclasses.dataclass(kw_only=True)
class EngineReport:
    """What one trace of an interpreted function did with quantized values.

    Counts describe the most recent trace (they are reset when a call starts tracing), so for
    `jax.jit(interpret(fn, report=r))` they describe the compiled program.

    Attributes:
      quantized_ops: ``{"<primitive>:<path>": count}`` for ops that consumed quantized values,
        e.g. ``{"dot_general:int8_int32": 12}``; the path is what `lowbit.ops` reports.
      layout_ops: ``{"<primitive>": count}`` layout ops applied to packed values (transpose,
        reshape, slice, ...), which never dequantize; ``gather`` (embedding lookup) gathers
        packed rows and dequantizes only those rows.
      fallbacks: ``{"<primitive>": count}`` primitives where a quantized value was dequantized
        because no rule applied, or re-laid out on every call (a logical QArray reaching a CPU
        kernel, a prepared weight used other than as the layer it was prepared for).
      fallback_details: one line per fallback: primitive, value, location and reason.
      materialized: how many times a full float copy of a weight was computed (each fallback,
        plus every op whose implementation dequantized, e.g. the ``"reference"`` path).
      declined: ``{"<platform>: <kernel>: <reason>": count}`` products that a platform's
        kernel for the weight's format leaves to the portable product when the program is
        lowered there, e.g. ``"cuda: pallas: a weight under GPU_MIN_WEIGHT_ELEMENTS
        (4194304)"`` (XLA's product runs them on that platform; nothing is dequantized on
        the others).
    """

    quantized_ops: dict[str, int] = dataclasses.field(default_factory=collections.Counter)
    layout_ops: dict[str, int] = dataclasses.field(default_factory=collections.Counter)
    fallbacks: dict[str, int] = dataclasses.field(default_factory=collections.Counter)
    fallback_details: list[str] = dataclasses.field(default_factory=list)
    materialized: int = 0
    declined: dict[str, int] = dataclasses.field(default_factory=collections.Counter)

    def reset(self) -> None:
        """Forgets all counts (called at the start of each trace)."""
        self.quantized_ops = collections.Counter()
        self.layout_ops = collections.Counter()
        self.fallbacks = collections.Counter()
        self.fallback_details = []
        self.materialized = 0
        self.declined = collections.Counter()

    @property
    def num_fallbacks(self) -> int:
        return sum(self.fallbacks.values())

    @property
    def num_quantized_ops(self) -> int:
        return sum(self.quantized_ops.values())

    def summary(self) -> str:
        """A few human-readable lines."""
        lines = [
            f"quantized ops: {dict(sorted(self.quantized_ops.items())) or 'none'}",
            f"layout ops on packed values: {dict(sorted(self.layout_ops.items())) or 'none'}",
            f"fallbacks (dequantized): {dict(sorted(self.fallbacks.items())) or 'none'}",
            f"float weights materialized: {self.materialized}",
        ]
        lines += [f"  {detail}" for detail in self.fallback_details]
        if self.declined:
            lines.append("kernels not taken (the portable product runs there):")
            lines += [f"  {why}: {n}" for why, n in sorted(self.declined.items())]
        return "\n".join(lines)

    # --- recording (used by the interpreter) ---------------------------------------------------
    def record_op(self, primitive: str, path: str) -> None:
        self.quantized_ops[f"{primitive}:{path}"] += 1
        if path == "reference":
            self.materialized += 1

    def record_declined(self, platform: str, reason: str) -> None:
        self.declined[f"{platform}: {reason}"] += 1

    def record_layout(self, primitive: str) -> None:
        self.layout_ops[primitive] += 1

    def record_fallback(
        self, primitive: str, value: str, location: str, reason: str, *, materialized: bool = True
    ) -> None:
        self.fallbacks[primitive] += 1
        self.fallback_details.append(f"{primitive} at {location}: {value} {reason}")
        self.materialized += int(materialized)


def describe(value: Any) -> str:
    """Short description of a quantized value for reports and errors (its `describe()`)."""
    return value.describe()
