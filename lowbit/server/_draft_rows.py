"""The draft model of speculative decoding beside the served model's rows.

It keeps its own KV cache on the same slots and the same clock as the served model's, and is
fed each row's tokens lazily: `seen[r]` is one past the last slot of row `r` it has been fed.
Before a verify step, `guesses` feeds each busy row what it has not seen (rows at most
`speculate.STEADY` tokens behind together, the others alone in `speculate.windows`), then
takes ``k - 1`` greedy steps of every row in one call. Its programs are the served model's
(`programs.verify`, `decode_rows`, `shift`) on its own graph; the scheduler compiles and runs
them (`run`, `ready`) under the names ``"draft_<program>"``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowbit.api import describe
from lowbit.server import _programs as programs
from lowbit.server import _speculate as speculate
from lowbit.server._programs import RowSampling
from lowbit.server._registry import Programs


class DraftRows:
    """The draft model's parameters, cache and per-row progress (see the module docstring).

    Args:
      draft: the draft model (same tokenizer as the served one).
      kv_cache: the KV cache format both models use.
      slots, max_len: the served model's rows and their length.
      k: the guesses a verify step checks (`SchedulerConfig.speculate_tokens`).
      allowed: the rows' default grammar bits (`programs.allowed_bits`), ``[slots, W]``.
      programs: how it runs the scheduler's programs (`Programs`).
    """

    def __init__(
        self,
        draft: speculate.DraftModel,
        kv_cache: Any,
        slots: int,
        max_len: int,
        k: int,
        allowed: np.ndarray,
        programs: Programs,
    ):
        self.model = draft.model
        self.graphdef, state = nnx.split(draft.model)
        self.params = state if draft.params is None else draft.params
        self.kv_cache = kv_cache
        self.slots, self.max_len, self.k = slots, max_len, k
        self._run, self._ready = programs.run, programs.ready
        self.static = describe((self.graphdef, self.model.config, kv_cache))
        vocab = self.model.config.vocab_size
        # Greedy, no penalty or bias: the same every turn (not donated), so made once.
        self.sampling = RowSampling(
            keys=jnp.zeros((slots, 2), jnp.uint32),
            count=jnp.full((slots,), 2, jnp.int32),  # past the first: counts are kept
            temperature=jnp.zeros((slots,), jnp.float32),
            top_k=jnp.zeros((slots,), jnp.int32),
            top_p=jnp.ones((slots,), jnp.float32),
            presence=jnp.zeros((slots,), jnp.float32),
            frequency=jnp.zeros((slots,), jnp.float32),
            bias=jnp.zeros((slots, vocab), jnp.float32),
            allowed=jnp.asarray(allowed),
        )
        self.reset()

    def reset(self) -> None:
        """An empty cache; no row fed."""
        self.cache = self.model.init_cache(self.slots, self.max_len, self.kv_cache)
        self.seen = np.zeros((self.slots,), np.int32)
        self.counts = jnp.zeros((self.slots, self.model.config.vocab_size), jnp.int32)

    def start_row(self, r: int, start: int) -> None:
        """Row `r` now begins at slot `start`; it is fed lazily (`guesses`)."""
        self.seen[r] = start

    def shift(self, by: int, start: np.ndarray) -> None:
        """Slides the cache as the served model's (`start`: the rows' new first slots)."""
        self.seen = np.maximum(self.seen - by, 0).astype(np.int32)
        self.cache = self._run("draft_shift", self.slots, self.shift_args(by, start))

    def advanced(self, busy: list[int], clock: int) -> None:
        """The busy rows' tokens up to slot `clock - 1` were fed (a verify step kept them)."""
        self.seen[busy] = clock

    # -- example and real arguments of its programs --------------------------------------------

    def feed_args(self, tokens: np.ndarray, at: int, index: np.ndarray, start: np.ndarray):
        """`programs.verify`'s arguments: ``tokens [b, W]`` written at slots
        ``at .. at + W - 1`` of rows ``index [b]``."""
        cache = _at(self.cache, at, start)
        return self.params, cache, jnp.asarray(tokens, jnp.int32), jnp.asarray(index)

    def decode_args(self, token: np.ndarray, index: np.ndarray, clock: int, start: np.ndarray):
        """`programs.decode_rows`'s arguments: ``k - 1`` greedy steps of rows `index` from
        ``token [slots]`` at the clock's next slot (the clock's own holds the latest token)."""
        steps = jnp.int32(self.k - 1)
        token = jnp.asarray(token, jnp.int32)
        cache = _at(self.cache, clock + 1, start)
        return self.params, cache, token, self.sampling, self.counts, steps, jnp.asarray(index)

    def shift_args(self, by: int, start: np.ndarray) -> tuple:
        return self.cache, jnp.int32(by), jnp.asarray(start)

    def program_specs(self, buckets: list[int], start: np.ndarray) -> list[tuple[str, Any, tuple]]:
        """(name, key, example arguments) of every program it runs, for rows in `buckets` and
        all the slots."""
        slots, out = self.slots, []
        feeds = {(speculate.STEADY, b) for b in [*buckets, slots]}
        feeds |= {(w, 1) for w in speculate.FEED_WIDTHS}
        for w, b in sorted(feeds):
            tokens = np.zeros((b, w), np.int32)
            out.append(("draft_verify", (w, b), self.feed_args(tokens, 0, np.arange(b), start)))
        for b in [*buckets, slots]:
            index = np.arange(b, dtype=np.int32)
            args = self.decode_args(np.zeros(slots), index, 0, start)
            out.append(("draft_decode_rows", b, args))
        out.append(("draft_shift", slots, self.shift_args(1, start)))
        return out

    # -- guessing -------------------------------------------------------------------------------

    def needs(self, busy: list[int], clock: int) -> dict[int, int]:
        """Each busy row's tokens the draft model has not been fed, its latest one included."""
        return {r: clock + 1 - int(self.seen[r]) for r in busy}

    def ready(self, busy: list[int], index: np.ndarray, clock: int) -> bool:
        """Whether every draft program this turn needs is compiled (else no speculation:
        they compile in the background)."""
        need = self.needs(busy, clock)
        steady = [r for r in busy if need[r] <= speculate.STEADY]
        keys = [("draft_decode_rows", len(index))]
        if steady:
            rows = programs.row_index(steady, self.slots)
            keys.append(("draft_verify", (speculate.STEADY, len(rows))))
        for r in busy:
            if need[r] > speculate.STEADY:
                keys += [("draft_verify", (w, 1)) for w in set(speculate.windows(need[r]))]
        return all(self._ready(name, key) for name, key in keys)

    def _feed(self, tokens: np.ndarray, at: int, index: np.ndarray, start: np.ndarray):
        """Feeds ``tokens [b, W]`` at slots ``at ..`` of rows `index`; the greedy token after
        each, ``[b, W]``."""
        args = self.feed_args(tokens, at, index, start)
        key = (tokens.shape[1], tokens.shape[0])
        greedy, self.cache = self._run("draft_verify", key, args)
        return np.asarray(greedy)

    def guesses(
        self,
        busy: list[int],
        index: np.ndarray,
        clock: int,
        start: np.ndarray,
        history: list[list[int]],
    ) -> dict[int, np.ndarray]:
        """`k` greedy guesses for each busy row (`index`: the verify step's rows; `history`:
        each row's prompt and tokens, the clock's slot holding its latest)."""

        def window(r: int, at: int, width: int) -> np.ndarray:
            begin = at - int(start[r])
            return np.asarray(history[r][begin : begin + width], np.int32)

        need = self.needs(busy, clock)
        first = np.zeros((self.slots,), np.int32)
        steady = [r for r in busy if need[r] <= speculate.STEADY]
        if steady:
            rows = programs.row_index(steady, self.slots)
            at = clock + 1 - speculate.STEADY
            tokens = np.zeros((len(rows), speculate.STEADY), np.int32)
            for i, r in enumerate(rows):
                if r in steady:
                    tokens[i] = window(r, at, speculate.STEADY)
            greedy = self._feed(tokens, at, rows, start)
            for i, r in enumerate(rows):
                if r in steady:
                    first[r] = greedy[i, -1]
        for r in busy:
            if need[r] <= speculate.STEADY:
                continue
            at = int(self.seen[r])
            for width in speculate.windows(need[r]):
                greedy = self._feed(window(r, at, width)[None], at, np.array([r]), start)
                at += width
            first[r] = greedy[0, -1]
        guesses = {r: first[r : r + 1] for r in busy}
        if self.k > 1:
            args = self.decode_args(first, index, clock, start)
            decoded, self.cache = self._run("draft_decode_rows", len(index), args)
            self.counts = decoded.counts
            out = np.asarray(decoded.tokens)
            guesses = {r: np.concatenate([first[r : r + 1], out[r, : self.k - 1]]) for r in busy}
        return guesses


def _at(cache: Any, length: int, start: np.ndarray) -> Any:
    """`cache` with its clock at `length` and its rows starting at `start`."""
    return dataclasses.replace(cache, length=jnp.int32(length), start=jnp.asarray(start))
