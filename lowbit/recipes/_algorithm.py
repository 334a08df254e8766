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
from collections.abc import Mapping
from typing import Any


def _check(owner: str, field: str, value: Any, ok: bool, accepted: str) -> None:
    if not ok:
        raise ValueError(f"{owner}.{field}: {value!r}; accepted: {accepted}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTQ:
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

    def __post_init__(self):
        _check(
            "GPTQ", "damp", self.damp, _is_number(self.damp) and 0 < self.damp < 10, "0 < damp < 10"
        )
        _check(
            "GPTQ",
            "block",
            self.block,
            isinstance(self.block, int) and self.block > 0,
            "an int > 0",
        )
        for field in ("act_order", "clip", "scale", "full_range"):
            value = getattr(self, field)
            _check("GPTQ", field, value, isinstance(value, bool), "true or false")
        _check(
            "GPTQ",
            "refine",
            self.refine,
            isinstance(self.refine, int) and not isinstance(self.refine, bool) and self.refine >= 0,
            "an int >= 0",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class AWQ:
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

    def __post_init__(self):
        _check("AWQ", "grid", self.grid, isinstance(self.grid, int) and self.grid > 0, "an int > 0")
        _check("AWQ", "clip", self.clip, isinstance(self.clip, bool), "true or false")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SmoothQuant:
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

    def __post_init__(self):
        _check(
            "SmoothQuant",
            "alpha",
            self.alpha,
            _is_number(self.alpha) and 0 <= self.alpha <= 1,
            "a number in [0, 1]",
        )
        _check(
            "SmoothQuant",
            "grid",
            self.grid,
            isinstance(self.grid, int) and not isinstance(self.grid, bool) and self.grid >= 0,
            "an int >= 0 (0: no search)",
        )
        _check("SmoothQuant", "in_op", self.in_op, isinstance(self.in_op, bool), "true or false")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HQQ:
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

    def __post_init__(self):
        _check(
            "HQQ", "iters", self.iters, isinstance(self.iters, int) and self.iters > 0, "an int > 0"
        )
        _check("HQQ", "p", self.p, _is_number(self.p) and 0 < self.p < 1, "0 < p < 1")
        _check("HQQ", "beta", self.beta, _is_number(self.beta) and self.beta > 0, "a number > 0")
        _check(
            "HQQ", "kappa", self.kappa, _is_number(self.kappa) and self.kappa > 1, "a number > 1"
        )


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
    try:
        return cls(**kwargs)
    except ValueError as err:
        raise ValueError(f"{field}: {err}") from None
