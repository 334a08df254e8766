"""The scheduler: one thread that owns the compiled programs and the slots' KV cache, and
runs continuous batching.

Each loop turn it (1) drops cancelled and expired requests, freeing their slots at once,
(2) advances the prefill of the oldest waiting request by one pass or one chunk, placing it in
a free slot when done, and (3) runs one decode call over every slot, handing each request its
new tokens. So a new request joins the running batch at the next step, and a long prompt's
chunks alternate with the others' tokens. See `lowbit.server._programs` for the cache layout.

Requests talk to the scheduler through `Job`: the scheduler calls ``job.emit(tokens, finish)``
from its thread; the HTTP side sets ``job.cancelled`` (a disconnect, a stop string).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowbit.api import StoredProgram, compile_stored, describe
from lowbit.models._generate import bucket
from lowbit.server import _programs as programs
from lowbit.server._programs import RowSampling

if TYPE_CHECKING:
    from lowbit.server._grammar import Constraint

# The model's programs, and the position of the KV cache among their arguments.
_MODEL_PROGRAMS = {"decode": 1, "prefill": 2, "prefill_chunk": 2}

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
    logit_bias: tuple[tuple[int, float], ...] = ()
    constraint: Constraint | None = None
    cancelled: bool = False
    submitted: float = dataclasses.field(default_factory=time.monotonic)
    first_token: float | None = None
    generated: int = 0
    finished: str | None = None


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
    """

    slots: int = 8
    max_len: int = 2048
    queue: int = 64
    single_pass: int = 256
    chunk: int = 256
    steps: int = 1

    def __post_init__(self):
        if self.slots < 1:
            raise ValueError(f"slots={self.slots} must be >= 1")
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
        if not 1 <= self.steps <= programs.MAX_STEPS:
            raise ValueError(f"steps={self.steps} must be in 1..{programs.MAX_STEPS}")


def _widths(lo: int, hi: int) -> list[int]:
    """The bucket sizes in ``(lo, hi]`` (lo exclusive)."""
    out, n = [], lo + 1
    while n <= hi:
        w = bucket(n)
        if w > hi:
            break
        out.append(w)
        n = w + 1
    return out


@dataclasses.dataclass(eq=False)
class _Prefill:
    """A request being prefilled (possibly over several chunks) or waiting for room."""

    job: Job
    width: int
    cache: Any
    tokens: np.ndarray
    next_chunk: int = 0  # chunked: index of the next chunk; single pass: unused
    first: int | None = None  # the first sampled token once prefilled
    source: int = 0  # the prompt's first slot in `cache`


