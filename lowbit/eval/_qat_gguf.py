"""QAT of a decoder onto a llama.cpp mix's exact grids, distilled from the float model.

`qat_gguf(model, tokens, target, settings)` trains the model the GGUF file of `target` (a
llama.cpp mix such as ``Q2_K`` / ``Q3_K_M``, or one GGML type for every weight) will hold:

  1. **Types.** Each weight gets the type llama.cpp's quantizer gives it in that mix
     (`lowbit.io.planned_types`, with llama.cpp's fallbacks for rows that are not whole
     blocks); the recipe holds those types as lowbit formats (`gguf_recipe`), and every weight
     whose type has a trainable grid starts on llama.cpp's own block parameters
     (`lowbit.qat.grid_init`): step 0 is llama.cpp's PTQ.
  2. **Block by block** (EfficientQAT's Block-AP, OmniQuant): for each layer in turn, its
     weights, block parameters and norms learn to reproduce the float layer's output on the
     float layer's input, fed the output of the already trained quantized layers before it.
     The loss is the output's squared error relative to its mean square, on `windows`
     calibration windows of the text; the layer's output then feeds the next.
  3. **End to end** on the block parameters and the norms only (the weights stay): the KL
     divergence from the float model's next-token distribution to the quantized one's, on the
     same windows. No labels are needed: the float model's logits are the teacher.

Learning rates are relative: a weight or norm moves by about ``lr`` times its tensor's RMS
per step, a block parameter by about ``lr`` times its own magnitude (Adam, cosine decay).
The result's `convert` gives the served params: every trained weight is the block bytes the
training ran (`lowbit.convert` with the grids), which `lowbit.io.export_gguf` writes as they
are. A step whose loss is not finite stops the training with the phase, layer and step.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lowbit.api import convert, qat, run
from lowbit.formats import GGUFBlockFormat, get_format
from lowbit.io import check_mix, planned_types
from lowbit.recipes import Recipe, Rule, map_params, param_leaves, parse_candidate

_FLOAT = ("F32", "F16")

KL_TOKENS = 4096
"""Tokens (whole windows, at least one) that `QatGGUFResult.kl_before` / ``kl_after`` are
measured on: a report, not part of the training, so it does not run both models over every
window twice."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class QatGGUFSettings:
    """`qat_gguf`'s settings.

    Attributes:
      windows: calibration windows of `seq_len` tokens taken from the text, one after another
        (the text needs ``windows * seq_len`` tokens).
      seq_len: tokens per window.
      batch: windows per optimizer step.
      block_steps: optimizer steps per layer in the block-by-block phase (0 skips it).
      e2e_steps: optimizer steps of the end-to-end phase (0 skips it). One is a forward and
        backward pass of the whole quantized model and of the float one: on SmolLM2-135M
        about 25 times a layer's step (3.7 s against 0.14 s at 512 tokens, 2 cores).
      weight_lr: peak step of the weights, relative to each tensor's RMS.
      grid_lr: peak step of the block parameters, relative to each one's magnitude.
      norm_lr: peak step of the norms, relative to each tensor's RMS.
      seed: the window order's seed.
      e2e_weights: the weights also learn in the end-to-end phase (at `weight_lr`), not only
        the block parameters and norms.
    """

    # Long windows (the context perplexity and KL are scored at) and the whole default text:
    # on SmolLM2 Q3_K_M, 192 x 512 at batch 1 gave 0.80x the KL of 256 x 128 at batch 4, at
    # the same tokens per step (docs/training.md, "A model onto a llama.cpp mix").
    windows: int = 192
    seq_len: int = 512
    batch: int = 1
    block_steps: int = 100
    e2e_steps: int = 120
    weight_lr: float = 1e-3
    grid_lr: float = 1e-3
    norm_lr: float = 1e-3
    seed: int = 0
    e2e_weights: bool = False

    def __post_init__(self):
        for field in ("windows", "seq_len", "batch"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"QatGGUFSettings.{field}: {value!r}; accepted: an int >= 1")
        for field in ("block_steps", "e2e_steps", "seed"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"QatGGUFSettings.{field}: {value!r}; accepted: an int >= 0")
        for field in ("weight_lr", "grid_lr", "norm_lr"):
            value = getattr(self, field)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"QatGGUFSettings.{field}: {value!r}; accepted: a number >= 0")
        if self.batch > self.windows:
            raise ValueError(
                f"QatGGUFSettings.batch={self.batch} is more than windows={self.windows}; "
                "lower the batch or take more windows"
            )

    @property
    def tokens_needed(self) -> int:
        """Tokens of text the calibration windows take."""
        return self.windows * self.seq_len


