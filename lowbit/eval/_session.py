"""`ModelSession`: one float reference model, its compiled runner, and evaluation of variants.

A session compiles the model's functions once (per parameter layout) and keeps the float
reference results (encoder embeddings) so that every recipe of the model is measured the same
way against the same baseline.
"""

from __future__ import annotations

import dataclasses
import statistics
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lowbit.eval._corpus import default_sentences, default_text
from lowbit.eval._divergence import DivergenceResult, divergence
from lowbit.eval._harness import encoder_runner, lm_perplexity, lm_runner, lm_speed
from lowbit.eval._perplexity import PerplexityResult
from lowbit.eval._report import ResultRow
from lowbit.eval._similarity import embedding_similarity
from lowbit.eval._speed import SpeedResult, time_call
from lowbit.eval._tree import float32_bytes, param_bytes
from lowbit.models import mean_pool
from lowbit.serving import LoadedModel, as_numpy_tokens

Progress = Callable[[int, int], None] | None

# Compiled runners per loaded model: sessions of the same model (several commands in one
# process) share the jitted functions and so their compilations.
_RUNNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ModelSession:
    """Evaluates parameter variants of one reference model.

    Args:
      loaded: the float reference model.
      text: perplexity text for LMs (default: `default_text`).
      sentences: sentences for encoders (default: `default_sentences`).
      context: perplexity window.
      max_tokens: tokens scored for perplexity.
      kv_cache: LMs: a quantized KV cache (`lowbit.recipes.KVCacheConfig`) that perplexity and
        decode run through; None for float.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        text: str | None = None,
        sentences: Sequence[str] | None = None,
        context: int = 512,
        max_tokens: int = 4096,
        kv_cache: Any = None,
    ):
        self.loaded = loaded
        self.kv_cache = kv_cache
        self.context = context
        self.max_tokens = max_tokens
        self._tokens: np.ndarray | None = None
        self._text = text
        self._reference: np.ndarray | None = None
        runners = _RUNNERS.setdefault(loaded, {})
        if kv_cache not in runners:
            if loaded.kind == "lm":
                runners[kv_cache] = lm_runner(loaded.model, kv_cache)
            else:
                runners[kv_cache] = encoder_runner(loaded.model, loaded.tokenizer, mean_pool)
        self.runner, self.float_params = runners[kv_cache]
        self.sentences: list[str] = []
        if loaded.kind != "lm":
            self.sentences = list(sentences) if sentences is not None else default_sentences()

    @property
    def metric(self) -> str:
        return "ppl" if self.loaded.kind == "lm" else "cosine"

    def tokens(self) -> np.ndarray:
        """[n] int32 token ids of the perplexity text (tokenized once)."""
        if self._tokens is None:
            self._tokens = as_numpy_tokens(self.loaded.tokenizer, self._text_or_default())
        return self._tokens

    def reference_embeddings(self) -> np.ndarray:
        """[n, d] float32 embeddings of the sentences by the float model (computed once)."""
        if self._reference is None:
            self._reference = self.runner.embed(self.float_params, self.sentences)
        return self._reference

    def quality(self, params: Any, on_window: Progress = None) -> tuple[float, float | None]:
        """``(perplexity, None)`` for LMs; ``(mean cosine, worst cosine)`` for encoders."""
        if self.loaded.kind == "lm":
            return self._perplexity(params, on_window).perplexity, None
        similarity = embedding_similarity(
            self.reference_embeddings(), self.runner.embed(params, self.sentences)
        )
        if on_window is not None:
            on_window(1, 1)
        return similarity.mean, similarity.min

    def _perplexity(self, params: Any, on_window: Progress) -> PerplexityResult:
        return lm_perplexity(
            self.runner,
            params,
            self.tokens(),
            context=self.context,
            max_tokens=self.max_tokens,
            on_window=on_window,
        )

    def speed(
        self,
        params: Any,
        *,
        decode_steps: int = 16,
        iters: int = 2,
        prefill_seconds: float | None = None,
    ) -> SpeedResult:
        """Prefill (one `context`-token window, batch 1) and decode throughput for LMs; for
        encoders, prefill = sentence tokens embedded per second and no decode.

        `prefill_seconds`: an already measured LM prefill time (see `lm_speed`)."""
        if self.loaded.kind == "lm":
            prompt = self.tokens()[: self.context]
            return lm_speed(
                self.runner,
                params,
                prompt,
                decode_steps=decode_steps,
                iters=iters,
                prefill_seconds=prefill_seconds,
            )
        n_tokens = sum(len(self.loaded.tokenizer.encode(s).ids) for s in self.sentences)
        seconds = time_call(self.runner.embed, params, self.sentences, warmup=1, iters=iters)
        return SpeedResult(
            prefill_tokens_per_s=n_tokens / seconds,
            decode_tokens_per_s=float("nan"),
            prefill_tokens=n_tokens,
            decode_steps=0,
        )

    def row(
        self,
        recipe: str,
        params: Any,
        *,
        measure_quality: bool = True,
        measure_speed: bool = False,
        on_window: Progress = None,
    ) -> ResultRow:
        """A `ResultRow` for `params` under the label `recipe`."""
        value = worst = prefill_seconds = None
        if measure_quality and self.loaded.kind == "lm":
            result = self._perplexity(params, on_window)
            value = result.perplexity
            # Every window after the first (which compiles) is a batch-1 prefill of `context`
            # tokens: their median is the prefill time, without extra runs.
            if len(result.window_seconds) >= 3:
                prefill_seconds = statistics.median(result.window_seconds[1:])
        elif measure_quality:
            value, worst = self.quality(params, on_window)
        prefill = decode = None
        if measure_speed:
            speed = self.speed(params, prefill_seconds=prefill_seconds)
            prefill = speed.prefill_tokens_per_s
            decode = None if self.loaded.kind != "lm" else speed.decode_tokens_per_s
        return ResultRow(
            model=self.loaded.name,
            recipe=recipe,
            size_bytes=param_bytes(params),
            float32_bytes=float32_bytes(self.float_params),
            metric=self.metric,
            value=value,
            worst=worst,
            prefill_tokens_per_s=prefill,
            decode_tokens_per_s=decode,
        )

    def divergence_row(
        self,
        recipe: str,
        params: Any,
        base: ModelSession,
        base_params: Any,
        *,
        on_window: Progress = None,
    ) -> tuple[ResultRow, DivergenceResult]:
        """The `row` of `params` (its perplexity) and its divergence from `base_params` run by
        `base`'s model, on this session's windows in one pass (LMs only).

        Raises:
          ValueError: if either model is not a language model, if `base` tokenizes this
            session's text differently, or if the two vocabularies differ.
        """
        for session, role in ((self, "the model"), (base, "the base model")):
            if session.loaded.kind != "lm":
                raise ValueError(
                    f"KL-divergence compares language models; {role} {session.loaded.name!r} "
                    "is an encoder"
                )
        self._check_same_tokens(base)
        result, summary = divergence(
            lambda window: self.runner.forward(params, window),
            lambda window: base.runner.forward(base_params, window),
            self.tokens(),
            context=self.context,
            max_tokens=self.max_tokens,
            on_window=on_window,
        )
        row = self.row(recipe, params, measure_quality=False)
        return dataclasses.replace(row, value=result.perplexity), summary

    def _check_same_tokens(self, base: ModelSession) -> None:
        if base.loaded.tokenizer is self.loaded.tokenizer:
            return
        ours = self.tokens()
        theirs = as_numpy_tokens(base.loaded.tokenizer, self._text_or_default())
        if ours.shape == theirs.shape and np.array_equal(ours, theirs):
            return
        n = min(ours.size, theirs.size)
        first = int(np.argmax(ours[:n] != theirs[:n])) if np.any(ours[:n] != theirs[:n]) else n
        raise ValueError(
            f"the base model {base.loaded.name!r} tokenizes the text differently from "
            f"{self.loaded.name!r} ({theirs.size} and {ours.size} tokens, the first difference "
            f"at token {first}); KL-divergence compares next-token distributions over one "
            "vocabulary, so the base must be the same model family with the same tokenizer"
        )

    def _text_or_default(self) -> str:
        return self._text if self._text is not None else default_text()