class Scheduler:
    """Continuous batching over a fixed number of slots (see the module docstring).

    Args:
      model: a `lowbit.models.Decoder` (its float module).
      params: the parameters to run (quantized or not); None: the module's own.
      kv_cache: the KV cache format (a `KVCacheConfig`) or None for float.
      config: slots, cache length, queue bound, prefill chunking.
      program_dir: where the compiled programs' traced forms are kept between starts
        (`lowbit.api.compile_stored`; `lowbit.api.program_directory()` is the one
        beside JAX's compilation cache); None traces them at every start.
    """

    def __init__(
        self,
        model: nnx.Module,
        params: Any,
        kv_cache: Any,
        config: SchedulerConfig,
        program_dir: str | os.PathLike[str] | None = None,
    ):
        if config.max_len > model.config.context_length:
            config = dataclasses.replace(config, max_len=_fit(model.config.context_length))
        self.config = config
        self.model = model
        self.graphdef, state = nnx.split(model)
        self.params = state if params is None else params
        self.kv_cache = kv_cache
        self.program_dir = program_dir
        self._compiled: dict[tuple[str, int], StoredProgram] = {}
        c = config
        self.single_pass = min(c.single_pass, c.max_len)
        self.prefill_widths = _widths(0, bucket(self.single_pass))
        self.prefill_widths = [w for w in self.prefill_widths if w <= c.max_len]
        # Longer prompts are prefilled in chunks into a cache as long as a slot's: one program.
        self.chunk_widths = [c.max_len] if self.prefill_widths[-1] < c.max_len else []
        self._lock = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._prefill: _Prefill | None = None
        self._rows: list[Job | None] = [None] * c.slots
        self._stop = False
        self.ready = False
        self.error: BaseException | None = None
        self.steps_run = 0
        self._thread: threading.Thread | None = None
        self._reset_rows()

    # -- limits -------------------------------------------------------------------------------

    @property
    def max_prompt(self) -> int:
        """The longest prompt accepted (with one new token)."""
        if self.chunk_widths:
            return self.config.max_len - 1
        return min(self.single_pass, self.config.max_len - 1)

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request of this size cannot run (a message naming the field), or None."""
        if prompt_tokens > self.max_prompt:
            return (
                f"the prompt has {prompt_tokens} tokens; this server takes at most "
                f"{self.max_prompt} (its context is {self.config.max_len}). Shorten the prompt"
            )
        if prompt_tokens + max_tokens - 1 > self.config.max_len:
            return (
                f"max_tokens={max_tokens} with a prompt of {prompt_tokens} tokens exceeds the "
                f"context of {self.config.max_len} tokens; lower max_tokens to at most "
                f"{self.config.max_len - prompt_tokens + 1}"
            )
        return None

    # -- the HTTP side ------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queues `job`.

        Raises:
          NotReady: while compiling or after `close`.
          QueueFull: when `SchedulerConfig.queue` requests already wait.
        """
        with self._lock:
            if not self.ready or self._stop:
                raise NotReady("the server is not ready" if not self._stop else "shutting down")
            if len(self._waiting) >= self.config.queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting")
            self._waiting.append(job)
            self._lock.notify()

    def cancel(self, job: Job) -> None:
        """Ends `job` at the next step (a disconnected client, a stop string)."""
        with self._lock:
            job.cancelled = True
            self._lock.notify()

    @property
    def queue_length(self) -> int:
        return len(self._waiting) + (self._prefill is not None)

    @property
    def busy_slots(self) -> int:
        return sum(job is not None for job in self._rows)

    def start(self) -> None:
        """Compiles every program in a background thread, then serves (`ready` turns True)."""
        self._thread = threading.Thread(target=self._main, name="lowbit-scheduler", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Stops the loop; jobs still queued or running end with `SHUTDOWN`."""
        with self._lock:
            self._stop = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the loop -----------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._warm_up()
            with self._lock:
                self.ready = True
            while self._turn():
                pass
        except BaseException as err:  # surfaced by /health and in the log
            self.error = err
            raise
        finally:
            self._end_all(SHUTDOWN)

    def _reset_rows(self) -> None:
        c = self.config
        self.cache = self.model.init_cache(c.slots, c.max_len, self.kv_cache)
        self.clock = 0
        self.slides = 0  # cache slides since start (not counting the warm-up)
        self.start_host = np.full((c.slots,), c.max_len, np.int32)
        self.token_host = np.zeros((c.slots,), np.int32)
        self.count_host = np.zeros((c.slots,), np.int32)
        self.keys_host = np.zeros((c.slots, 2), np.uint32)
        self.temp_host = np.zeros((c.slots,), np.float32)
        self.topk_host = np.zeros((c.slots,), np.int32)
        self.topp_host = np.ones((c.slots,), np.float32)
        self.bias_host = np.zeros((c.slots, self.model.config.vocab_size), np.float32)
        self._bias_device: jax.Array | None = None  # bias_host on the device, until it changes
        self.cache = self._set_start(self.cache)

    def _set_start(self, cache: Any) -> Any:
        return dataclasses.replace(
            cache, start=jnp.asarray(self.start_host), length=jnp.int32(self.clock)
        )

    def _warm_up(self) -> None:
        """Compiles every program for the shapes it will run, so that no request compiles.

        Nothing runs: each program is compiled from example arguments built by the same code
        that builds a request's (`_prefill_args`, `_decode_args`). The model's programs come
        through `compile_stored`, which reads their traced form from `program_dir` when an
        earlier start kept it there."""
        dummy = Job(
            prompt=[0],
            max_tokens=1,
            temperature=0.0,
            top_k=0,
            top_p=1.0,
            seed=0,
            stop_ids=frozenset(),
            deadline=float("inf"),
            emit=lambda tokens, finish: None,
        )
        programs_to_compile = [("decode", self.config.slots, self._decode_args(1))]
        programs_to_compile.append(("shift", self.config.slots, self._shift_args(1)))
        chunked = None
        for width in self.prefill_widths + self.chunk_widths:
            job = dataclasses.replace(dummy, prompt=[0] * min(width, self.max_prompt))
            state = self._begin_prefill(job)
            name, args = self._prefill_args(state)
            programs_to_compile.append((name, width, args))
            slots = state.cache.max_len
            if ("insert", slots) not in {spec[:2] for spec in programs_to_compile}:
                insert = self._insert_args(state, 0, len(job.prompt))
                programs_to_compile.append(("insert", slots, insert))
            if name == "prefill_chunk":
                chunked = (width, job)
        # Reading a kept program and XLA's compile release the GIL: a few at a time.
        workers = max(1, min(4, os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda spec: self._program(*spec), programs_to_compile))
        if chunked is not None:
            width, job = chunked
            logits, _ = self._compiled[("prefill_chunk", width)].out_shapes
            self._program("sample", 1, (logits, self._row_sampling(job)))

    def _program(self, name: str, width: int, args: tuple) -> StoredProgram:
        """The compiled program `name` (a function of `programs`) for arguments shaped like
        `args`, compiled on first use; `width` tells its shapes apart."""
        compiled = self._compiled.get((name, width))
        if compiled is None:
            fn = getattr(programs, name)
            static, out_like, donate = "", (lambda a: a[0]), (0,)  # the moves: cache -> cache
            if name in _MODEL_PROGRAMS:
                fn = functools.partial(fn, self.graphdef)
                static = describe((self.graphdef, self.model.config, self.kv_cache))
                cache_at = _MODEL_PROGRAMS[name]
                out_like, donate = (lambda a: (0, a[cache_at])), (cache_at,)
            elif name == "sample":
                out_like, donate = (lambda a: 0), ()
            compiled = compile_stored(
                f"{name}-{width}",
                fn,
                args,
                static=static,
                out_like=out_like,
                donate_argnums=donate,
                directory=self.program_dir,
            )
            self._compiled[(name, width)] = compiled
        return compiled

    def _turn(self) -> bool:
        """One loop turn; False when the loop should end."""
        with self._lock:
            while (
                not self._stop
                and not self._waiting
                and self._prefill is None
                and self.busy_slots == 0
            ):
                self._lock.wait()
            if self._stop:
                return False
            self._drop_finished()
            if self._prefill is None and self._waiting:
                job = self._waiting.popleft()
            else:
                job = None
        if job is not None:
            self._prefill = self._begin_prefill(job)
        state = self._prefill
        if state is not None:
            if state.job.cancelled or time.monotonic() > state.job.deadline:
                self._finish(state.job, CANCELLED if state.job.cancelled else TIMEOUT)
                self._prefill = None
            elif state.first is None:
                self._advance_prefill(state)
                if state.first is not None:
                    self._first_token(state)
            else:
                self._place(state)
        if self.busy_slots:
            waiting = self._prefill is not None or bool(self._waiting)
            self._decode(1 if waiting else self.config.steps)
        return True

    def _drop_finished(self) -> None:
        now = time.monotonic()
        for r, job in enumerate(self._rows):
            if job is None:
                continue
            if job.cancelled:
                self._free(r, CANCELLED)
            elif now > job.deadline:
                self._free(r, TIMEOUT)

    def _free(self, r: int, reason: str) -> None:
        job = self._rows[r]
        self._rows[r] = None
        self.start_host[r] = self.config.max_len
        self.temp_host[r] = 0.0
        self.topk_host[r] = 0
        self._set_bias(r, None)
        if job is not None:
            self._finish(job, reason)

    def _finish(self, job: Job, reason: str, tokens: list[int] | None = None) -> None:
        if job.finished is None:
            job.finished = reason
            job.emit(tokens or [], reason)

    def _end_all(self, reason: str) -> None:
        with self._lock:
            for r in range(len(self._rows)):
                if self._rows[r] is not None:
                    self._free(r, reason)
            if self._prefill is not None:
                self._finish(self._prefill.job, reason)
                self._prefill = None
            while self._waiting:
                self._finish(self._waiting.popleft(), reason)

    # -- logit bias ---------------------------------------------------------------------------

    def _job_bias(self, job: Job) -> np.ndarray | None:
        """``[V]`` float32: what `job` adds to its next token's logits (its `logit_bias` and
        its grammar's mask), or None for nothing."""
        if not job.logit_bias and job.constraint is None:
            return None
        row = np.zeros((self.bias_host.shape[1],), np.float32)
        if job.constraint is not None:
            row += job.constraint.mask
        for token, bias in job.logit_bias:
            row[token] += bias
        return row

    def _set_bias(self, r: int, row: np.ndarray | None) -> None:
        """Sets row `r`'s bias (None: zeros)."""
        if row is None:
            if not self.bias_host[r].any():
                return
            self.bias_host[r] = 0.0
        else:
            self.bias_host[r] = row
        self._bias_device = None

    def _bias(self) -> jax.Array:
        if self._bias_device is None:
            self._bias_device = jnp.asarray(self.bias_host)
        return self._bias_device

    # -- prefill ------------------------------------------------------------------------------

    def _row_sampling(self, job: Job) -> RowSampling:
        key = jax.random.key_data(jax.random.key(job.seed))
        bias = self._job_bias(job)
        if bias is None:
            bias = np.zeros((self.bias_host.shape[1],), np.float32)
        return RowSampling(
            keys=jnp.asarray(key)[None],
            count=jnp.zeros((1,), jnp.int32),
            temperature=jnp.asarray([job.temperature], jnp.float32),
            top_k=jnp.asarray([job.top_k], jnp.int32),
            top_p=jnp.asarray([job.top_p], jnp.float32),
            bias=jnp.asarray(bias)[None],
        )

    def _begin_prefill(self, job: Job) -> _Prefill:
        n = len(job.prompt)
        if n <= self.single_pass:
            # Exactly as `generate_tokens` runs a batch of one: left-padded to bucket(n).
            width = bucket(n)
            tokens = np.zeros((1, width), np.int32)
            tokens[0, width - n :] = job.prompt
            # Every width prefills into a cache of the widest one's slots (the slots past the
            # prompt stay empty and unseen), so one program moves any of them into a row.
            cache = self.model.init_cache(1, self.prefill_widths[-1], self.kv_cache)
            cache = dataclasses.replace(cache, start=jnp.asarray([width - n], jnp.int32))
            return _Prefill(job, width, cache, tokens, source=width - n)
        width = self.config.max_len
        tokens = np.zeros((1, width), np.int32)
        tokens[0, :n] = job.prompt
        cache = self.model.init_cache(1, width, self.kv_cache)
        return _Prefill(job, width, cache, tokens, source=0)

    def _prefill_args(self, state: _Prefill) -> tuple[str, tuple]:
        """The program for `state`'s next pass or chunk, and its arguments (after the graph
        definition)."""
        job = state.job
        if len(job.prompt) <= self.single_pass:
            tokens = jnp.asarray(state.tokens)
            return "prefill", (self.params, tokens, state.cache, self._row_sampling(job))
        c = self.config.chunk
        # The last chunk ends at the prompt's last token (it may overlap the one before).
        at = min(state.next_chunk * c, len(job.prompt) - c)
        cache = dataclasses.replace(state.cache, length=jnp.int32(at))
        return "prefill_chunk", (self.params, jnp.asarray(state.tokens[:, at : at + c]), cache)

    def _advance_prefill(self, state: _Prefill) -> None:
        """One pass (a short prompt) or one chunk (a long one)."""
        job = state.job
        name, args = self._prefill_args(state)
        out, state.cache = self._program(name, state.width, args)(*args)
        if name == "prefill":
            state.first = int(out[0])
            return
        state.next_chunk += 1
        if state.next_chunk == -(-len(job.prompt) // self.config.chunk):
            args = (out, self._row_sampling(job))
            state.first = int(self._program("sample", 1, args)(*args)[0])

    def _first_token(self, state: _Prefill) -> None:
        job = state.job
        job.first_token = time.monotonic()
        if state.first in job.stop_ids:
            self._finish(job, STOP)
            self._prefill = None
            return
        job.generated = 1
        if job.constraint is not None and not job.constraint.advance(state.first):
            self._finish(job, STOP, [state.first])  # the grammar is complete
            self._prefill = None
            return
        if job.max_tokens == 1:
            self._finish(job, LENGTH, [state.first])
            self._prefill = None
            return
        job.emit([state.first], None)
        self._place(state)

    def _place(self, state: _Prefill) -> None:
        """Moves a prefilled prompt into a free slot when there is room before the clock."""
        job = state.job
        n = len(job.prompt)
        free = [r for r, j in enumerate(self._rows) if j is None]
        if not free:
            return
        active = [r for r, j in enumerate(self._rows) if j is not None]
        if not active:
            self.clock = n
        elif self.clock < n:
            by = n - self.clock  # slide right to make room; only if every row still fits
            if any(self._needs_end(r) + by > self.config.max_len for r in active):
                return
            self._shift(-by)
        r = free[0]
        self.start_host[r] = self.clock - n
        args = self._insert_args(state, r, n)
        self.cache = self._program("insert", state.cache.max_len, args)(*args)
        key = np.asarray(jax.random.key_data(jax.random.key(job.seed)))
        self.keys_host[r] = key
        self.token_host[r] = state.first
        self.count_host[r] = 1
        self.temp_host[r] = job.temperature
        self.topk_host[r] = job.top_k
        self.topp_host[r] = job.top_p
        self._set_bias(r, self._job_bias(job))
        with self._lock:
            self._rows[r] = job
            self._prefill = None

    def _insert_args(self, state: _Prefill, r: int, n: int) -> tuple:
        """`programs.insert`'s arguments: `state`'s `n` prompt slots into row `r`."""
        big = dataclasses.replace(self.cache, length=jnp.int32(self.clock))
        return (
            big,
            state.cache,
            jnp.int32(r),
            jnp.int32(state.source),
            jnp.int32(n),
            jnp.asarray(self.start_host),
        )

    def _shift_args(self, by: int) -> tuple:
        return self.cache, jnp.int32(by), jnp.asarray(self.start_host)

    def _needs_end(self, r: int) -> int:
        """One past the last cache slot row `r` will write (its last token is never fed)."""
        job = self._rows[r]
        return int(self.start_host[r]) + len(job.prompt) + job.max_tokens - 1

    def _shift(self, by: int) -> None:
        """Slides the cache left by `by` slots (right when negative)."""
        active = [self._rows[r] is not None for r in range(self.config.slots)]
        self.start_host = np.where(active, self.start_host - by, self.config.max_len).astype(
            np.int32
        )
        self.clock -= by
        self.slides += 1
        args = self._shift_args(by)
        self.cache = self._program("shift", self.config.slots, args)(*args)

    # -- decode -------------------------------------------------------------------------------

    def _decode_args(self, steps: int) -> tuple:
        """`programs.decode`'s arguments (after the graph definition) for `steps` steps."""
        rows = RowSampling(
            keys=jnp.asarray(self.keys_host),
            count=jnp.asarray(self.count_host),
            temperature=jnp.asarray(self.temp_host),
            top_k=jnp.asarray(self.topk_host),
            top_p=jnp.asarray(self.topp_host),
            bias=self._bias(),
        )
        cache = dataclasses.replace(
            self.cache, length=jnp.int32(self.clock), start=jnp.asarray(self.start_host)
        )
        return self.params, cache, jnp.asarray(self.token_host), rows, jnp.int32(steps)

    def _decode(self, steps: int) -> None:
        t = self.config.max_len
        if self.clock >= t:
            active = [r for r, j in enumerate(self._rows) if j is not None]
            self._shift(min(int(self.start_host[r]) for r in active) if active else self.clock)
        # Every row must still have a slot for each step; a grammar's mask holds for one.
        if any(job is not None and job.constraint is not None for job in self._rows):
            steps = 1
        steps = max(1, min(steps, t - self.clock))
        args = self._decode_args(steps)
        out, self.cache = self._program("decode", self.config.slots, args)(*args)
        out = np.asarray(out)
        self.clock += steps
        self.steps_run += steps
        self.count_host += steps
        self.token_host = out[:, steps - 1].copy()
        for r, job in enumerate(self._rows):
            if job is None:
                continue
            new: list[int] = []
            reason = None
            for token in out[r, :steps]:
                token = int(token)
                if token in job.stop_ids:
                    reason = STOP
                    break
                new.append(token)
                job.generated += 1
                if job.constraint is not None and not job.constraint.advance(token):
                    reason = STOP  # the grammar is complete (or broke a work bound)
                    break
                if job.generated >= job.max_tokens:
                    reason = LENGTH
                    break
            if reason is None:
                if job.constraint is not None:
                    self._set_bias(r, self._job_bias(job))
                if new:
                    job.emit(new, None)
            else:
                with self._lock:
                    self._rows[r] = None
                self.start_host[r] = t
                self._set_bias(r, None)
                self._finish(job, reason, new)


def _fit(context: int) -> int:
    """The largest cache bucket at most `context`."""
    size = 64
    while bucket(size + 1) <= context:
        size = bucket(size + 1)
    return size