@dataclasses.dataclass(frozen=True)
class QatGGUFResult:
    """What `qat_gguf` trained.

    Attributes:
      params: the trained float params (pure dict; the weights the grids quantize).
      grids: path -> trained GGML block parameters (`lowbit.qat.grid_init`'s form).
      recipe: the mix's recipe (`gguf_recipe`).
      types: param path -> GGML type (`lowbit.io.planned_types`).
      block_losses: per layer, the relative output error per step.
      e2e_losses: the KL divergence (nats per token) per end-to-end step.
      kl_before: KL divergence from the float model on the first calibration windows (up
        to `KL_TOKENS` tokens) with llama.cpp's PTQ (the untrained grids).
      kl_after: the same after training.
      kl_tokens: how many tokens `kl_before` and `kl_after` were measured on.
      seconds: wall time of the training.
    """

    params: Any
    grids: dict[str, Any]
    recipe: Recipe
    types: dict[str, str]
    block_losses: tuple[tuple[float, ...], ...]
    e2e_losses: tuple[float, ...]
    kl_before: float
    kl_after: float
    kl_tokens: int
    seconds: float

    def served(self) -> Any:
        """The served params: QArrays holding exactly the trained blocks."""
        return convert(self.params, self.recipe, grids=self.grids)


def mix_types(params: Any, config: Any, target: str) -> dict[str, str]:
    """Param path -> GGML type for `target`: a llama.cpp mix (`lowbit.io.LLAMA_MIXES`) with
    its per-tensor choices, where types that are float (F16 fallbacks) are left out.

    Raises:
      ValueError: for a name that is no llama.cpp mix, listing the accepted ones.
    """
    types = planned_types(params, config, check_mix(target))
    return {path: t for path, t in types.items() if t not in _FLOAT}


def recipe_types(recipe: Recipe, params: Any) -> dict[str, str]:
    """Param path -> GGML type of every weight `recipe` quantizes (e.g. a plan of the budget
    planner, `lowbit quantize --max-bytes N --target gguf --plan-out plan.json`).

    Raises:
      ValueError: naming a weight whose format is no GGML type, and the ones that are.
    """
    types = {}
    for decision in recipe.report(params, None).decisions:
        if not decision.quantized:
            continue
        fmt = get_format(decision.config.format)
        ggml_type = fmt.ggml_type if isinstance(fmt, GGUFBlockFormat) else None
        ggml_type = ggml_type or qat.grid_type(decision.config)
        if ggml_type is None:
            raise ValueError(
                f"the recipe quantizes {decision.path!r} to {fmt.name!r}, which is no GGML type; "
                "GGUF QAT takes GGUF formats (q2_k .. q8_0, iq4_nl) or candidates q4_0 / q4_1 / "
                "q8_0 (lowbit quantize --target gguf plans only these)"
            )
        types[decision.path] = ggml_type
    return types


def gguf_recipe(types: Mapping[str, str], params: Any, *, prefix: str = "") -> Recipe:
    """A recipe holding each param path's GGML type as its lowbit format (the candidates
    ``q4_k``, ``q4_0``, ... of `lowbit.recipes`: blocks along the contraction axis).

    Args:
      types: param path -> GGML type (`mix_types`).
      params: the params the recipe is for (their paths and ranks).
      prefix: a path prefix `params` lack (``"layers/3/"`` for one layer's params): paths of
        `types` under it are matched without it, the others ignored.
    """
    by_config: dict[Any, list[str]] = {}
    for path, leaf in param_leaves(params):
        ggml_type = types.get(prefix + path)
        if ggml_type is None:
            continue
        config = parse_candidate(ggml_type.lower()).config(prefix + path, np.ndim(leaf))
        if config is None:
            raise ValueError(
                f"parameter {prefix + path!r}: no matmul layout names it, so it cannot take "
                f"{ggml_type}; leave it out of the types"
            )
        by_config.setdefault(config, []).append(path)
    rules = tuple(
        Rule(path="|".join(re.escape(p) for p in paths), weight=config)
        for config, paths in by_config.items()
    )
    return Recipe(rules=rules)


