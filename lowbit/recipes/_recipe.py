"""`Recipe`: ordered rules (first match wins), their resolution per parameter, and the report."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from lowbit._untrusted import load_json
from lowbit.formats import get_format
from lowbit.qarray import PerGroup, QuantConfig
from lowbit.recipes._json import parse_rule, rule_to_dict
from lowbit.recipes._kv_cache import KVCacheConfig, format_kv_cache, parse_kv_cache
from lowbit.recipes._paths import is_param_leaf, param_leaves
from lowbit.recipes._rotation import RotationConfig, format_rotation, parse_rotation
from lowbit.recipes._rule import Rule


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decision:
    """What a recipe does with one parameter.

    Attributes:
      path: the parameter path.
      shape: its shape.
      dtype: its dtype name.
      rule_index: index of the first matching rule, or None.
      config: the weight config to quantize with (stacked axes resolved), or None for float.
      reason: why the parameter stays in float ("" when it is quantized).
      error: True when a rule asks for quantization that cannot apply to this shape (for
        example a group size that does not divide the axis): `quantize_params` raises on it.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    rule_index: int | None
    config: QuantConfig | None
    reason: str = ""
    error: bool = False

    @property
    def quantized(self) -> bool:
        return self.config is not None


def _fits(config: QuantConfig, shape: tuple[int, ...]) -> str:
    """'' if `config` can quantize an array of `shape`, else why not."""
    try:
        config.granularity.tile(shape)
        block = get_format(config.format).block_size
        if block is not None:
            axis = config.granularity.axis if isinstance(config.granularity, PerGroup) else -1
            if shape[axis] % block:
                return (
                    f"format {get_format(config.format).name!r} needs blocks of {block} along "
                    f"axis {axis}, which has size {shape[axis]}"
                )
    except ValueError as err:
        return str(err)
    return ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """Ordered quantization rules; for each parameter the first rule whose `path` matches wins.

    Attributes:
      rules: the rules, in priority order.
      name: a label (presets use their name).
      kv_cache: how a language model's key/value cache is stored when the recipe runs it
        (`KVCacheConfig`, or its text form such as ``"int8"``); None for a float cache.
      rotate: Hadamard rotations of a decoder's float weights applied before quantizing and
        calibrating (`RotationConfig`, or its text form such as ``"hadamard"``); None for none.
      shapes: ``((path, shape), ...)`` of the model the recipe was made for (a plan chosen
        under a budget, `lowbit.api.choose_plan`), or None. When set, quantizing params whose
        parameter at such a path is missing or has another shape raises (`check_shapes`).

    Example:
      >>> from lowbit.qarray import QuantConfig, PerChannel
      >>> recipe = Recipe(rules=(
      ...     Rule(path=".*norm.*"),  # weight=None: keep in float
      ...     Rule(path=".*kernel", weight=QuantConfig(format="int8",
      ...                                               granularity=PerChannel((-1,)))),
      ... ), name="int8w")
      >>> recipe.match("layers/0/mlp/up/kernel").path
      '.*kernel'
    """

    rules: tuple[Rule, ...]
    name: str = "custom"
    kv_cache: KVCacheConfig | None = None
    rotate: RotationConfig | None = None
    shapes: tuple[tuple[str, tuple[int, ...]], ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "kv_cache", parse_kv_cache(self.kv_cache, "Recipe.kv_cache"))
        object.__setattr__(self, "rotate", parse_rotation(self.rotate, "Recipe.rotate"))
        if self.shapes is not None:
            shapes = tuple(
                (str(p), tuple(int(d) for d in shape))
                for p, shape in (
                    self.shapes.items() if isinstance(self.shapes, Mapping) else self.shapes
                )
            )
            object.__setattr__(self, "shapes", shapes)
        rules = (self.rules,) if isinstance(self.rules, Rule) else tuple(self.rules)
        for i, rule in enumerate(rules):
            if not isinstance(rule, Rule):
                raise TypeError(f"Recipe.rules[{i}] must be a Rule, got {type(rule).__name__}")
        object.__setattr__(self, "rules", rules)
        if not isinstance(self.name, str):
            raise TypeError(f"Recipe.name must be a str, got {self.name!r}")

    def match_index(self, path: str) -> int | None:
        """Index of the first rule matching `path`, or None."""
        for i, rule in enumerate(self.rules):
            if rule.matches(path):
                return i
        return None

    def match(self, path: str) -> Rule | None:
        """The first rule matching `path` (shape filters not applied), or None."""
        i = self.match_index(path)
        return None if i is None else self.rules[i]

    def decide(
        self, path: str, leaf: Any, uses: Mapping[str, frozenset[str]] | None = None
    ) -> Decision:
        """Resolves what happens to one parameter.

        Args:
          path: the parameter path.
          leaf: the parameter (array, QArray, or anything with shape and dtype).
          uses: ops each parameter feeds (`lowbit.api.param_uses`), needed when the matching
            rule has an `ops` filter.
        Returns:
          A `Decision`.
        Raises:
          ValueError: if the matching rule filters on ops and `uses` was not given.
        """
        shape = tuple(getattr(leaf, "shape", ()))
        dtype = getattr(leaf, "dtype", None)
        base = dict(path=path, shape=shape, dtype=str(dtype))
        index = self.match_index(path)
        if index is None:
            return Decision(**base, rule_index=None, config=None, reason="no rule matches")
        rule = self.rules[index]
        keep = dict(**base, rule_index=index, config=None)
        if is_param_leaf(leaf):
            return Decision(**keep, reason="already quantized")
        if not hasattr(leaf, "shape") or not jnp.issubdtype(dtype, jnp.floating):
            return Decision(**keep, reason=f"not a floating-point array (dtype {dtype})")
        if rule.weight is None:
            return Decision(**keep, reason=f"rule {index} keeps it in float (weight=None)")
        reason = rule.select.rejects(path, leaf, uses)
        if reason:
            return Decision(**keep, reason=reason)
        config = rule.weight_config(len(shape))
        problem = _fits(config, shape)
        if problem:
            return Decision(**keep, reason=f"rule {index}: {problem}", error=True)
        return Decision(**base, rule_index=index, config=config)

    def report(self, params: Any, uses: Mapping[str, frozenset[str]] | None = None) -> RecipeReport:
        """Lists every parameter with its rule, the ones kept in float and why, and the rules
        that matched nothing.

        Args:
          params: a params pytree (dicts, lists, NNX state, ...).
          uses: as in `decide`.
        Returns:
          A `RecipeReport`.
        """
        decisions = tuple(self.decide(path, leaf, uses) for path, leaf in param_leaves(params))
        used = {d.rule_index for d in decisions if d.rule_index is not None}
        unused = tuple(i for i in range(len(self.rules)) if i not in used)
        return RecipeReport(recipe=self, decisions=decisions, unused_rules=unused)

    def check_shapes(self, params: Any) -> None:
        """Checks that `params` are the model this recipe's `shapes` were recorded for.

        Raises:
          ValueError: naming the first parameter that is missing or has another shape.
        """
        if self.shapes is None:
            return
        have = {path: tuple(getattr(leaf, "shape", ())) for path, leaf in param_leaves(params)}
        for path, shape in self.shapes:
            if path not in have:
                raise ValueError(
                    f"recipe {self.name!r} was made for another model: it names parameter "
                    f"{path!r} {shape}, which this model does not have (it has e.g. "
                    f"{next(iter(have), None)!r}); choose a plan for this model"
                )
            if have[path] != shape:
                raise ValueError(
                    f"recipe {self.name!r} was made for another model: parameter {path!r} has "
                    f"shape {have[path]} here, {shape} in the recipe; choose a plan for this "
                    "model"
                )

    def to_json(self) -> str:
        """JSON text that `Recipe.from_json` reads back to an equal recipe."""
        data: dict[str, Any] = {"name": self.name, "rules": [rule_to_dict(r) for r in self.rules]}
        if self.kv_cache is not None:
            data["kv_cache"] = format_kv_cache(self.kv_cache)
        if self.rotate is not None:
            data["rotate"] = format_rotation(self.rotate)
        if self.shapes is not None:
            data["shapes"] = {path: list(shape) for path, shape in self.shapes}
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str | Mapping[str, Any]) -> Recipe:
        """Parses `to_json` output (or the equivalent dict ``{"name": ..., "rules": [...]}``).

        Raises:
          ValueError: naming the field, the value and what is accepted; also for text that is
            not JSON, nests deeper than Python's parser goes, or names a key twice.
        """
        if isinstance(text, str | bytes):
            data = load_json(text, "recipe JSON")
        else:
            data = text
        if not isinstance(data, Mapping) or not isinstance(data.get("rules"), list):
            raise ValueError('recipe JSON must be an object {"name": str, "rules": [rule, ...]}')
        keys = ["name", "rules", "kv_cache", "rotate", "shapes"]
        unknown = sorted(set(data) - set(keys))
        if unknown:
            raise ValueError(f"Recipe: unknown keys {unknown}; accepted: {keys}")
        rules = tuple(parse_rule(r, f"Recipe.rules[{i}]") for i, r in enumerate(data["rules"]))
        name = data.get("name", "custom")
        if not isinstance(name, str):
            raise ValueError(f"Recipe.name: {name!r}; accepted: a string")
        kv_cache = parse_kv_cache(data.get("kv_cache"), "Recipe.kv_cache")
        rotate = parse_rotation(data.get("rotate"), "Recipe.rotate")
        return cls(
            rules=rules, name=name, kv_cache=kv_cache, rotate=rotate, shapes=_parse_shapes(data)
        )


