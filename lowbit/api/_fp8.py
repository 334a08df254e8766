"""fp8 training with delayed scaling: recipes, the state collection, and the train-step pattern.

`Fp8Recipe` selects weights by path (like `Rule`) and says how their matmuls scale
(`lowbit.ops.Fp8Scaling`). `fp8_init` builds the state collection ``{path: Fp8State}`` (amax
histories for weight, activation and gradient); inside the loss, `fp8_apply` wraps each
selected weight as an `Fp8Weight` with its state, and the model runs through `lowbit.run`.
The gradient with respect to the state *is* the next state:

    recipe = fp8_recipe("fp8_delayed")
    state = fp8_init(params, recipe)

    def loss(params, state, x, y):
        return cross_entropy(lowbit.run(apply)(fp8_apply(params, state, recipe), x), y)

    (value, (grads, state)) = jax.value_and_grad(loss, argnums=(0, 1))(params, state, x, y)
    params = optax.apply_updates(params, opt.update(grads, opt_state, params)[0])

The state is a plain pytree of arrays: it goes through `jit`, `scan` and `save_checkpoint`.

Presets: ``"fp8_delayed"`` (e4m3 forward, e5m2 gradients, delayed scaling everywhere, history
16, per-tensor) and ``"fp8_deepseek"`` (the DeepSeek-V3 fine-tuning recipe: static weight and
activation scales — set by the first step, then frozen —, dynamic gradient scales, weights
scaled per output channel).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lowbit.ops import Fp8Scaling, Fp8State, Fp8Weight
from lowbit.ops import fp8_init_state as init_state
from lowbit.recipes import Select, map_params, param_leaves, select_params


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8Recipe:
    """Which weights train through fp8 matmuls, and how they are scaled.

    Attributes:
      name: label.
      path: regex fully matched against parameter paths.
      exclude: optional regex of paths to leave in float.
      scaling: the `Fp8Scaling`.
      min_ndim: parameters with fewer axes (biases, norm scales) stay float.
      stacked_axes: leading axes indexing stacked layers (each layer gets its own histories).
      select: the `lowbit.recipes.Select` built from `path`, `exclude`, `min_ndim` and
        `stacked_axes` (not an argument): how every rule type picks its parameters.

    Raises:
      TypeError / ValueError: naming the field, the value and what is accepted.
    """

    name: str = "fp8_delayed"
    path: str = r".*kernel"
    exclude: str | None = None
    scaling: Fp8Scaling = Fp8Scaling()
    min_ndim: int = 2
    stacked_axes: int = 0
    select: Select = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "select", Select.of(self))
        if not isinstance(self.scaling, Fp8Scaling):
            raise TypeError(f"Fp8Recipe.scaling must be an Fp8Scaling, got {self.scaling!r}")

    def selects(self, path: str, leaf: Any) -> bool:
        """True if the parameter `leaf` at `path` trains through fp8 matmuls."""
        return self.select.matches(path, leaf)


FP8_PRESETS = {
    "fp8_delayed": Fp8Recipe(name="fp8_delayed"),
    "fp8_deepseek": Fp8Recipe(
        name="fp8_deepseek",
        scaling=Fp8Scaling(
            history_length=1,
            weight_mode="static",
            activation_mode="static",
            gradient_mode="dynamic",
            weight_axes="channel",
        ),
    ),
}


def fp8_recipe(name: str, **overrides: Any) -> Fp8Recipe:
    """An fp8 training preset by name, with `Fp8Recipe` fields or `Fp8Scaling` fields changed.

    Raises:
      ValueError: for an unknown name (listing the accepted ones) or field.
    """
    if name not in FP8_PRESETS:
        raise ValueError(f"fp8 recipe {name!r} is unknown; accepted: {', '.join(FP8_PRESETS)}")
    recipe = FP8_PRESETS[name]
    scaling_fields = {f.name for f in dataclasses.fields(Fp8Scaling)}
    recipe_fields = {f.name for f in dataclasses.fields(Fp8Recipe) if f.init}
    unknown = set(overrides) - scaling_fields - recipe_fields
    if unknown:
        raise ValueError(
            f"fp8_recipe({name!r}): unknown fields {sorted(unknown)}; accepted: "
            f"{sorted(scaling_fields | recipe_fields)}"
        )
    scaling = dataclasses.replace(
        recipe.scaling, **{k: v for k, v in overrides.items() if k in scaling_fields}
    )
    rest = {k: v for k, v in overrides.items() if k in recipe_fields}
    return dataclasses.replace(recipe, scaling=scaling, **rest)


def _as_recipe(recipe: Fp8Recipe | str) -> Fp8Recipe:
    return fp8_recipe(recipe) if isinstance(recipe, str) else recipe


def fp8_init(params: Any, recipe: Fp8Recipe | str) -> dict[str, Fp8State]:
    """`lowbit.fp8_init`: empty amax histories for every weight the recipe selects.

    Returns:
      ``{path: {"weight", "activation", "gradient"}}`` amax histories (zeros).
    Raises:
      ValueError: if the recipe selects no parameter.
    """
    recipe = _as_recipe(recipe)
    return {
        path: init_state(tuple(leaf.shape), recipe.scaling, recipe.stacked_axes)
        for path, leaf in select_params(params, recipe.select).items()
    }


def fp8_apply(params: Any, state: dict[str, Fp8State], recipe: Fp8Recipe | str) -> Any:
    """`lowbit.fp8_apply`: the params with an `Fp8Weight` (value + state) at each selected path.

    Raises:
      ValueError: if `state` does not fit the params (another model or recipe).
    """
    recipe = _as_recipe(recipe)

    def one(path: str, leaf: Any) -> Any:
        if path not in state:
            return leaf
        return Fp8Weight(value=leaf, state=state[path], scaling=recipe.scaling)

    selected = {p for p, leaf in param_leaves(params) if recipe.select.matches(p, leaf)}
    if selected != set(state):
        raise ValueError(
            f"the fp8 state has paths {sorted(set(state) - selected)[:4]} the params lack and "
            f"lacks {sorted(selected - set(state))[:4]}: it was made for another model or recipe"
        )
    return map_params(one, params)
