"""`Rule`: which parameters to quantize, and how.

A rule selects parameters as every rule type does, through a `Select` (`lowbit.recipes._select`):
by the '/'-joined path of the leaf in the params pytree (``layers/0/mlp/up/kernel``; NNX
`Variable`s contribute no ``value`` component) with `re.fullmatch`. It says how the weight, the
operand it meets in a matmul (the activation) and its gradient (QAT) are quantized. Rules are
frozen, keyword-only and hashable, so a recipe can sit in static jit metadata.

Stacked (scanned) weights: a parameter of shape ``[layers, in, out]`` holds one weight per layer
along its leading axis. `stacked_axes=1` says so: the rule's weight granularity then applies to
the trailing axes and every index of the stacked axes gets its own scales (a per-tensor weight
scale becomes one scale per layer, a per-channel scale one per layer and channel). Granularity
axes given as negative numbers already count from the end and need no change.
"""

from __future__ import annotations

import dataclasses

from lowbit.qarray import PerBlock, PerChannel, PerGroup, PerTensor, PerToken, QuantConfig
from lowbit.recipes._algorithm import Algorithm, parse_algorithm
from lowbit.recipes._select import Select


def _check_config(field: str, config: object) -> None:
    if config is not None and not isinstance(config, QuantConfig):
        raise TypeError(
            f"{field} must be a lowbit.qarray.QuantConfig or None, got "
            f"{type(config).__name__}: {config!r} (strings are accepted only by Recipe.from_json "
            "and presets)"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
    """One quantization rule.

    Attributes:
      path: regex matched with `re.fullmatch` against the parameter path.
      exclude: optional regex; a path it fully matches is not matched by this rule.
      ops: optional filter on the operations the weight feeds (names from `OPS`). A filtered
        rule quantizes a weight only if it feeds at least one of these ops; which ops a weight
        feeds is found by tracing the model (`lowbit.api.param_uses`), so `quantize_params`
        needs that trace (its `uses` argument) for any recipe with a filtered rule that matches.
        A weight matched by such a rule but feeding none of its ops (e.g. an embedding table
        that only feeds a `gather` under ``ops=("dot_general",)``) is kept in float, and the
        report says so.
      weight: how to quantize the weight, or None to keep it in float.
      activation: how ops consuming the weight quantize their other operand (None = weight-only).
      gradient: how the QAT backward pass quantizes its gradient matmuls (None = float).
      static_activation: calibrate static activation bounds (`lowbit.api.calibrate`) instead
        of computing them per call. A `Fixed` activation calibration is static by itself.
      min_size: parameters with fewer elements stay in float.
      min_ndim: parameters with fewer axes (not counting stacked axes) stay in float; 2 keeps
        biases and norm scales in float.
      stacked_axes: leading axes that index stacked layers (see module docstring).
      algorithm: how weights are rounded beyond nearest: `GPTQ`, `AWQ`, `SmoothQuant`, `HQQ`
        (`lowbit.recipes._algorithm`), or None for round-to-nearest. Data-driven ones need
        calibration batches (`lowbit.quantize_params(..., fn=..., calibration=...)`).
      select: the `Select` built from `path`, `exclude`, `ops`, `min_size`, `min_ndim` and
        `stacked_axes` (not an argument): how every rule type picks its parameters.

    Raises:
      TypeError / ValueError: naming the field, the value and what is accepted.
    """

    path: str = ".*"
    exclude: str | None = None
    ops: tuple[str, ...] | None = None
    weight: QuantConfig | None = None
    activation: QuantConfig | None = None
    gradient: QuantConfig | None = None
    static_activation: bool = False
    min_size: int = 0
    min_ndim: int = 2
    stacked_axes: int = 0
    algorithm: Algorithm | None = None
    select: Select = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "algorithm", parse_algorithm(self.algorithm))
        if self.algorithm is not None and self.weight is None:
            raise ValueError(
                f"Rule(path={self.path!r}) sets algorithm={self.algorithm.name!r} but weight=None; "
                "an algorithm rounds a quantized weight: set weight too"
            )
        object.__setattr__(self, "select", Select.of(self))
        object.__setattr__(self, "ops", self.select.ops)
        for field in ("weight", "activation", "gradient"):
            _check_config(f"Rule.{field}", getattr(self, field))
        if self.weight is None and (self.activation is not None or self.gradient is not None):
            raise ValueError(
                f"Rule(path={self.path!r}) sets activation/gradient but weight=None: activation "
                "and gradient quantization ride on the quantized weight; set weight too"
            )
        if self.static_activation and self.activation is None:
            raise ValueError(
                f"Rule(path={self.path!r}) sets static_activation=True but activation=None; "
                "give an activation config to calibrate"
            )

    def matches(self, path: str) -> bool:
        """True if `path` fully matches `self.path` and not `self.exclude`."""
        return self.select.matches_path(path)

    def feeds(self, ops: frozenset[str]) -> bool:
        """True if a weight feeding `ops` passes this rule's op filter."""
        return self.select.feeds(ops)

    def weight_config(self, ndim: int) -> QuantConfig:
        """The weight config for a parameter with `ndim` axes, with stacked axes kept whole.

        Raises:
          ValueError: if the rule keeps weights in float or `ndim` <= `stacked_axes`.
        """
        if self.weight is None:
            raise ValueError(f"Rule(path={self.path!r}) keeps weights in float (weight=None)")
        if ndim <= self.stacked_axes:
            raise ValueError(
                f"Rule(path={self.path!r}) has stacked_axes={self.stacked_axes} but the parameter "
                f"has only {ndim} axes"
            )
        granularity = stack_granularity(self.weight.granularity, self.stacked_axes)
        return dataclasses.replace(self.weight, granularity=granularity)


def stack_granularity(granularity, stacked: int):
    """Rewrites a granularity written for a single weight to one for `stacked` leading layer
    axes: non-negative axes shift right by `stacked`, and the stacked axes keep one scale per
    index."""
    if stacked == 0:
        return granularity
    lead = tuple(range(stacked))
    if isinstance(granularity, PerTensor):
        return PerChannel(axes=lead)
    if isinstance(granularity, PerChannel):
        shifted = tuple(a + stacked if a >= 0 else a for a in granularity.axes)
        return PerChannel(axes=lead + shifted)
    if isinstance(granularity, PerGroup):
        axis = granularity.axis + stacked if granularity.axis >= 0 else granularity.axis
        return PerGroup(granularity.size, axis)
    # PerBlock covers trailing axes and gives leading axes one scale per index; PerToken
    # reduces the last axis only: both already keep stacked axes whole.
    if isinstance(granularity, PerBlock | PerToken):
        return granularity
    raise TypeError(
        f"stacked_axes={stacked} cannot rewrite granularity {granularity!r}; accepted: "
        "PerTensor, PerChannel, PerGroup, PerBlock, PerToken"
    )
