"""`Select`: which parameters a rule applies to, one concept for every kind of rule.

Quantization (`Rule`), LoRA (`LoraRule`), fp8 training (`Fp8Recipe`) and N:M sparsity
(`SparseRule`) all pick parameters the same way, so they all hold a `Select` built from their
own keyword arguments (``path=``, ``exclude=``, ``ops=``, ``min_ndim=`` ...) and ask it:

  * the parameter's path (`path_string`: '/'-joined keys, ``layers/0/mlp/up/kernel``; NNX
    `Variable`s add no ``value`` component) fully matches `path` (`re.fullmatch`) and not
    `exclude`;
  * the parameter is an array with at least `min_ndim` axes besides its `stacked_axes` and at
    least `min_size` elements;
  * with `ops`, it feeds at least one of those ops (found by tracing: `lowbit.api.param_uses`).

`select_params` and `first_matches` are the walks over a params tree that every rule type
shares; a selector that selects nothing raises an error naming the rule and the paths it
could have matched.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from lowbit.recipes._paths import param_leaves

# Operation names a selector can filter on. `einsum` lowers to `dot_general`, so a weight that
# feeds an einsum is seen as feeding a dot_general; the two names are interchangeable here.
OPS = ("dot_general", "einsum", "conv", "ragged_dot", "gather")

Uses = Mapping[str, Iterable[str]]


def _same_op(op: str) -> str:
    return "dot_general" if op == "einsum" else op


def check_regex(field: str, pattern: Any) -> None:
    """Raises unless `pattern` is a regex string; `field` (``"LoraRule.path"``) names it.

    Raises:
      TypeError: for a non-string.
      ValueError: for a string that does not compile, with the fix.
    """
    if not isinstance(pattern, str):
        raise TypeError(
            f"{field} must be a regex string, got {type(pattern).__name__}: {pattern!r}; "
            r"accepted: a Python regex fully matching '/'-joined parameter paths, e.g. '.*kernel'"
        )
    try:
        re.compile(pattern)
    except re.error as err:
        fix = r"escape a literal '.', '(', '[' or '*' with a backslash"
        if "*" in pattern and ".*" not in pattern:
            # The usual slip: a shell glob where a regex is expected.
            fix = f"for a glob write the regex {pattern.replace('*', '.*')!r}"
        raise ValueError(
            f"{field}: {pattern!r} is not a valid regex ({err}); accepted: a Python regex fully "
            f"matching '/'-joined parameter paths, e.g. '.*kernel' ({fix})"
        ) from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Select:
    """Which parameters a rule applies to.

    Attributes:
      path: regex fully matched (`re.fullmatch`) against the parameter path.
      exclude: optional regex; a path it fully matches is not selected.
      ops: optional filter on the ops the parameter feeds (names from `OPS`; a single name is
        accepted). Needs the `uses` of `lowbit.api.param_uses` when a path matches.
      min_ndim: parameters with fewer axes (not counting `stacked_axes`) are not selected;
        2 leaves biases and norm scales out.
      min_size: parameters with fewer elements are not selected.
      stacked_axes: leading axes that index stacked (scanned) layers.
      owner: the rule type named in error messages (``"Rule"``, ``"LoraRule"`` ...); not part
        of equality.

    Raises:
      TypeError / ValueError: naming ``owner.field``, the value and what is accepted.

    Example:
      >>> import jax.numpy as jnp
      >>> select = Select(path=r".*kernel", exclude=r".*/0/.*", min_ndim=2)
      >>> select.matches("layers/1/mlp/up/kernel", jnp.ones((4, 8)))
      True
      >>> select.matches("layers/0/mlp/up/kernel", jnp.ones((4, 8)))
      False
    """

    path: str = ".*"
    exclude: str | None = None
    ops: tuple[str, ...] | None = None
    min_ndim: int = 0
    min_size: int = 0
    stacked_axes: int = 0
    owner: str = dataclasses.field(default="Select", compare=False, repr=False)

    def __post_init__(self):
        check_regex(f"{self.owner}.path", self.path)
        if self.exclude is not None:
            check_regex(f"{self.owner}.exclude", self.exclude)
        if self.ops is not None:
            ops = (self.ops,) if isinstance(self.ops, str) else tuple(self.ops)
            bad = [op for op in ops if op not in OPS]
            if bad or not ops:
                raise ValueError(
                    f"{self.owner}.ops: {self.ops!r} has unknown op names {bad}; accepted: {OPS} "
                    "(or None for every op)"
                )
            object.__setattr__(self, "ops", ops)
        for field in ("min_size", "min_ndim", "stacked_axes"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{self.owner}.{field}: {value!r}; accepted: an int >= 0")

    @classmethod
    def of(cls, rule: Any) -> Select:
        """The selector a rule's own fields spell: those named like `Select`'s (`path`,
        `exclude`, `ops`, `min_ndim`, `min_size`, `stacked_axes`), the rest at their defaults;
        errors name the rule's type (``LoraRule.path: ...``).

        Raises:
          TypeError / ValueError: as `Select`.
        """
        names = [f.name for f in dataclasses.fields(cls) if f.name != "owner"]
        given = {name: getattr(rule, name) for name in names if hasattr(rule, name)}
        return cls(**given, owner=type(rule).__name__)

    @property
    def label(self) -> str:
        """How errors name the rule: ``LoraRule(path='.*kernel')``."""
        return f"{self.owner}(path={self.path!r})"

    def matches_path(self, path: str) -> bool:
        """True if `path` fully matches `self.path` and not `self.exclude`."""
        if re.fullmatch(self.path, path) is None:
            return False
        return self.exclude is None or re.fullmatch(self.exclude, path) is None

    def feeds(self, ops: Iterable[str]) -> bool:
        """True if a parameter feeding `ops` passes the op filter (`einsum` = `dot_general`)."""
        if self.ops is None:
            return True
        return bool({_same_op(op) for op in self.ops} & {_same_op(op) for op in ops})

    def rejects(self, path: str, leaf: Any, uses: Uses | None = None) -> str:
        """Why a parameter the path matched is not selected, or '' if it is.

        The path itself is not checked here (`matches_path` is), so a first-match-wins list of
        rules can pick its rule by path and still report why the parameter was left out.

        Args:
          path: the parameter path.
          leaf: the parameter (anything with a `shape`).
          uses: {path: ops it feeds}, needed when `ops` is set.
        Raises:
          ValueError: if `ops` is set and `uses` is None.
        """
        if not hasattr(leaf, "shape"):
            return f"not an array ({type(leaf).__name__})"
        shape = tuple(leaf.shape)
        ndim = len(shape) - self.stacked_axes
        if ndim < self.min_ndim:
            return (
                f"{ndim} axes ({self.stacked_axes} stacked not counted) < min_ndim {self.min_ndim}"
            )
        size = int(np.prod(shape))
        if size < self.min_size:
            return f"size {size} < min_size {self.min_size}"
        return self.op_rejects(path, uses)

    def op_rejects(self, path: str, uses: Uses | None) -> str:
        """Why the `ops` filter leaves the parameter at `path` out, or '' if it passes.

        Raises:
          ValueError: if `ops` is set and `uses` is None.
        """
        if self.ops is None:
            return ""
        if uses is None:
            raise ValueError(
                f"{self.label} filters on ops={self.ops}, which needs the ops each parameter "
                "feeds: pass uses=lowbit.api.param_uses(fn, params, *args)"
            )
        fed = frozenset(uses.get(path, ()))
        if self.feeds(fed):
            return ""
        return f"feeds only {', '.join(sorted(fed)) or 'no op'}; the rule has ops={self.ops}"

    def matches(self, path: str, leaf: Any, uses: Uses | None = None) -> bool:
        """True if the parameter `leaf` at `path` is selected (path, shape, size and ops).

        Raises:
          ValueError: as `rejects`.
        """
        return self.matches_path(path) and not self.rejects(path, leaf, uses)


def first_matches(
    leaves: Sequence[tuple[str, Any]], selects: Sequence[Select], uses: Uses | None = None
) -> list[int | None]:
    """For each (path, leaf), the index of the first selector that selects it, or None.

    Raises:
      ValueError: as `Select.rejects`.
    """
    found = []
    for path, leaf in leaves:
        found.append(next((i for i, s in enumerate(selects) if s.matches(path, leaf, uses)), None))
    return found


def no_match_error(
    select: Select,
    leaves: Sequence[tuple[str, Any]],
    uses: Uses | None = None,
    index: int | None = None,
) -> ValueError:
    """The error for a selector that selects no parameter: what its path matched, and why each
    was left out, or the paths it could have matched.

    Args:
      select: the selector.
      leaves: (path, leaf) pairs of the params tree.
      uses: as for `Select.rejects`.
      index: the rule's position in its list (named in the message), if any.
    """
    label = select.label if index is None else f"{select.label} (rule {index})"
    near = [(p, select.rejects(p, leaf, uses)) for p, leaf in leaves if select.matches_path(p)]
    if near:
        path, why = near[0]
        fix = "loosen that filter or widen the path"
        if not why:
            why, fix = "an earlier rule selects it (the first match wins)", "reorder the rules"
        return ValueError(
            f"{label} selects no parameter: its path matches {len(near)} parameter(s), all left "
            f"out, e.g. {path!r}: {why}; fix: {fix}"
        )
    shown = ", ".join(repr(p) for p, _ in leaves[:8]) + (" ..." if len(leaves) > 8 else "")
    return ValueError(
        f"{label} selects no parameter: its path matches no parameter path; accepted: a regex "
        f"fully matching '/'-joined paths such as {shown}"
    )


def select_params(params: Any, select: Select, uses: Uses | None = None) -> dict[str, Any]:
    """{path: leaf} for every parameter `select` selects, in flattening order.

    Args:
      params: a params pytree (dicts, lists, NNX state; `QArray`s count as leaves).
      select: the selector.
      uses: as for `Select.rejects`.
    Returns:
      The selected parameters by path.
    Raises:
      ValueError: if it selects nothing (`no_match_error`), or as `Select.rejects`.

    Example:
      >>> import jax.numpy as jnp
      >>> params = {"dense": {"kernel": jnp.ones((4, 8)), "bias": jnp.ones(8)}}
      >>> list(select_params(params, Select(min_ndim=2)))
      ['dense/kernel']
    """
    leaves = param_leaves(params)
    chosen = {p: leaf for p, leaf in leaves if select.matches(p, leaf, uses)}
    if not chosen:
        raise no_match_error(select, leaves, uses)
    return chosen