def _parse_shapes(data: Mapping[str, Any]) -> tuple | None:
    shapes = data.get("shapes")
    if shapes is None:
        return None
    ok = isinstance(shapes, Mapping) and all(
        isinstance(v, list) and all(isinstance(d, int) and d >= 0 for d in v)
        for v in shapes.values()
    )
    if not ok:
        raise ValueError(
            f"Recipe.shapes: {shapes!r}; accepted: an object {{parameter path: [dim, ...]}}"
        )
    return tuple((str(p), tuple(v)) for p, v in shapes.items())


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecipeReport:
    """Per-parameter decisions of a recipe and the rules that matched nothing."""

    recipe: Recipe
    decisions: tuple[Decision, ...]
    unused_rules: tuple[int, ...]

    @property
    def quantized(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if d.quantized)

    @property
    def kept_float(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if not d.quantized)

    @property
    def errors(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if d.error)

    def __getitem__(self, path: str) -> Decision:
        for d in self.decisions:
            if d.path == path:
                return d
        raise KeyError(f"no parameter at path {path!r}")

    def __str__(self) -> str:
        lines = [
            f"recipe {self.recipe.name!r}: {len(self.quantized)} quantized, "
            f"{len(self.kept_float)} float"
        ]
        for d in self.decisions:
            rule = "-" if d.rule_index is None else str(d.rule_index)
            what = _describe(d.config) if d.quantized else f"float: {d.reason}"
            lines.append(f"  {d.path:<40} {str(d.shape):<16} rule {rule:<3} {what}")
        for i in self.unused_rules:
            lines.append(f"  rule {i} (path={self.recipe.rules[i].path!r}) matched nothing")
        return "\n".join(lines)


def _describe(config: QuantConfig) -> str:
    fmt = get_format(config.format).name
    kind = "sym" if config.symmetric else "asym"
    return f"{fmt} {type(config.granularity).__name__} {kind}"
