"""LoRA and QLoRA: low-rank adapters over frozen float or quantized weights.

Rules (`LoraRule`) select weights by path; `lora_init` makes the trainable adapters, a plain
dict ``{path: {"a": [*in, rank], "b": [rank, *out]}}`` (plus ``{path: {"value": ...}}`` for
float parameters trained in full, e.g. norms, when `LoraConfig.train` selects them) that optax
updates like any params tree. Inside the loss, `lora_apply` puts a `lowbit.ops.LoraWeight` at
each adapted path; the engine (`lowbit.run`) then computes ``x @ W + (x @ a) @ b * alpha/rank``
with the base product on the packed weight (quantized kernels for a `QArray`) and the low-rank
product in float, and gradients reach only the adapters:

    config = LoraConfig(rules=(LoraRule(path=r".*proj/kernel", rank=8),))
    adapters = lora_init(params, config, jax.random.key(0))      # params may hold QArrays

    def loss(adapters, params, x, y):
        logits = lowbit.run(apply)(lora_apply(params, adapters, config), x)
        return cross_entropy(logits, y)

    grads = jax.grad(loss)(adapters, params, x, y)              # same pytree as adapters

`lora_merge` folds the adapters into float weights (and requantizes them with a recipe).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from lowbit.api._quantize import quantize_params
from lowbit.ops import LoraWeight
from lowbit.ops import lora_init as init_factors
from lowbit.qarray import QArray
from lowbit.recipes import (
    Recipe,
    Select,
    check_regex,
    first_matches,
    map_params,
    no_match_error,
    param_leaves,
)

Adapters = dict[str, dict[str, jax.Array]]


def _axes(field: str, value: Any) -> tuple[int, ...]:
    axes = (value,) if isinstance(value, int) else tuple(value)
    if not axes or not all(isinstance(a, int) and not isinstance(a, bool) for a in axes):
        raise ValueError(f"LoraRule.{field}: {value!r}; accepted: a non-empty tuple of ints")
    return axes


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraRule:
    """Which weights get an adapter, and its shape.

    Attributes:
      path: regex fully matched against the parameter path (``layers/0/attn/q_proj/kernel``).
      exclude: optional regex; paths it fully matches are skipped.
      rank: adapter rank r, 1 <= r < min(in, out).
      alpha: the low-rank product is scaled by ``alpha / rank``.
      dropout: probability of dropping an input feature of the low-rank path while training.
      ops: optional filter on the ops the weight feeds (names from `lowbit.recipes.OPS`); needs
        the `uses` of `lowbit.api.param_uses`.
      in_axes: the weight's axes its matmul contracts (``(-2,)`` for ``[..., in, out]`` kernels).
      out_axes: the weight's output axes; all other axes are stacked-layer axes.
      min_ndim: parameters with fewer axes are skipped: an adapter needs an in and an out
        axis, so biases and norm scales a broad `path` matches stay as they are.
      select: the `lowbit.recipes.Select` built from `path`, `exclude`, `ops` and `min_ndim`
        (not an argument): how every rule type picks its parameters.

    Raises:
      TypeError / ValueError: naming the field, the value and what is accepted.
    """

    path: str = ".*"
    exclude: str | None = None
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    ops: tuple[str, ...] | None = None
    in_axes: tuple[int, ...] = (-2,)
    out_axes: tuple[int, ...] = (-1,)
    min_ndim: int = 2
    select: Select = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "select", Select.of(self))
        object.__setattr__(self, "ops", self.select.ops)
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"LoraRule.rank: {self.rank!r}; accepted: an int >= 1")
        if not isinstance(self.alpha, int | float) or not self.alpha > 0:
            raise ValueError(f"LoraRule.alpha: {self.alpha!r}; accepted: a number > 0")
        if not isinstance(self.dropout, int | float) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraRule.dropout: {self.dropout!r}; accepted: 0 <= dropout < 1")
        object.__setattr__(self, "in_axes", _axes("in_axes", self.in_axes))
        object.__setattr__(self, "out_axes", _axes("out_axes", self.out_axes))
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "dropout", float(self.dropout))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def matches(self, path: str, uses: Mapping[str, frozenset[str]] | None) -> bool:
        """True if `path` matches and, with an `ops` filter, the weight feeds one of them.

        Raises:
          ValueError: if the rule filters on ops and `uses` is None.
        """
        return self.select.matches_path(path) and not self.select.op_rejects(path, uses)

    def resolved_axes(self, path: str, shape: tuple[int, ...]) -> tuple[tuple, tuple]:
        """(in_axes, out_axes) as sorted non-negative axes of a weight of `shape`.

        Raises:
          ValueError: for axes out of range or overlapping, or a rank the shape cannot take.
        """
        ndim = len(shape)
        resolved = []
        for field in ("in_axes", "out_axes"):
            axes = getattr(self, field)
            if any(not -ndim <= a < ndim for a in axes):
                raise ValueError(
                    f"LoraRule.{field}={axes} does not fit {path!r} of shape {shape}; accepted: "
                    f"axes in [-{ndim}, {ndim})"
                )
            resolved.append(tuple(sorted(a % ndim for a in axes)))
        in_axes, out_axes = resolved
        if set(in_axes) & set(out_axes) or len(set(in_axes)) < len(in_axes):
            raise ValueError(
                f"LoraRule in_axes={self.in_axes} and out_axes={self.out_axes} overlap for "
                f"{path!r} of shape {shape}"
            )
        n_in = math.prod(shape[a] for a in in_axes)
        n_out = math.prod(shape[a] for a in out_axes)
        if self.rank >= min(n_in, n_out):
            raise ValueError(
                f"LoraRule(path={self.path!r}).rank={self.rank} is not below min(in, out) = "
                f"min({n_in}, {n_out}) for {path!r} of shape {shape}; accepted: 1 <= rank < "
                f"{min(n_in, n_out)}"
            )
        return in_axes, out_axes

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        for field in ("ops", "in_axes", "out_axes"):
            if out[field] is not None:
                out[field] = list(out[field])
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """Adapter rules (first match wins) and which other float params train in full.

    Attributes:
      rules: `LoraRule`s; each must match at least one weight.
      train: optional regex of float parameters trained in full (e.g. ``".*norm.*"``).
      train_select: the `lowbit.recipes.Select` built from `train` (not an argument).
    """

    rules: tuple[LoraRule, ...]
    train: str | None = None
    train_select: Select | None = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        rules = (self.rules,) if isinstance(self.rules, LoraRule) else tuple(self.rules)
        if not rules or not all(isinstance(r, LoraRule) for r in rules):
            raise ValueError(f"LoraConfig.rules: {self.rules!r}; accepted: one or more LoraRule")
        object.__setattr__(self, "rules", rules)
        select = None
        if self.train is not None:
            check_regex("LoraConfig.train", self.train)
            select = Select(path=self.train, owner="LoraConfig.train")
        object.__setattr__(self, "train_select", select)

    def to_json(self) -> str:
        return json.dumps({"rules": [r.to_dict() for r in self.rules], "train": self.train})

    @classmethod
    def from_json(cls, text: str | Mapping[str, Any]) -> LoraConfig:
        data = json.loads(text) if isinstance(text, str) else dict(text)
        try:
            rules = []
            for r in data["rules"]:
                r = dict(r)
                for field in ("ops", "in_axes", "out_axes"):
                    if r.get(field) is not None:
                        r[field] = tuple(r[field])
                rules.append(LoraRule(**r))
            return cls(rules=tuple(rules), train=data.get("train"))
        except (KeyError, TypeError) as err:
            raise ValueError(f"LoRA config JSON is malformed: {err}") from None


def as_lora_config(config: LoraConfig | LoraRule | Any) -> LoraConfig:
    if isinstance(config, LoraConfig):
        return config
    if isinstance(config, LoraRule):
        return LoraConfig(rules=(config,))
    if isinstance(config, tuple | list):
        return LoraConfig(rules=tuple(config))
    raise TypeError(
        f"expected a LoraConfig, a LoraRule or a list of LoraRules, got {type(config).__name__}"
    )


@dataclasses.dataclass(frozen=True)
class _Plan:
    rule: LoraRule
    in_axes: tuple[int, ...]
    out_axes: tuple[int, ...]


def lora_plan(
    params: Any, config: LoraConfig, uses: Mapping[str, frozenset[str]] | None = None
) -> tuple[dict[str, _Plan], list[str]]:
    """Which weights get adapters ({path: plan}) and which float params train in full.

    Raises:
      ValueError: for a rule that matches no weight (listing some paths), or a rank or axes a
        weight cannot take.
    """
    plans: dict[str, _Plan] = {}
    full: list[str] = []
    leaves = param_leaves(params)
    found = first_matches(leaves, [rule.select for rule in config.rules], uses)
    for (path, leaf), index in zip(leaves, found, strict=True):
        if index is not None:
            rule = config.rules[index]
            plans[path] = _Plan(rule, *rule.resolved_axes(path, tuple(leaf.shape)))
        elif config.train_select is not None and config.train_select.matches(path, leaf):
            if isinstance(leaf, QArray):
                raise ValueError(
                    f"LoraConfig.train={config.train!r} selects {path!r}, which is quantized; "
                    "only float parameters train in full (adapt it with a LoraRule instead)"
                )
            full.append(path)
    for i, rule in enumerate(config.rules):
        if i not in found:
            raise no_match_error(rule.select, leaves, uses, index=i)
    return plans, full


def lora_init(
    params: Any,
    config: LoraConfig | LoraRule,
    key: jax.Array,
    *,
    uses: Mapping[str, frozenset[str]] | None = None,
    dtype: Any = jnp.float32,
) -> Adapters:
    """`lowbit.lora_init`: fresh adapters for the weights the rules select.

    Args:
      params: the base params (float arrays and/or `QArray`s; NNX state or dicts).
      config: a `LoraConfig` (or one `LoraRule`).
      key: PRNG key for the ``a`` factors (``b`` starts at zero, so the model is unchanged).
      uses: ops each parameter feeds, for rules with an `ops` filter.
      dtype: adapter dtype.
    Returns:
      ``{path: {"a": [*batch, *in, rank], "b": [*batch, rank, *out]}}`` and
      ``{path: {"value": param}}`` for the float params `config.train` selects.
    Raises:
      ValueError: as `lora_plan`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> params = {"dense": {"kernel": jnp.ones((16, 8))}}
      >>> adapters = lora_init(params, LoraRule(rank=2), jax.random.key(0))
      >>> adapters["dense/kernel"]["a"].shape, adapters["dense/kernel"]["b"].shape
      ((16, 2), (2, 8))
    """
    config = as_lora_config(config)
    plans, full = lora_plan(params, config, uses)
    leaves = dict(param_leaves(params))
    adapters: Adapters = {}
    for i, (path, plan) in enumerate(sorted(plans.items())):
        a, b = init_factors(
            jax.random.fold_in(key, i),
            leaves[path],
            rank=plan.rule.rank,
            in_axes=plan.in_axes,
            out_axes=plan.out_axes,
            dtype=dtype,
        )
        adapters[path] = {"a": a, "b": b}
    for path in full:
        adapters[path] = {"value": jnp.asarray(leaves[path])}
    return adapters


def lora_apply(
    params: Any,
    adapters: Adapters,
    config: LoraConfig | LoraRule,
    *,
    key: jax.Array | None = None,
    uses: Mapping[str, frozenset[str]] | None = None,
) -> Any:
    """`lowbit.lora_apply`: the params with a `LoraWeight` at every adapted path.

    Traceable (call it inside the loss, so gradients reach `adapters`); run the model on the
    result with `lowbit.run`.

    Args:
      params: the base params the adapters were made for.
      adapters: from `lora_init` (or `load_adapters`).
      config: the config the adapters were made with.
      key: PRNG key for adapter dropout (None: no dropout, e.g. at evaluation).
      uses: as for `lora_init`.
    Returns:
      The params pytree with `LoraWeight` leaves (and trained values for fully trained params).
    Raises:
      ValueError: if an adapter's path or shape does not fit `params`.
    """
    config = as_lora_config(config)
    plans, full = lora_plan(params, config, uses)
    check_adapters(params, adapters, config, plans=plans, full=full)
    order = {path: i for i, path in enumerate(sorted(plans))}

    def one(path: str, leaf: Any) -> Any:
        if path in plans:
            plan = plans[path]
            entry = adapters[path]
            return LoraWeight(
                base=leaf,
                a=entry["a"],
                b=entry["b"],
                key=None if key is None else jax.random.fold_in(key, order[path]),
                in_axes=plan.in_axes,
                out_axes=plan.out_axes,
                scale=plan.rule.scale,
                dropout=plan.rule.dropout if key is not None else 0.0,
            )
        if path in adapters:
            return adapters[path]["value"]
        return leaf

    return map_params(one, params)


def check_adapters(
    params: Any,
    adapters: Mapping[str, Mapping[str, Any]],
    config: LoraConfig,
    *,
    plans: dict[str, _Plan] | None = None,
    full: list[str] | None = None,
    where: str = "adapters",
) -> None:
    """Checks adapters against base params and config: same paths, fitting shapes.

    Raises:
      ValueError: naming the path, the expected and the received shape.
    """
    if plans is None:
        plans, full = lora_plan(params, config)
    leaves = dict(param_leaves(params))
    expected = set(plans) | set(full or ())
    extra = sorted(set(adapters) - expected)
    missing = sorted(expected - set(adapters))
    if extra or missing:
        raise ValueError(
            f"{where} do not fit these params and LoRA rules: "
            + (f"adapters for {extra[:4]} match no adapted parameter; " if extra else "")
            + (f"no adapters for {missing[:4]}; " if missing else "")
            + "they were made for another model or config"
        )
    for path, plan in plans.items():
        shape = tuple(leaves[path].shape)
        batch = tuple(i for i in range(len(shape)) if i not in plan.in_axes + plan.out_axes)
        want = {
            "a": (*[shape[i] for i in batch], *[shape[i] for i in plan.in_axes], plan.rule.rank),
            "b": (*[shape[i] for i in batch], plan.rule.rank, *[shape[i] for i in plan.out_axes]),
        }
        entry = adapters[path]
        if set(entry) != {"a", "b"}:
            raise ValueError(f"{where}[{path!r}] has keys {sorted(entry)}; expected ['a', 'b']")
        for name, shape_ in want.items():
            got = tuple(entry[name].shape)
            if got != tuple(shape_):
                raise ValueError(
                    f"{where}[{path!r}][{name!r}] has shape {got}, but the weight {shape} with "
                    f"rank {plan.rule.rank} needs {tuple(shape_)}: the adapters were made for "
                    "another model or rank"
                )
    for path in full or ():
        got = tuple(adapters[path].get("value", jnp.zeros(())).shape)
        if got != tuple(leaves[path].shape):
            raise ValueError(
                f"{where}[{path!r}]['value'] has shape {got}, expected {tuple(leaves[path].shape)}"
            )


def lora_merge(
    params: Any,
    adapters: Adapters,
    config: LoraConfig | LoraRule,
    *,
    recipe: Recipe | str | None = None,
    **quantize_options: Any,
) -> Any:
    """`lowbit.lora_merge`: folds adapters into the weights (``W + a @ b * alpha / rank``).

    Args:
      params: the base params (adapted `QArray`s are dequantized, then the product added).
      adapters, config: as for `lora_apply`.
      recipe: if given, requantize the merged params with it (`quantize_params`).
      **quantize_options: passed to `quantize_params`.
    Returns:
      Float params (adapted weights merged), or the requantized params with `recipe`.
    """
    config = as_lora_config(config)
    applied = lora_apply(params, adapters, config)
    merged = jax.tree_util.tree_map(
        lambda x: x.dequantize() if isinstance(x, LoraWeight) else x,
        applied,
        is_leaf=lambda x: isinstance(x, LoraWeight | QArray),
    )
    if recipe is None:
        return merged
    return quantize_params(merged, recipe, **quantize_options)


def lora_param_count(adapters: Adapters) -> int:
    """Number of trainable parameters in `adapters`."""
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(adapters))
