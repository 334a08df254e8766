"""KL-divergence and top-token agreement of a model to a base model, token by token.

For each scored position the two models' next-token distributions are compared:

    KLD(base || model) = sum_v p_base(v) * (log p_base(v) - log p_model(v))     (nats)
    same top token     = argmax_v logits_base(v) == argmax_v logits_model(v)

computed in float32 from log-softmax, so that large or ``-inf`` logits never produce NaN (a
``-inf`` logit is a probability of exactly 0: its term is 0 where the base gives it no
probability, and the KLD is ``+inf`` where the base does but the model does not).

`divergence` streams both models over the windows of `perplexity` (the same windows, the same
scored positions) and keeps one window of logits of each at a time, plus a few numbers per
scored token (its KLD, agreement and position); never the logits of the whole text.

Confidence intervals are 95% normal intervals of a mean over tokens: ``mean ± 1.96 * s /
sqrt(n)``, with ``s`` the sample standard deviation (``ddof=1``) and ``n`` the scored tokens.
``s / sqrt(n)`` is the "±" that llama.cpp's ``llama-perplexity --kl-divergence`` prints (one
standard error), so these half-widths are 1.96 times its. Tokens of one text are not independent,
so the intervals are narrower than a resampling of texts would give.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.eval._perplexity import LogitsFn, PerplexityResult, perplexity, token_nll

Z95 = 1.959963984540054  # the 97.5% quantile of the standard normal
POSITION_BUCKETS = 8


@jax.jit
def token_divergence(base_logits: jax.Array, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-position KL-divergence of `logits` from `base_logits`, and top-1 agreement.

    Args:
      base_logits: [..., vocab] float (any float dtype; computed in float32).
      logits: [..., vocab] float, the same shape.
    Returns:
      ``(kld [...] float32, same_top [...] bool)``: ``KLD(base || model)`` in nats, and whether
      the two argmaxes are equal (ties go to the lowest index, as `jnp.argmax`).
    """
    base_log_probs = jax.nn.log_softmax(base_logits.astype(jnp.float32), axis=-1)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    base_probs = jnp.exp(base_log_probs)
    # 0 * log(0 / q) is 0; without the `where`, -inf - -inf would make it NaN.
    terms = jnp.where(base_probs > 0, base_probs * (base_log_probs - log_probs), 0.0)
    same_top = jnp.argmax(base_logits, axis=-1) == jnp.argmax(logits, axis=-1)
    return jnp.sum(terms, axis=-1), same_top


