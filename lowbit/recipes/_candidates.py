"""Candidates of a size-budgeted plan: the formats (with their algorithm) a tensor may take.

A `Candidate` is one way to store a weight: a format, its groups along the contraction axis,
symmetric or not, and an optional algorithm (GPTQ). `lowbit.api.choose_plan` measures every
candidate on every weight and picks one per weight under a byte budget; the plan it returns is
an ordinary `Recipe` with one rule per weight (`plan_recipe`).

Text form (CLI ``--candidates``, comma separated): ``FORMAT[:gN][:sym|asym][:gptq]``::

    int8            int8, per channel
    int4:g64:asym   uint4 with zero points, groups of 64, min/max bounds
    nf4:g64         NF4, groups of 64
    int3:g64:gptq   int3, groups of 64, rounded by GPTQ
    q4_k            GGUF's Q4_K blocks (256 along the contraction axis)
    q8_0 q4_0 q4_1  GGUF's 32-blocks with float16 scales (int8 / int4 / uint4 g32)

Targets: a ``lowbit`` checkpoint stores any format; a ``gguf`` file only the GGML types
(`Candidate.gguf_type`). The cost of a candidate is counted from the bytes the target stores
(`Candidate.nbytes`): codes, scales and zero points as the checkpoint holds them, or the GGML
blocks as the GGUF file holds them.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax.numpy as jnp

from lowbit.formats import GGUFBlockFormat, format_names, get_format
from lowbit.qarray import AbsMax, MinMax, PerChannel, PerGroup, QuantConfig
from lowbit.recipes._algorithm import GPTQ
from lowbit.recipes._builders import layout_axes
from lowbit.recipes._recipe import Recipe
from lowbit.recipes._rule import Rule

TARGETS = ("lowbit", "gguf")

# GGML types stored as lowbit element formats in groups of 32 (float16 scales), as
# `lowbit.io.export_gguf` writes them without requantizing: type -> (format, symmetric).
_GGML_32 = {"q8_0": ("int8", True), "q4_0": ("int4", True), "q4_1": ("uint4", False)}
# (block size, bytes per block) of those types.
_GGML_32_SIZES = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20)}

_FORMS = "FORMAT[:gN][:sym|asym][:gptq], e.g. int4:g64:asym, nf4:g64, int3:g64:gptq, q4_k, q8_0"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One way to store a weight.

    Attributes:
      name: the text form (see module docstring), shown in plans.
      format: a registered format name.
      group: group (block) size along the contraction axis; None: per output channel (GGUF
        block formats: their own block).
      symmetric: no zero point.
      algorithm: `GPTQ` or None (round to nearest).
      gguf_type: the GGML type a GGUF file stores it as, or None (a lowbit-only format).
    """

    name: str
    format: str
    group: int | None = None
    symmetric: bool = True
    algorithm: GPTQ | None = None
    gguf_type: str | None = None

    def config(self, path: str, ndim: int) -> QuantConfig | None:
        """The weight config for a parameter at `path` with `ndim` axes, or None when no
        layout of `lowbit.recipes.matmul_rules` (``kernel`` / ``embedding`` / ``weight``)
        names it."""
        layout = layout_axes(path)
        if layout is None:
            return None
        channel_axis, group_axis = layout
        fmt = get_format(self.format)
        if isinstance(fmt, GGUFBlockFormat):
            granularity = PerGroup(fmt.block.block_size, axis=group_axis)
        elif self.group is None:
            granularity = PerChannel(axes=(channel_axis,))
        else:
            granularity = PerGroup(self.group, axis=group_axis)
        # GGML's 32-blocks keep float16 scales: stored so, they export byte for byte.
        scale_dtype = jnp.float16 if self.gguf_type in _GGML_32_SIZES else jnp.float32
        return QuantConfig(
            format=self.format,
            granularity=granularity,
            calibration=AbsMax() if self.symmetric else MinMax(),
            symmetric=self.symmetric,
            scale_dtype=scale_dtype,
        )

    def fits(self, path: str, shape: tuple[int, ...]) -> bool:
        """Whether a parameter of `shape` at `path` can take this candidate (whole groups /
        blocks along its contraction axis)."""
        config = self.config(path, len(shape))
        if config is None or len(shape) < 2:
            return False
        g = config.granularity
        if isinstance(g, PerGroup):
            return shape[g.axis] % g.size == 0
        return True

    def gguf_nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of a GGUF tensor of `shape` in `gguf_type` (blocks along the contraction
        axis: every block holds `block_size` values in `type_size` bytes)."""
        if self.gguf_type is None:
            raise ValueError(f"candidate {self.name!r} has no GGUF type")
        if self.gguf_type in _GGML_32_SIZES:
            block, size = _GGML_32_SIZES[self.gguf_type]
        else:
            b = get_format(self.format).block
            block, size = b.block_size, b.type_size
        return math.prod(shape) // block * size


def parse_candidate(text: str, field: str = "candidate") -> Candidate:
    """A `Candidate` from its text form (see module docstring).

    Raises:
      ValueError: naming `field`, the text and the accepted forms.
    """
    parts = [p.strip().lower() for p in str(text).strip().split(":")]
    name, options = parts[0], parts[1:]
    bad = lambda why: ValueError(f"{field}: {text!r}: {why}; accepted: {_FORMS}")  # noqa: E731
    group, symmetric, algorithm = None, True, None
    for option in options:
        if re.fullmatch(r"g\d+", option):
            group = int(option[1:])
        elif option in ("sym", "asym"):
            symmetric = option == "sym"
        elif option == "gptq":
            algorithm = GPTQ()
        else:
            raise bad(f"unknown option {option!r}")
    if name in _GGML_32:
        if group is not None or options.count("asym") or options.count("sym"):
            raise bad(f"{name} is fixed (groups of 32, float16 scales); give only :gptq")
        fmt, symmetric = _GGML_32[name]
        return Candidate(
            name=str(text).strip().lower(),
            format=fmt,
            group=32,
            symmetric=symmetric,
            algorithm=algorithm,
            gguf_type=name.upper(),
        )
    if name not in set(format_names()):
        raise bad(f"{name!r} is not a format (lowbit formats: {', '.join(format_names())})")
    fmt = get_format(name)
    if isinstance(fmt, GGUFBlockFormat):
        if options:
            raise bad(f"{name} is a GGUF block type with its own scales; it takes no options")
        return Candidate(name=name, format=name, gguf_type=fmt.ggml_type)
    if not symmetric and name.startswith("int"):
        name = "u" + name  # asymmetric int codes are stored unsigned with a zero point
        if name not in set(format_names()):
            raise bad(f"{name!r} (asymmetric {parts[0]}) is not a format")
    if algorithm is not None and group is None:
        raise bad("GPTQ candidates need groups (:gN)")
    return Candidate(
        name=str(text).strip().lower(),
        format=name,
        group=group,
        symmetric=symmetric,
        algorithm=algorithm,
    )


def parse_candidates(text: str, field: str = "--candidates") -> tuple[Candidate, ...]:
    """Comma-separated candidates (see `parse_candidate`); ValueError naming `field`."""
    items = [t for t in str(text).split(",") if t.strip()]
    if not items:
        raise ValueError(f"{field}: {text!r} names no candidate; accepted: a list of {_FORMS}")
    found = tuple(parse_candidate(t, field) for t in items)
    names = [c.name for c in found]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{field}: {repeated} given more than once")
    return found


DEFAULT_CANDIDATES = (
    "int8,int4:g32:asym,int4:g64:asym,int4:g64,nf4:g64,int4:g128,int3:g64,int3:g128,int2:g64:asym"
)
"""Candidates of a lowbit checkpoint when none are given (round to nearest): 8 down to 3 stored
bits per weight (float32 scales cost 32 / group bits, zero points as much again)."""

GGUF_CANDIDATES = "q8_0,q6_k,q5_k,q5_1,q5_0,q4_k,q4_1,q4_0,iq4_nl,q3_k,q2_k"
"""Candidates of a GGUF export when none are given: the GGML types lowbit encodes."""


def default_candidates(target: str) -> tuple[Candidate, ...]:
    """The default candidates of a target (``"lowbit"`` or ``"gguf"``)."""
    check_target(target)
    return parse_candidates(GGUF_CANDIDATES if target == "gguf" else DEFAULT_CANDIDATES)


def check_target(target: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"target {target!r}; accepted: {', '.join(TARGETS)}")


def storable(candidates: tuple[Candidate, ...], target: str) -> tuple[Candidate, ...]:
    """`candidates`, checked against what `target` can store.

    Raises:
      ValueError: when the target cannot store some of them (naming those, and what it
        stores): a GGUF file holds only GGML types.
    """
    check_target(target)
    if target == "lowbit":
        return candidates
    foreign = [c.name for c in candidates if c.gguf_type is None]
    if foreign:
        none = "none of the candidates" if len(foreign) == len(candidates) else "candidates"
        raise ValueError(
            f"--candidates: a GGUF file stores {none} {', '.join(foreign)} (lowbit-only "
            f"formats); give GGML types, e.g. --candidates {GGUF_CANDIDATES}"
        )
    return candidates


def plan_recipe(
    choices: dict[str, tuple[Candidate, tuple[int, ...]]], *, name: str = "plan"
) -> Recipe:
    """A plan as a `Recipe`: one rule per weight (its exact path, its candidate's config and
    algorithm), then one that keeps every other parameter in float; the shapes are recorded so
    the plan refuses another model (`Recipe.check_shapes`).

    Args:
      choices: {parameter path: (candidate, shape)}.
      name: the recipe's name.
    """
    rules = []
    for path, (cand, shape) in choices.items():
        config = cand.config(path, len(shape))
        if config is None:
            raise ValueError(f"plan: parameter {path!r} has no kernel/embedding/weight layout")
        rules.append(Rule(path=re.escape(path), weight=config, algorithm=cand.algorithm))
    rules.append(Rule(path=".*"))  # everything else stays float
    shapes = tuple((path, tuple(shape)) for path, (_, shape) in choices.items())
    return Recipe(rules=tuple(rules), name=name, shapes=shapes)
