"""Algorithm settings a `Rule` can carry: how its weights are rounded beyond nearest (RTN).

Each is a frozen, hashable config (the implementations live in `lowbit.algorithms`):

  * `GPTQ`        — column-by-column rounding with the inverse-Hessian error update (needs data).
  * `AWQ`         — activation-aware per-input-channel scales, folded into the preceding norm
                    or linear layer, and a clipping search (needs data).
  * `SmoothQuant` — migrates activation outliers into the weights (w8a8 / w4a8; needs data).
  * `HQQ`         — data-free half-quadratic optimization of the zero points (asymmetric formats).

JSON form: ``{"name": "gptq", "damp": 0.01, ...}`` (see `algorithm_to_dict`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from lowbit.recipes._text_form import field_errors


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


_TRUE_OR_FALSE = (_is_bool, "true or false")


class _Checked:
    """A settings dataclass whose fields are checked on construction against one table.

    Attributes:
      checks: field name -> (predicate on its value, the accepted values in words), checked
        in order; the first failure raises ``ValueError("<Class>.<field>: <value>; accepted:
        <words>")``.
    """

    checks: ClassVar[Mapping[str, tuple[Callable[[Any], bool], str]]] = {}

    def __post_init__(self) -> None:
        for field, (ok, accepted) in self.checks.items():
            value = getattr(self, field)
            if not ok(value):
                raise ValueError(f"{type(self).__name__}.{field}: {value!r}; accepted: {accepted}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTQ(_Checked):
    """GPTQ (Frantar et al., 2022).

    Attributes:
      damp: dampening added to the Hessian diagonal, as a fraction of its mean (raised x10,
        up to 3 times, when the Cholesky factorization fails).
      block: columns per lazy batched update.
      act_order: quantize columns in order of decreasing Hessian diagonal (scales stay the
        static RTN groups, so the stored layout does not change). On by default: on SmolLM2
        int4 g64 it took Δppl from +33% to +18% (README).
      clip: choose the grid GPTQ rounds onto by AWQ's activation-aware clipping search (each
        scale block's range shrunk where that lowers its output error on the calibration
        Gram matrix) instead of the weight config's own calibration.
      scale: first fold AWQ's per-input-channel scales into the preceding norm or linear
        layer (where exact, as `AWQ` does), then run GPTQ on the rescaled weights.
      refine: sweeps of greedy coordinate descent after GPTQ: each code moves to a
        neighbouring grid level where that lowers the layer's output error on the calibration
        Gram matrix (GPTQ rounds each column once, knowing only the columns before it).
      full_range: on a symmetric integer grid, also round to the format's extra negative
        code (int3's -4, int4's -8: two's complement has one more negative value than
        positive ones), which round-to-nearest never uses but every decoder reads. On SmolLM2
        it helped int3 g64 (+48.3% -> +42.7% perplexity) and hurt int4 g64 (+6.2% -> +7.2%).
    """

    damp: float = 0.01
    block: int = 128
    act_order: bool = True
    clip: bool = False
    scale: bool = False
    refine: int = 0
    full_range: bool = False
    needs_data = True
    name = "gptq"
    checks = {
        "damp": (lambda v: _is_number(v) and 0 < v < 10, "0 < damp < 10"),
        "block": (lambda v: isinstance(v, int) and v > 0, "an int > 0"),
        "act_order": _TRUE_OR_FALSE,
        "clip": _TRUE_OR_FALSE,
        "scale": _TRUE_OR_FALSE,
        "full_range": _TRUE_OR_FALSE,
        "refine": (
            lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
            "an int >= 0",
        ),
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class AWQ(_Checked):
    """AWQ (Lin et al., 2023): scales ``s = mean|x|**alpha / mean|w|**(1 - alpha)``, alpha
    searched on a grid, then a clipping search.

    Attributes:
      grid: number of alpha values tried in [0, 1).
      clip: also search, per scale block and output column, the fraction of the weight range
        that minimizes the output error (AutoAWQ's ``apply_clip``; on SmolLM2 int4 g64 it is
        most of AWQ's gain, see the README).
    """

    grid: int = 20
    clip: bool = True
    needs_data = True
    name = "awq"
    checks = {
        "grid": (lambda v: isinstance(v, int) and v > 0, "an int > 0"),
        "clip": _TRUE_OR_FALSE,
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class SmoothQuant(_Checked):
    """SmoothQuant (Xiao et al., 2022): ``s = max|x|**alpha / max|w|**(1 - alpha)``.

    Attributes:
      alpha: migration strength in [0, 1] (with ``grid == 0``).
      grid: 0 uses `alpha` everywhere; N > 0 searches alpha per folded group over N values
        in [0, 1), minimizing the group's output error with weights *and* activations
        quantized, on sampled calibration rows (the paper picks one alpha per model by hand;
        the best one differs between layers).
      in_op: where no layer can absorb the scale (the input is also read elsewhere, as a
        post-norm transformer's LayerNorm output feeding the residual, or is made by a
        nonlinearity), store it with the weight (`QArray.input_scale`) and apply it to the
        activation inside the quantized op, one elementwise product per call. False keeps
        round-to-nearest for those weights.
    """

    alpha: float = 0.5
    grid: int = 0
    in_op: bool = True
    needs_data = True
    name = "smoothquant"
    checks = {
        "alpha": (lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
        "grid": (
            lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
            "an int >= 0 (0: no search)",
        ),
        "in_op": _TRUE_OR_FALSE,
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class HQQ(_Checked):
    """HQQ (Badri & Shaji, 2023): data-free lp (p < 1) half-quadratic zero-point optimization.

    Attributes:
      iters: solver iterations.
      p: the lp norm of the reconstruction error, 0 < p < 1.
      beta: initial penalty; multiplied by `kappa` each iteration.
      kappa: penalty growth, > 1.
    """

    iters: int = 20
    p: float = 0.7
    beta: float = 10.0
    kappa: float = 1.01
    needs_data = False
    name = "hqq"
    checks = {
        "iters": (lambda v: isinstance(v, int) and v > 0, "an int > 0"),
        "p": (lambda v: _is_number(v) and 0 < v < 1, "0 < p < 1"),
        "beta": (lambda v: _is_number(v) and v > 0, "a number > 0"),
        "kappa": (lambda v: _is_number(v) and v > 1, "a number > 1"),
    }


Algorithm = GPTQ | AWQ | SmoothQuant | HQQ
ALGORITHMS: dict[str, type] = {c.name: c for c in (GPTQ, AWQ, SmoothQuant, HQQ)}


def algorithm_to_dict(algorithm: Algorithm) -> dict[str, Any]:
    return {"name": algorithm.name, **dataclasses.asdict(algorithm)}


def parse_algorithm(value: Any, field: str = "Rule.algorithm") -> Algorithm | None:
    """An algorithm from its JSON form (a dict with ``name``, or a bare name), or None.

    Raises:
      ValueError: naming `field`, the value and the accepted names / keys.
    """
    if value is None or isinstance(value, tuple(ALGORITHMS.values())):
        return value
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, Mapping) or value.get("name") not in ALGORITHMS:
        raise ValueError(f"{field}: {value!r}; accepted: null or one of {sorted(ALGORITHMS)}")
    cls = ALGORITHMS[value["name"]]
    kwargs = {k: v for k, v in value.items() if k != "name"}
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(
            f"{field}: unknown keys {unknown} for {value['name']!r}; accepted: {sorted(known)}"
        )
    with field_errors(field):
        return cls(**kwargs)
