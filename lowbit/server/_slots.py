"""The slots: one KV cache of ``[slots, max_len]`` on one clock, and the requests decoding in
its rows.

Every row writes its next token at the clock's slot, so a row's tokens sit at slots
``start[r] .. clock - 1``: a prompt of ``n`` tokens is copied in to end at the clock (the cache
slides right to make room when the clock is below ``n``), and the cache slides left when the
clock reaches the end. A decode step runs over every row, or over the busy ones only once
their program is compiled (`programs.decode_rows`); with speculation, one step checks several
guessed tokens of every busy row (`lowbit.server._speculate`). See `lowbit.server._programs`
for the programs and the cache layout.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.server import _programs as programs
from lowbit.server import _speculate as speculate
from lowbit.server._draft_rows import DraftRows
from lowbit.server._job import LENGTH, STOP, Job, SchedulerConfig
from lowbit.server._logprobs import host_logprobs
from lowbit.server._prefill import Prefill, cache_key
from lowbit.server._registry import Programs
from lowbit.server._sampling_rows import SamplingRows


class Slots:
    """The rows of the served model's cache and their requests (see the module docstring).

    Args:
      model, params, kv_cache: the served `Decoder`, its parameters and the cache format.
      config: the scheduler's settings.
      draft: the draft model of speculative decoding, or None.
      programs: how it runs the scheduler's programs (`Programs`).
      lock: the scheduler's lock, held where a row is taken or given back (the HTTP side
        reads `jobs`).

    Attributes:
      jobs: each row's request, or None for a free row.
      cache, clock: the cache and the slot the next token is written at.
      start, token: each row's first slot (``max_len`` when free) and latest token (host).
      history: each row's prompt and tokens so far (what `speculate.draft` looks up).
      sampling: each row's sampling settings (`SamplingRows`).
      draft: the draft model beside the rows (`DraftRows`), or None.
      speculation: the speculation counts (`speculate.Stats`), or None without speculation.
      steps_run, slides: decode steps (tokens a row) and cache slides since start.
      asked: the (program, width) pairs already handed to `programs.soon` to compile.
    """

    def __init__(
        self,
        model: Any,
        params: Any,
        kv_cache: Any,
        config: SchedulerConfig,
        draft: speculate.DraftModel | None,
        programs: Programs,
        lock: threading.Condition,
    ):
        self.model, self.params, self.kv_cache, self.config = model, params, kv_cache, config
        self._run, self._ready, self._soon = programs.run, programs.ready, programs.soon
        self._lock = lock
        self.jobs: list[Job | None] = [None] * config.slots
        self.speculation = speculate.Stats() if config.speculate is not None else None
        self.steps_run = 0
        self.asked: set[tuple[str, int]] = set()  # programs asked for with `programs.soon`
        self.draft: DraftRows | None = None
        self.reset()
        if draft is not None:
            c = config
            allowed = self.sampling.allowed.host
            self.draft = DraftRows(
                draft, kv_cache, c.slots, c.max_len, c.speculate_tokens, allowed, programs
            )

    def reset(self) -> None:
        """An empty cache at clock 0; every row free."""
        c = self.config
        self.clock = 0
        self.slides = 0  # cache slides since start (not counting the warm-up)
        self.start = np.full((c.slots,), c.max_len, np.int32)
        self.token = np.zeros((c.slots,), np.int32)
        self.sampling = SamplingRows(c.slots, self.model.config.vocab_size)
        self.history: list[list[int]] = [[] for _ in range(c.slots)]
        self.cache = self._at_clock(self.model.init_cache(c.slots, c.max_len, self.kv_cache))
        if self.draft is not None:
            self.draft.reset()

    @property
    def busy(self) -> list[int]:
        """The rows with a request."""
        return [r for r, job in enumerate(self.jobs) if job is not None]

    @property
    def free(self) -> list[int]:
        """The rows without one."""
        return [r for r, job in enumerate(self.jobs) if job is None]

    def _at_clock(self, cache: Any) -> Any:
        return dataclasses.replace(
            cache, start=jnp.asarray(self.start), length=jnp.int32(self.clock)
        )

    # -- the programs' arguments ----------------------------------------------------------------

    def insert_args(self, state: Prefill, r: int, n: int) -> tuple:
        """`programs.insert`'s arguments: `state`'s `n` prompt slots into row `r`."""
        big = dataclasses.replace(self.cache, length=jnp.int32(self.clock))
        return (
            big,
            state.cache,
            jnp.int32(r),
            jnp.int32(state.row),
            jnp.int32(state.source),
            jnp.int32(n),
            jnp.asarray(self.start),
        )

    def shift_args(self, by: int) -> tuple:
        return self.cache, jnp.int32(by), jnp.asarray(self.start)

    def decode_args(self, steps: int, index: np.ndarray | None = None) -> tuple:
        """`programs.decode`'s arguments (after the graph definition) for `steps` steps, or
        with rows `index` `programs.decode_rows`'s."""
        token = jnp.asarray(self.token)
        rows, counts = self.sampling.device(), self.sampling.counts
        args = (self.params, self._at_clock(self.cache), token, rows, counts, jnp.int32(steps))
        return args if index is None else (*args, jnp.asarray(index))

    def verify_args(self, tokens: np.ndarray, index: np.ndarray) -> tuple:
        """`programs.verify`'s arguments: ``tokens [b, K + 1]`` for rows ``index [b]``."""
        return self.params, self._at_clock(self.cache), jnp.asarray(tokens), jnp.asarray(index)

    def row_specs(self) -> list[tuple[str, int, tuple]]:
        """The programs over some of the rows (`programs.decode_rows` for each row bucket,
        and with `SchedulerConfig.speculate` `programs.verify` for each bucket and every row,
        and the draft model's), with example arguments. A turn runs one only once it is
        compiled, else the full decode."""
        slots, out = self.config.slots, []
        for b in self.buckets:
            out.append(("decode_rows", b, self.decode_args(1, np.arange(b, dtype=np.int32))))
        if self.config.speculate is not None:
            k = self.config.speculate_tokens
            for b in [*self.buckets, slots]:
                index = np.arange(b, dtype=np.int32)
                out.append(("verify", b, self.verify_args(np.zeros((b, k + 1), np.int32), index)))
        if self.draft is not None:
            out += self.draft.program_specs(self.buckets, self.start)
        return out

    @property
    def buckets(self) -> list[int]:
        """The row counts of the programs over some of the rows (none when deterministic:
        programs over all the rows only, see `SchedulerConfig`)."""
        return [] if self.config.deterministic else programs.row_buckets(self.config.slots)

    # -- rows in and out ------------------------------------------------------------------------

    def place(self, state: Prefill) -> bool:
        """Moves a prefilled prompt into a free row when there is room before the clock;
        whether it did."""
        job, n = state.job, len(state.job.prompt)
        free, busy = self.free, self.busy
        if not free:
            return False
        if not busy:
            self.clock = n
        elif self.clock < n:
            by = n - self.clock  # slide right to make room; only if every row still fits
            if any(self._needs_end(r) + by > self.config.max_len for r in busy):
                return False
            self.shift(-by)
        r = free[0]
        self.start[r] = self.clock - n
        self.cache = self._run("insert", cache_key(state.cache), self.insert_args(state, r, n))
        self.token[r] = state.first
        self.history[r] = [*job.prompt, state.first]
        if self.draft is not None:
            self.draft.start_row(r, self.start[r])
        self.sampling.place(r, job)
        with self._lock:
            self.jobs[r] = job
        return True

    def release(self, r: int, reason: str, tokens: list[int] | None = None) -> None:
        """Ends row `r`'s request with `reason` (after its last `tokens`) and frees the row."""
        with self._lock:
            job, self.jobs[r] = self.jobs[r], None
        self.start[r] = self.config.max_len
        self.sampling.clear(r)
        if job is not None:
            job.end(reason, tokens)

    def _needs_end(self, r: int) -> int:
        """One past the last cache slot row `r` will write (its last token is never fed)."""
        job = self.jobs[r]
        return int(self.start[r]) + len(job.prompt) + job.max_tokens - 1

    def shift(self, by: int) -> None:
        """Slides the cache left by `by` slots (right when negative)."""
        active = [job is not None for job in self.jobs]
        self.start = np.where(active, self.start - by, self.config.max_len).astype(np.int32)
        self.clock -= by
        self.slides += 1
        self.cache = self._run("shift", self.config.slots, self.shift_args(by))
        if self.draft is not None:
            self.draft.shift(by, self.start)

    # -- decoding -------------------------------------------------------------------------------

    def decode(self, steps: int) -> None:
        """Up to `steps` tokens of every busy row (one with a grammar; a speculation turn
        instead, where every row may take it), handed to their requests."""
        t = self.config.max_len
        if self.clock >= t:
            busy = self.busy
            self.shift(min(int(self.start[r]) for r in busy) if busy else self.clock)
        # Every row must still have a slot for each step; a grammar's mask holds for one.
        if any(job is not None and job.constraint is not None for job in self.jobs):
            steps = 1
        if self.speculation is not None and self._speculate():
            return
        steps = max(1, min(steps, t - self.clock))
        # The variant that also ranks the vocabulary runs only while a row asks for it.
        asks = any(job is not None and job.logprobs is not None for job in self.jobs)
        name, width, index = "decode_logprobs" if asks else "decode", self.config.slots, None
        rows = programs.row_index(self.busy, width)
        over_rows = "decode_rows_logprobs" if asks else "decode_rows"
        if len(rows) < width and self._ready(over_rows, len(rows)):
            name, width, index = over_rows, len(rows), rows  # only the busy rows run
        elif len(rows) < width and asks and not self.config.deterministic:
            # Compiled once a request asks (about 50 MiB a row bucket on SmolLM2, so a server
            # pays it only then); the full step until it is ready. Asked once: its example
            # arguments are device arrays, not to be built again on every step meanwhile.
            if (over_rows, len(rows)) not in self.asked:
                self.asked.add((over_rows, len(rows)))
                example = self.decode_args(1, np.arange(len(rows), dtype=np.int32))
                self._soon(over_rows, len(rows), example)
        decoded, self.cache = self._run(name, width, self.decode_args(steps, index))
        self.sampling.counts = decoded.counts
        out = np.asarray(decoded.tokens)
        lp = None if decoded.logprobs is None else jax.tree.map(np.asarray, decoded.logprobs)
        self.clock += steps
        self.steps_run += steps
        self.sampling.count += steps
        self.token = out[:, steps - 1].copy()
        for r, job in enumerate(self.jobs):
            if job is None:
                continue
            if lp is not None and job.logprobs is not None:
                # Appended before the emit that hands their tokens over (see `Job`).
                entries = host_logprobs(lp, r, steps, job.logprobs)
            else:
                entries = None
            self._hand_out(r, out[r, :steps], entries)

    def _hand_out(self, r: int, tokens: np.ndarray, entries: list | None = None) -> None:
        """Gives row `r`'s job its new `tokens` (with their log-probability `entries`), up
        to a stop token, its grammar's end or its max_tokens; frees the row when it ends."""
        job = self.jobs[r]
        new: list[int] = []
        reason = None
        for token in tokens:
            token = int(token)
            if token in job.stop_ids:
                reason = STOP
                break
            new.append(token)
            if entries is not None:
                job.token_logprobs.append(entries[len(new) - 1])
            job.generated += 1
            if job.constraint is not None and not job.constraint.advance(token):
                reason = STOP  # the grammar is complete (or broke a work bound)
                break
            if job.generated >= job.max_tokens:
                reason = LENGTH
                break
        self.history[r].extend(new)
        if reason is not None:
            self.release(r, reason, new)
            return
        if job.constraint is not None:
            self.sampling.allowed.set(r, job.constraint.bits)
        if new:
            job.emit(new, None)

    def _speculate(self) -> bool:
        """One turn of speculative decoding (`lowbit.server._speculate`), when every busy
        row may take it and has a guess; False (nothing run) otherwise."""
        t, k = self.config.max_len, self.config.speculate_tokens
        busy = self.busy
        if not all(self.jobs[r].may_speculate() for r in busy):
            return False
        guesses = {}
        if self.draft is None:
            guesses = {r: speculate.draft(np.asarray(self.history[r]), k) for r in busy}
            if not all(len(g) for g in guesses.values()):
                return False
        index = programs.row_index(busy, self.config.slots)
        if not self._ready("verify", len(index)):
            return False
        if self.draft is not None and not self.draft.ready(busy, index, self.clock):
            return False
        if self.clock + k + 1 > t:  # the guesses are written past the clock: make room
            first = min(int(self.start[r]) for r in busy)
            if self.clock - first + k + 1 > t:
                return False
            self.shift(first)
        if self.draft is not None:
            guesses = self.draft.guesses(busy, index, self.clock, self.start, self.history)
        tokens = np.zeros((len(index), k + 1), np.int32)
        for i, r in enumerate(index):
            if r in guesses:
                tokens[i, 0] = self.token[r]
                tokens[i, 1 : 1 + len(guesses[r])] = guesses[r]
        greedy, cache = self._run("verify", len(index), self.verify_args(tokens, index))
        greedy = np.asarray(greedy)
        row_of = {int(r): i for i, r in enumerate(index)}
        agreed = {r: speculate.accepted(guesses[r], greedy[row_of[r]]) for r in busy}
        # One clock for all rows: each keeps the fewest guesses any row got right, plus the
        # model's own token after them.
        keep = min(agreed.values())
        if self.draft is not None:  # it saw the latest token and guesses 1 .. k - 1
            self.draft.advanced(busy, self.clock + min(keep, k - 1) + 1)
        self.clock += keep + 1
        self.cache = dataclasses.replace(cache, length=jnp.int32(self.clock))
        self.steps_run += keep + 1
        self.speculation.drafted_tokens += sum(len(g) for g in guesses.values())
        self.speculation.accepted_tokens += keep * len(busy)
        for r in busy:
            new = greedy[row_of[r], : keep + 1]
            self.sampling.count[r] += keep + 1
            self.token[r] = new[-1]
            self._hand_out(r, new)
        return True