def _relative(lr: float, steps: int, per_element: bool) -> optax.GradientTransformation:
    """Adam whose step is ``lr`` times each parameter's magnitude (`per_element`) or its
    tensor's RMS, with warm-up and cosine decay."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, max(1, steps // 10), max(steps, max(1, steps // 10) + 1)
    )
    if per_element:

        def update(updates, state, params):
            return jax.tree.map(lambda u, p: u * jnp.abs(p), updates, params), state

        magnitude = optax.GradientTransformation(lambda params: optax.EmptyState(), update)
    else:
        magnitude = optax.scale_by_param_block_rms()
    return optax.chain(
        optax.scale_by_adam(), magnitude, optax.scale_by_schedule(schedule), optax.scale(-1.0)
    )


def _optimizer(settings: QatGGUFSettings, steps: int) -> optax.GradientTransformation:
    """One optimizer over ``{"weights", "norms", "grids"}`` with each group's own rate."""
    groups = {
        "weights": _relative(settings.weight_lr, steps, per_element=False),
        "norms": _relative(settings.norm_lr, steps, per_element=False),
        "grids": _relative(settings.grid_lr, steps, per_element=True),
    }
    return optax.multi_transform(
        groups, lambda tree: {k: jax.tree.map(lambda _, k=k: k, v) for k, v in tree.items()}
    )


def _split_trainable(params: Any, recipe_types: Mapping[str, str], prefix: str) -> dict:
    """The leaves one phase trains: quantized weights and 1-D params (norms), by path."""
    weights, norms = {}, {}
    for path, leaf in param_leaves(params):
        if prefix + path in recipe_types:
            weights[path] = leaf
        elif np.ndim(leaf) == 1:
            norms[path] = leaf
    return {"weights": weights, "norms": norms}


def _assemble(params: Any, trainable: Mapping[str, Mapping[str, Any]]) -> Any:
    """`params` with the trained leaves put back."""
    found = {**trainable.get("weights", {}), **trainable.get("norms", {})}
    return map_params(lambda path, leaf: found.get(path, leaf), params)


