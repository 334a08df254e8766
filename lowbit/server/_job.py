"""What a request is to the scheduler (`Job`), how it may end, and the scheduler's settings
(`SchedulerConfig`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from lowbit.models import bucket
from lowbit.server._logprobs import TokenLogprob
from lowbit.server._programs import MAX_STEPS

if TYPE_CHECKING:
    from lowbit.server._grammar import Constraint

# Finish reasons a job ends with.
STOP, LENGTH, CANCELLED, TIMEOUT, SHUTDOWN = "stop", "length", "cancelled", "timeout", "shutdown"


class QueueFull(Exception):
    """The waiting queue holds its maximum; the client should retry later."""


class NotReady(Exception):
    """The scheduler is still compiling, or shutting down."""


@dataclasses.dataclass(eq=False)
class Job:
    """One request as the scheduler sees it (mutable: the scheduler fills in the timings).

    Attributes:
      prompt: the prompt's token ids (at least one).
      max_tokens: at most this many new tokens (the stop token not counted).
      temperature, top_k, top_p: sampling (0 temperature: greedy; top_k 0: all tokens).
      seed: the PRNG seed; same seed and settings, same tokens as
        ``generate_tokens([prompt], key=seed)``.
      stop_ids: token ids that end the request (not emitted).
      deadline: ``time.monotonic()`` after which the request ends with `TIMEOUT`.
      emit: called from the scheduler thread with new token ids and, on the last call, the
        finish reason (None before).
      logprobs: alternatives to report with each token's log-probability, or None for no
        log-probabilities; then each token's `TokenLogprob` is appended to `token_logprobs`
        before the `emit` call that hands the token over.
      presence_penalty, frequency_penalty: see `lowbit.server._penalties` (0: none).
      logit_bias: ``(token id, bias)`` pairs added to the logits at every step.
      constraint: the grammar the tokens must follow (a fresh `Constraint`, advanced by the
        scheduler with each token), or None. While a constrained row runs, decode calls run
        one step (a mask holds for one token).
    """

    prompt: Sequence[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_ids: frozenset[int]
    deadline: float
    emit: Callable[[list[int], str | None], None]
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    token_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    logit_bias: tuple[tuple[int, float], ...] = ()
    constraint: Constraint | None = None
    cancelled: bool = False
    submitted: float = dataclasses.field(default_factory=time.monotonic)
    first_token: float | None = None
    generated: int = 0
    finished: str | None = None
    cached_tokens: int = 0  # prompt tokens read from the prefix cache instead of prefilled

    def end(self, reason: str, tokens: list[int] | None = None) -> None:
        """Hands over the last `tokens` with the finish `reason`, once (later calls: none)."""
        if self.finished is None:
            self.finished = reason
            self.emit(tokens or [], reason)

    def may_speculate(self) -> bool:
        """Whether the next tokens may be guessed and checked (`lowbit.server._speculate`):
        greedy, without log-probabilities, grammar, penalties or logit bias (a check returns
        greedy tokens only, and none of these)."""
        return (
            self.temperature == 0.0
            and self.logprobs is None
            and self.constraint is None
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
            and not self.logit_bias
        )


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Attributes:
    slots: rows decoded together (the batch).
    max_len: KV cache slots per row (a `bucket` size, at most the model's context); a
      request's prompt plus its max_tokens must fit.
    queue: requests that may wait for a slot; more get `QueueFull`.
    single_pass: prompts of up to this many tokens are prefilled in one pass; longer ones in
      chunks of `chunk` tokens between decode steps.
    chunk: tokens per prefill chunk (a power of two, at most `single_pass`).
    steps: decode steps per call while no request waits (more steps, less dispatch cost;
      a cancelled slot is then freed within one call).
    kv_memory: bytes of the prefix cache's blocks (keys and values of earlier prompts, in the
      KV cache's format); None: half of what the slots' cache takes; 0: no prefix cache.
    prefix_block: tokens per prefix-cache block (a power of two from 8 to `chunk`).
    embeddings: compile the embedding programs and serve ``/v1/embeddings`` (an encoder,
      which only embeds, always does).
    speculate: None, ``"ngram"`` (speculative decoding by prompt lookup) or ``"draft"``
      (guesses of the scheduler's `DraftModel`), `lowbit.server._speculate`, in the turns
      where every busy row may take it (greedy, without log-probabilities, grammar,
      penalties or logit bias).
    speculate_tokens: tokens guessed per row and turn (checked in one forward pass).
    prefill_rows: waiting prompts prefilled together in one pass, at most
      (`lowbit.server._batch_prefill`); 1: each alone.
    deterministic: every decode step runs all slots and every prompt is prefilled alone, so
      a request's tokens never depend on which others run beside it. Otherwise the busy rows
      alone are decoded and waiting prompts prefilled together: faster for a few clients,
      and the same tokens for a dense decoder on the CPU kernels (`lowbit.models.
      _batch_invariant`), but XLA's float products (a float model, float activations at
      prefill sizes) and a mixture of experts' grouping round by the batch's shape, so a
      greedy answer may then differ from the same request run alone.
    """

    slots: int = 8
    max_len: int = 2048
    queue: int = 64
    single_pass: int = 256
    chunk: int = 256
    steps: int = 1
    kv_memory: int | None = None
    prefix_block: int = 16
    embeddings: bool = False
    speculate: str | None = None
    speculate_tokens: int = 8
    prefill_rows: int = 4
    deterministic: bool = False

    def __post_init__(self):
        if self.speculate not in (None, "ngram", "draft"):
            raise ValueError(f"speculate={self.speculate!r} must be None, 'ngram' or 'draft'")
        if not 1 <= self.speculate_tokens <= MAX_STEPS:
            raise ValueError(f"speculate_tokens={self.speculate_tokens} must be in 1..{MAX_STEPS}")
        if self.slots < 1:
            raise ValueError(f"slots={self.slots} must be >= 1")
        if self.prefill_rows < 1:
            raise ValueError(f"prefill_rows={self.prefill_rows} must be >= 1 (1: each alone)")
        if self.max_len < 64 or bucket(self.max_len) != self.max_len:
            raise ValueError(
                f"max_len={self.max_len} must be a cache bucket of at least 64 (64, 96, 128, "
                "192, 256, ... : powers of two and three times powers of two)"
            )
        if self.queue < 1:
            raise ValueError(f"queue={self.queue} must be >= 1")
        if self.chunk < 16 or self.chunk & (self.chunk - 1) or self.chunk > self.single_pass:
            raise ValueError(
                f"chunk={self.chunk} must be a power of two from 16 to single_pass "
                f"({self.single_pass})"
            )
        if not 1 <= self.steps <= MAX_STEPS:
            raise ValueError(f"steps={self.steps} must be in 1..{MAX_STEPS}")
        if self.kv_memory is not None and self.kv_memory < 0:
            raise ValueError(f"kv_memory={self.kv_memory} must be >= 0 (0: no prefix cache)")
        b = self.prefix_block
        if b < 8 or b & (b - 1) or b > self.chunk:
            raise ValueError(
                f"prefix_block={b} must be a power of two from 8 to chunk ({self.chunk})"
            )