def mean_ci95(values: np.ndarray) -> tuple[float, float]:
    """Mean of `values` and the half-width of its 95% normal confidence interval.

    Args:
      values: [n] float or bool, n >= 1.
    Returns:
      ``(mean, 1.96 * s / sqrt(n))`` with ``s`` the sample standard deviation (ddof=1), in
      float64; the half-width is 0 for one value and ``inf`` when the mean is not finite.
    """
    values = np.asarray(values, np.float64).reshape(-1)
    if values.size == 0:
        raise ValueError("mean_ci95 needs at least one value")
    mean = float(np.mean(values))
    if not math.isfinite(mean):
        return mean, math.inf
    if values.size < 2:
        return mean, 0.0
    return mean, Z95 * float(np.std(values, ddof=1)) / math.sqrt(values.size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DivergenceResult:
    """How far a model's next-token distributions are from a base model's, over scored tokens.

    Attributes:
      tokens: scored tokens (positions compared).
      kld_mean: mean KLD(base || model) per token, nats.
      kld_ci95: half-width of its 95% confidence interval (module docstring).
      kld_median, kld_p99, kld_max: the median, 99th percentile (NumPy's linear interpolation)
        and maximum per-token KLD.
      top1: fraction of tokens whose most likely next token is the same in both models.
      top1_ci95: half-width of its 95% confidence interval.
      base_nll: the base model's mean negative log-likelihood per token (its perplexity is
        ``exp(base_nll)``), on the same tokens.
      position_starts: first window position of each position bucket (buckets without a scored
        token are left out).
      position_kld: mean KLD of the tokens scored at those positions of their window.
      position_ci95: half-widths of those means' 95% confidence intervals.
      position_tokens: tokens in each bucket.
      context: tokens per window; the last bucket ends there.
    """

    tokens: int
    kld_mean: float
    kld_ci95: float
    kld_median: float
    kld_p99: float
    kld_max: float
    top1: float
    top1_ci95: float
    base_nll: float
    position_starts: tuple[int, ...] = ()
    position_kld: tuple[float, ...] = ()
    position_ci95: tuple[float, ...] = ()
    position_tokens: tuple[int, ...] = ()
    context: int = 0

    @property
    def base_perplexity(self) -> float:
        """exp(base_nll)."""
        return math.exp(self.base_nll)

    def lines(self, base: str) -> list[str]:
        """Two lines for a terminal: the KLD statistics and the top-token agreement."""
        return [
            f"KL-divergence to {base} over {self.tokens} tokens (nats): mean {self.kld_mean:.5f} "
            f"± {self.kld_ci95:.5f} (95% CI), median {self.kld_median:.5f}, "
            f"p99 {self.kld_p99:.4f}, max {self.kld_max:.3f}",
            f"same top token as {base}: {self.top1:.2%} ± {self.top1_ci95:.2%} (95% CI); "
            f"{base} perplexity {self.base_perplexity:.3f}",
        ]

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "base_perplexity": self.base_perplexity}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DivergenceResult:
        """Inverse of `to_json` (nulls read as NaN); ValueError naming a missing or unknown
        field."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields) - {"base_perplexity"})
        if unknown:
            raise ValueError(
                f"divergence has unknown field {unknown[0]!r}; accepted: {sorted(fields)}"
            )
        values = {}
        for name, value in data.items():
            if name not in fields:
                continue
            if isinstance(value, list):
                value = tuple(math.nan if v is None else v for v in value)
            values[name] = math.nan if value is None else value
        try:
            return cls(**values)
        except TypeError as err:
            raise ValueError(f"divergence {dict(data)!r} is incomplete: {err}") from None


def summarize(
    kld: np.ndarray,
    same_top: np.ndarray,
    positions: np.ndarray,
    *,
    context: int,
    base_nll: float,
    buckets: int = POSITION_BUCKETS,
) -> DivergenceResult:
    """The statistics of per-token divergences.

    Args:
      kld: [n] float, KLD of each scored token (n >= 1).
      same_top: [n] bool, whether its top tokens agree.
      positions: [n] int, its position in its window, in ``[0, context)``.
      context: tokens per window.
      base_nll: the base model's mean negative log-likelihood on these tokens.
      buckets: position buckets of ``ceil(context / buckets)`` positions each.
    Returns:
      A `DivergenceResult`.
    """
    kld = np.asarray(kld, np.float64).reshape(-1)
    same_top = np.asarray(same_top, bool).reshape(-1)
    positions = np.asarray(positions).reshape(-1)
    if not kld.size == same_top.size == positions.size:
        raise ValueError(
            f"kld, same_top and positions have {kld.size}, {same_top.size} and "
            f"{positions.size} values; they must be one per token"
        )
    kld_mean, kld_ci95 = mean_ci95(kld)
    top1, top1_ci95 = mean_ci95(same_top)
    width = -(-context // buckets)
    starts, means, halves, counts = [], [], [], []
    for start in range(0, context, width):
        inside = kld[(positions >= start) & (positions < start + width)]
        if inside.size:
            mean, half = mean_ci95(inside)
            starts.append(start)
            means.append(mean)
            halves.append(half)
            counts.append(int(inside.size))
    return DivergenceResult(
        tokens=int(kld.size),
        kld_mean=kld_mean,
        kld_ci95=kld_ci95,
        kld_median=float(np.median(kld)),
        kld_p99=float(np.percentile(kld, 99)),
        kld_max=float(np.max(kld)),
        top1=top1,
        top1_ci95=top1_ci95,
        base_nll=base_nll,
        position_starts=tuple(starts),
        position_kld=tuple(means),
        position_ci95=tuple(halves),
        position_tokens=tuple(counts),
        context=context,
    )


def divergence(
    logits_fn: LogitsFn,
    base_logits_fn: LogitsFn,
    tokens: np.ndarray | list[int],
    *,
    context: int = 512,
    stride: int | None = None,
    max_tokens: int = 4096,
    on_window: Callable[[int, int], None] | None = None,
) -> tuple[PerplexityResult, DivergenceResult]:
    """Perplexity of `logits_fn` and its divergence from `base_logits_fn`, in one pass.

    Args:
      logits_fn: the model, ``tokens [1, context] int32 -> logits [1, context, vocab]``.
      base_logits_fn: the base model, the same signature and vocabulary.
      tokens, context, stride, max_tokens, on_window: as `perplexity`, whose windows and scored
        positions these are.
    Returns:
      ``(perplexity of the model, DivergenceResult)``.
    Raises:
      ValueError: as `perplexity`; and when the two models' logits differ in shape, naming
        both vocabulary sizes.
    """
    klds, agreements, positions = [], [], []
    base_total = [0.0]

    def compare(window, targets, logits, weights):
        base_logits = base_logits_fn(window)
        if base_logits.shape != logits.shape:
            raise ValueError(
                f"the base model's logits have shape {tuple(base_logits.shape)} and the "
                f"model's {tuple(logits.shape)}: vocabularies of {base_logits.shape[-1]} and "
                f"{logits.shape[-1]} tokens; KL-divergence needs the same vocabulary (the same "
                "model family and tokenizer)"
            )
        kld, same_top = token_divergence(base_logits[0], logits[0])
        scored = np.nonzero(np.asarray(weights[0]) > 0)[0]
        klds.append(np.asarray(kld)[scored])
        agreements.append(np.asarray(same_top)[scored])
        positions.append(scored)
        base_total[0] += float(token_nll(base_logits, targets, weights))

    result = perplexity(
        logits_fn,
        tokens,
        context=context,
        stride=stride,
        max_tokens=max_tokens,
        on_window=on_window,
        on_logits=compare,
    )
    summary = summarize(
        np.concatenate(klds),
        np.concatenate(agreements),
        np.concatenate(positions),
        context=context,
        base_nll=base_total[0] / result.tokens,
    )
    return result, summary