def _first_bad(tree: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The path of the first trained leaf with a NaN or Inf, or None."""
    for group in tree.values():
        for path, leaf in group.items():
            if not all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(leaf)):
                return path
    return None


def _check_finite(loss: float, trainable: Any, where: str, step: int, prefix: str) -> None:
    if math.isfinite(loss):
        return
    bad = _first_bad(trainable)
    at = f"; first non-finite parameter: {prefix + bad}" if bad else ""
    raise FloatingPointError(
        f"QAT diverged in {where} at step {step}: loss {loss}{at}. Nothing was written; lower "
        "the learning rates (--lr) or take more calibration windows"
    )


def _kl(teacher_logits: jax.Array, student_logits: jax.Array) -> jax.Array:
    """Mean KL(teacher || student) per token (nats)."""
    p = jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1)
    q = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
    return jnp.mean(jnp.sum(jnp.exp(p) * (p - q), axis=-1))


def calibration_windows(tokens: np.ndarray, settings: QatGGUFSettings) -> np.ndarray:
    """``[windows, seq_len]`` int32 consecutive windows of `tokens`.

    Raises:
      ValueError: naming the token count needed when the text is too short.
    """
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    need = settings.tokens_needed
    if tokens.size < need:
        raise ValueError(
            f"the text has {tokens.size} tokens; the calibration needs {need} "
            f"({settings.windows} windows of {settings.seq_len} tokens): give a longer text, "
            "or fewer windows (--windows) or a shorter --seq-len"
        )
    return tokens[:need].reshape(settings.windows, settings.seq_len)


def qat_gguf(
    model: nnx.Module,
    tokens: np.ndarray,
    target: str,
    settings: QatGGUFSettings = QatGGUFSettings(),
    *,
    types: Mapping[str, str] | None = None,
    on_step: Callable[[str, int, int, float], None] | None = None,
) -> QatGGUFResult:
    """Trains `model` (a `lowbit.models.Decoder`, float) onto `target`'s GGUF grids.

    Args:
      model: the float model (its params are the teacher and the starting point).
      tokens: ``[n]`` token ids of the calibration text.
      target: a llama.cpp mix name (`lowbit.io.LLAMA_MIXES`, any case).
      settings: see `QatGGUFSettings`.
      types: param path -> GGML type, instead of the mix's (e.g. a budget plan's); `target`
        then only names the result.
      on_step: called as ``on_step(phase, done, total, loss)`` after every step, `phase`
        ``"layers/3"`` in the block phase and ``"end-to-end"`` after it.
    Returns:
      A `QatGGUFResult`; ``result.served()`` are the params to save or export.
    Raises:
      ValueError: for an unknown mix, or a text shorter than the calibration needs.
      FloatingPointError: when a step's loss is not finite (the phase, layer and step).
    """
    start = time.perf_counter()
    graphdef, state = nnx.split(model)
    float_params = state.to_pure_dict()
    config = model.config
    if types is None:
        types = mix_types(float_params, config, target)
    windows = jnp.asarray(calibration_windows(tokens, settings))
    recipe = gguf_recipe(types, float_params)
    grids = qat.grid_init(float_params, recipe)
    rng = np.random.default_rng(settings.seed)
    forward = run(lambda s, t: nnx.merge(graphdef, s)(t))
    wrap = qat.wrapper(recipe)

    @jax.jit
    def kl_of(teacher_params, params, grids, batch):
        teacher = nnx.merge(graphdef, teacher_params)(batch)
        return _kl(teacher, forward(wrap(params, grids), batch))

    shown = windows[: max(1, KL_TOKENS // settings.seq_len)]

    def mean_kl(params, grids) -> float:
        b = settings.batch
        batches = [shown[i : i + b] for i in range(0, len(shown), b)]
        return float(np.mean([float(kl_of(float_params, params, grids, x)) for x in batches]))

    kl_before = mean_kl(float_params, grids)
    params, grids, block_losses = _block_phase(
        model, float_params, grids, recipe, types, windows, settings, rng, on_step
    )
    params, grids, e2e_losses = _e2e_phase(
        graphdef, float_params, params, grids, recipe, types, windows, settings, rng, on_step
    )
    kl_after = mean_kl(params, grids)
    return QatGGUFResult(
        params=params,
        grids=grids,
        recipe=recipe,
        types=dict(types),
        block_losses=block_losses,
        e2e_losses=e2e_losses,
        kl_before=kl_before,
        kl_after=kl_after,
        kl_tokens=int(shown.shape[0] * shown.shape[1]),
        seconds=time.perf_counter() - start,
    )


def _block_phase(model, float_params, grids, recipe, types, windows, settings, rng, on_step):
    """Layer by layer: each quantized layer learns the float layer's output (module
    docstring, step 2). Returns the params and grids with every layer trained, and the
    per-layer losses."""
    config = model.config
    graphdef = nnx.graphdef(model)
    embed = jax.jit(lambda s, t: nnx.merge(graphdef, s).embed_tokens(t))
    inputs = model.layer_inputs((settings.batch, settings.seq_len))
    full_inputs = model.layer_inputs(tuple(windows.shape))
    x_float = embed(float_params, windows)
    # The embedding trains end to end; the first layer reads its PTQ output.
    embed_q = run(lambda s, t: nnx.merge(graphdef, s).embed_tokens(t))
    x_quant = jax.jit(lambda s, g, t: embed_q(qat.wrapper(recipe)(s, g), t))(
        float_params, grids, windows
    )
    params = float_params
    grids = dict(grids)
    losses = []
    programs: dict[Any, _LayerPrograms] = {}
    for i in range(config.n_layers):
        prefix = f"layers/{i}/"
        layer_params = params["layers"][i]
        layer_grids = {p[len(prefix) :]: g for p, g in grids.items() if p.startswith(prefix)}
        # Layers of one structure and the same types share their compiled programs.
        layer_def = nnx.graphdef(model.layers[i])
        own = sorted((p[len(prefix) :], t) for p, t in types.items() if p.startswith(prefix))
        key = (layer_def, tuple(own))
        if key not in programs:
            recipe_i = gguf_recipe(types, layer_params, prefix=prefix)
            programs[key] = _layer_programs(layer_def, recipe_i, settings)
        prog = programs[key]
        y_float = prog.plain(layer_params, x_float, full_inputs.of(config, i))
        trainable = {**_split_trainable(layer_params, types, prefix), "grids": layer_grids}
        layer_losses = []
        if settings.block_steps:
            trainable, layer_losses = _train(
                prog.step,
                prog.optimizer,
                trainable,
                (layer_params, inputs.of(config, i)),
                (x_quant, y_float),
                settings,
                settings.block_steps,
                rng,
                f"layers/{i}",
                prefix,
                on_step,
            )
        layer_params = _assemble(layer_params, trainable)
        params = _replace_layer(params, i, layer_params)
        grids.update({prefix + p: g for p, g in trainable["grids"].items()})
        x_quant = prog.served(layer_params, trainable["grids"], x_quant, full_inputs.of(config, i))
        x_float = y_float
        losses.append(tuple(layer_losses))
    return params, grids, tuple(losses)


@dataclasses.dataclass(frozen=True)
class _LayerPrograms:
    """One layer structure's compiled programs: the float layer, the quantized layer, and a
    training step (`_make_step`) with its optimizer."""

    plain: Callable[..., jax.Array]
    served: Callable[..., jax.Array]
    step: Callable[..., Any]
    optimizer: optax.GradientTransformation


def _layer_programs(layer_def: Any, recipe: Recipe, settings: QatGGUFSettings) -> _LayerPrograms:
    wrap = qat.wrapper(recipe)
    call = lambda s, x, view: nnx.merge(layer_def, s)(x, view, None)[0]  # noqa: E731
    layer = run(call)

    def loss_fn(trainable, frozen, x, target):
        layer_params, view = frozen
        y = layer(wrap(_assemble(layer_params, trainable), trainable["grids"]), x, view)
        return jnp.mean((y - target) ** 2) / jnp.mean(target**2)

    optimizer = _optimizer(settings, settings.block_steps)
    return _LayerPrograms(
        plain=jax.jit(call),
        served=jax.jit(lambda s, g, x, view: layer(wrap(s, g), x, view)),
        step=_make_step(loss_fn, optimizer),
        optimizer=optimizer,
    )


def _replace_layer(params: Any, i: int, layer_params: Any) -> Any:
    layers = dict(params["layers"])
    layers[i] = layer_params
    return {**params, "layers": layers}


def _e2e_phase(graphdef, float_params, params, grids, recipe, types, windows, settings, rng, on):
    """Block parameters and norms (and with `e2e_weights` the weights), on the KL divergence
    from the float model (step 3)."""
    if not settings.e2e_steps:
        return params, grids, ()
    forward = run(lambda s, t: nnx.merge(graphdef, s)(t))
    teacher = lambda s, t: nnx.merge(graphdef, s)(t)  # noqa: E731
    wrap = qat.wrapper(recipe)

    def loss_fn(trainable, frozen, batch, _):
        params, teacher_params = frozen
        logits = forward(wrap(_assemble(params, trainable), trainable["grids"]), batch)
        return _kl(jax.lax.stop_gradient(teacher(teacher_params, batch)), logits)

    split = _split_trainable(params, types, "")
    if not settings.e2e_weights:
        split = {"norms": split["norms"]}
    trainable = {**split, "grids": dict(grids)}
    optimizer = _optimizer(settings, settings.e2e_steps)
    trainable, losses = _train(
        _make_step(loss_fn, optimizer),
        optimizer,
        trainable,
        (params, float_params),
        (windows, windows),
        settings,
        settings.e2e_steps,
        rng,
        "end-to-end",
        "",
        on,
    )
    return _assemble(params, trainable), trainable["grids"], tuple(losses)


def _make_step(loss_fn: Callable[..., jax.Array], optimizer: Any) -> Callable[..., Any]:
    """A jitted ``step(trainable, opt_state, frozen, x, target) -> (trainable, opt_state,
    loss)`` of `optimizer` on `loss_fn(trainable, frozen, x, target)`."""

    @jax.jit
    def step(trainable, opt_state, frozen, x, target):
        loss, grads = jax.value_and_grad(loss_fn)(trainable, frozen, x, target)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss

    return step


def _train(step, optimizer, trainable, frozen, data, settings, steps, rng, where, prefix, on_step):
    """`steps` of `step` (`_make_step`) on random batches of the windows `data` = (inputs,
    targets); stops on a non-finite loss or parameter."""
    groups = {"weights": {}, "norms": {}, "grids": {}}
    groups.update(trainable)
    trainable = groups
    opt_state = optimizer.init(trainable)
    inputs, targets = data
    losses = []
    for s in range(steps):
        pick = jnp.asarray(rng.choice(len(inputs), settings.batch, replace=False))
        new, new_state, loss = step(trainable, opt_state, frozen, inputs[pick], targets[pick])
        loss = float(loss)
        _check_finite(loss, new, where, s + 1, prefix)
        trainable, opt_state = new, new_state
        losses.append(loss)
        if on_step is not None:
            on_step(where, s + 1, steps, loss)
    bad = _first_bad(trainable)
    if bad is not None:
        raise FloatingPointError(
            f"QAT diverged in {where} at step {steps}: {prefix + bad} is not finite. Nothing "
            "was written; lower the learning rates (--lr)"
        )
    return trainable, losses
