"""The scheduler: one thread that owns the compiled programs and the slots' KV cache, and
runs continuous batching.

Each loop turn it (1) drops cancelled and expired requests, freeing their slots at once,
(2) advances the prefill of the oldest waiting request by one pass or one chunk (or prefills
waiting prompts together), placing it in a free slot when done (`lowbit.server._prefill`),
(3) runs one batch of the oldest embeddings request (`EmbedJob`, see
`lowbit.server._embeddings`), and (4) runs one decode call over the busy slots, handing each
request its new tokens (`lowbit.server._slots`). So a new request joins the running batch at
the next step, and a long prompt's chunks or a large embeddings request's batches alternate
with the others' tokens. See `lowbit.server._programs` for the cache layout.

Requests talk to the scheduler through `Job`: the scheduler calls ``job.emit(tokens, finish)``
from its thread; the HTTP side sets ``job.cancelled`` (a disconnect, a stop string).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowbit.api import StoredProgram, describe
from lowbit.models import bucket
from lowbit.server import _embeddings as embeddings
from lowbit.server import _speculate as speculate
from lowbit.server._compile import Source, compile_program
from lowbit.server._job import (
    CANCELLED,
    LENGTH,
    SHUTDOWN,
    STOP,
    TIMEOUT,
    Job,
    NotReady,
    QueueFull,
    SchedulerConfig,
)
from lowbit.server._logprobs import host_logprobs
from lowbit.server._prefill import Prefill, Prefiller
from lowbit.server._registry import ProgramRegistry, Programs
from lowbit.server._slots import Slots


class Scheduler:
    """Continuous batching over a fixed number of slots (see the module docstring).

    Args:
      model: a `lowbit.models.Decoder` (its float module), or a `lowbit.models.Bert` encoder,
        which only embeds (`generates` is False: no slots, cache or generation programs).
      params: the parameters to run (quantized or not); None: the module's own.
      kv_cache: the KV cache format (a `KVCacheConfig`) or None for float.
      config: slots, cache length, queue bound, prefill chunking.
      program_dir: where the compiled programs' traced forms are kept between starts
        (`lowbit.api.compile_stored`; `lowbit.api.program_directory()` is the one
        beside JAX's compilation cache); None traces them at every start.
      draft: the model that guesses with ``config.speculate == "draft"`` (same tokenizer,
        so the same vocabulary size), else None.
    """

    def __init__(
        self,
        model: nnx.Module,
        params: Any,
        kv_cache: Any,
        config: SchedulerConfig,
        program_dir: str | os.PathLike[str] | None = None,
        draft: speculate.DraftModel | None = None,
    ):
        self.generates = hasattr(model, "init_cache")
        if (config.speculate == "draft") != (draft is not None):
            raise ValueError("speculate='draft' needs a draft model, and a draft model needs it")
        if draft is not None and draft.model.config.vocab_size != model.config.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft.model.config.vocab_size} tokens) is not "
                f"the served model's ({model.config.vocab_size}): give a draft model of the "
                "same tokenizer"
            )
        context = model.config.context_length if self.generates else model.config.max_positions
        if config.max_len > context:
            config = dataclasses.replace(config, max_len=_fit(context))
        self.config = config
        self.model = model
        self.graphdef, state = nnx.split(model)
        self.params = state if params is None else params
        self.kv_cache = kv_cache
        self.program_dir = program_dir
        # Reading a kept program and XLA's compile release the GIL: a few at a time at start.
        self.programs = ProgramRegistry(self._compile, workers=min(4, os.cpu_count() or 1))
        c = config
        self.single_pass = min(c.single_pass, c.max_len)
        # Embedding batches of `single_pass` tokens: each costs about one prefill pass.
        embeds = c.embeddings or not self.generates
        self.embed_widths = embeddings.embedding_widths(self.single_pass) if embeds else []
        self._embedding: collections.deque[embeddings.EmbedJob] = collections.deque()
        self._lock = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._prefill: Prefill | None = None
        # Prompts prefilled in a batch with another, waiting for room in the slots.
        self._pending: collections.deque[Prefill] = collections.deque()
        self._stop = False
        self.ready = False
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        # An encoder has neither: it only embeds.
        self.slots: Slots | None = None
        self.prefill: Prefiller | None = None
        if self.generates:
            uses = Programs(self._run, self.programs.ready, self.programs.compile_soon)
            self.slots = Slots(model, self.params, kv_cache, config, draft, uses, self._lock)
            self.prefill = Prefiller(
                model,
                self.params,
                kv_cache,
                config,
                self.slots.cache.nbytes(),
                uses,
                lambda job: self.slots.sampling.one(job),
            )

    # -- limits -------------------------------------------------------------------------------

    @property
    def max_prompt(self) -> int:
        """The longest prompt accepted (with one new token)."""
        if self.prefill.chunk_widths:
            return self.config.max_len - 1
        return min(self.prefill.single_pass, self.config.max_len - 1)

    @property
    def max_embedding_tokens(self) -> int:
        """The longest input `/v1/embeddings` accepts (its widest batch); 0 without
        `SchedulerConfig.embeddings`."""
        return self.embed_widths[-1] if self.embed_widths else 0

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

    def check_choices(self, n: int, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why `n` choices of this size cannot run together (a message naming `n`), or None:
        more choices than slots (or queue places) would wait on each other, and they must fit
        the KV cache side by side."""
        c = self.config
        most = min(c.slots, c.queue)
        if n > most:
            return f"this server runs at most {most} choices per request (its slots); got {n}"
        if n * (prompt_tokens + max_tokens - 1) > c.slots * c.max_len:
            return (
                f"{n} choices of {prompt_tokens} prompt tokens plus max_tokens={max_tokens} "
                f"exceed the KV cache ({c.slots} slots of {c.max_len} tokens); lower n or "
                "max_tokens"
            )
        return None

    # -- the HTTP side ------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queues `job` (`submit_all` of one)."""
        self.submit_all([job])

    def submit_all(self, jobs: Sequence[Job]) -> None:
        """Queues `jobs` (a request's choices), all or none.

        Raises:
          NotReady: while compiling or after `close`.
          QueueFull: when `SchedulerConfig.queue` has no room for all of them.
        """
        with self._lock:
            if not self.ready or self._stop:
                raise NotReady("the server is not ready" if not self._stop else "shutting down")
            if len(self._waiting) + len(jobs) > self.config.queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting")
            self._waiting.extend(jobs)
            self._lock.notify()

    def submit_embedding(self, job: embeddings.EmbedJob) -> None:
        """Queues `job`; its batches run between decode steps (as prefill passes do).

        Raises:
          NotReady, QueueFull: as `submit` (embedding and generation requests share the queue).
        """
        with self._lock:
            if not self.ready or self._stop:
                raise NotReady("the server is not ready" if not self._stop else "shutting down")
            if len(self._waiting) + len(self._embedding) >= self.config.queue:
                raise QueueFull(f"{len(self._waiting) + len(self._embedding)} requests are waiting")
            self._embedding.append(job)
            self._lock.notify()

    def cancel(self, job: Job | embeddings.EmbedJob) -> None:
        """Ends `job` at the next step (a disconnected client, a stop string)."""
        with self._lock:
            job.cancelled = True
            self._lock.notify()

    @property
    def queue_length(self) -> int:
        prefilling = (self._prefill is not None) + len(self._pending)
        return len(self._waiting) + prefilling + len(self._embedding)

    @property
    def busy_slots(self) -> int:
        return 0 if self.slots is None else len(self.slots.busy)

    @property
    def speculation(self) -> speculate.Stats | None:
        """Speculative decoding's counts, or None without it."""
        return None if self.slots is None else self.slots.speculation

    def start(self) -> None:
        """Compiles the programs the first requests need in a background thread, then serves
        (`ready` turns True) while that thread compiles the others (`programs`)."""
        self._thread = threading.Thread(target=self._main, name="lowbit-scheduler", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Stops the loop; jobs still queued or running end with `SHUTDOWN`."""
        with self._lock:
            self._stop = True
            self._lock.notify()
        begin = time.monotonic()
        if self._thread is not None:
            self._thread.join(timeout)
        self.programs.close(max(0.0, timeout - (time.monotonic() - begin)))

    # -- the loop -----------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._warm_up()
            with self._lock:
                self.ready = True
            self.programs.start_background(self._background_failed)
            while self._turn():
                pass
        except BaseException as err:  # surfaced by /health and in the log
            self.error = err
            raise
        finally:
            self._end_all(SHUTDOWN)

    def _warm_up(self) -> None:
        """Registers every program for the shapes it will run (`_register_programs`) and
        compiles those the first requests need; the others are compiled in the background
        once the server is ready (`ProgramRegistry`)."""
        self._register_programs()
        self.programs.compile_at_start()

    def _register_programs(self) -> None:
        """Declares each program with example arguments built by the same code that builds a
        request's (`Prefiller.args`, `Slots.decode_args`); nothing runs.

        At start: the decode step and the copy of a one-pass prefill into a row (what a
        request needs after its prefill). In the background, in this order: the one-pass
        prefills from the narrowest (a request whose width is not compiled yet compiles it
        itself), the first token's sampling and log-probabilities, the decode step with
        log-probabilities, the slide, the programs over some rows, the batched prefills, the
        chunked prefill and its copy into a row, the prefix cache's copies, the embedding
        batches. The decode over some rows with log-probabilities is compiled once a request
        asks for them (`Slots.decode`)."""
        register = self.programs.register
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
        embed = [("embed", w, self._embed_args(w, [[0]], [0])) for w in self.embed_widths]
        if not self.generates:  # an encoder: embeddings are all it serves
            for spec in embed:
                register(*spec, at_start=True)
            return
        slots, prefill, states = self.slots, self.prefill, {}
        decode_args = slots.decode_args(1)
        register("decode", self.config.slots, decode_args, at_start=True)
        for width in prefill.prefill_widths + prefill.chunk_widths:
            job = dataclasses.replace(dummy, prompt=[0] * min(width, self.max_prompt))
            chunked = width in prefill.chunk_widths
            states[width] = prefill.begin(job, chunked=chunked, abstract=True)
        one_pass = states[prefill.prefill_widths[0]]
        insert = slots.insert_args(one_pass, 0, len(one_pass.job.prompt))
        register("insert", one_pass.cache.max_len, insert, at_start=True)
        for width in prefill.prefill_widths:
            name, args = prefill.args(states[width])
            register(name, width, args, at_start=False)
        w0 = prefill.prefill_widths[0]

        def logprobs_args() -> tuple:
            # Every width's logits are alike: those of one compiled already (a request that
            # asks has compiled its own), so that this one never waits for another width.
            ready = [w for w in prefill.prefill_widths if self.programs.ready("prefill", w)]
            (_, logits), _ = self.programs.get("prefill", (ready or [w0])[0]).out_shapes
            return logits, jnp.zeros((1,), jnp.int32)

        register("logprobs", 1, logprobs_args, at_start=False)
        register("decode_logprobs", self.config.slots, decode_args, at_start=False)
        register("shift", self.config.slots, slots.shift_args(1), at_start=False)
        for spec in slots.row_specs():
            register(*spec, at_start=False)
        for spec in prefill.batch_specs(dummy, slots.insert_args):
            register(*spec, at_start=False)
        for width in prefill.chunk_widths:
            state = states[width]
            name, args = prefill.args(state)
            register(name, width, args, at_start=False)
            insert = slots.insert_args(state, 0, len(state.job.prompt))
            register("insert", state.cache.max_len, insert, at_start=False)
            sampling = slots.sampling.one(state.job)

            def sample_args(width=width, sampling=sampling) -> tuple:
                logits, _ = self.programs.get("prefill_chunk", width).out_shapes
                return logits, sampling

            register("sample", 1, sample_args, at_start=False)
        for spec in prefill.prefix_specs():
            register(*spec, at_start=False)
        for spec in embed:
            register(*spec, at_start=False)

    def _background_failed(self, err: BaseException) -> None:
        """A program the background thread compiled failed: /health reports it."""
        self.error = err

    def _run(self, name: str, width: int | tuple[int, int], args: tuple) -> Any:
        """Program `name` (`_program`) called on `args`. The model's parameters go in as their
        leaves, flattened once: flattening the prepared weights' pytree took about 0.15 ms,
        a few percent of a SmolLM2 decode step."""
        flat = tuple(self._param_leaves.get(id(a), a) for a in args)
        return self._program(name, width, args)(*flat)

    @functools.cached_property
    def _param_leaves(self) -> dict[int, tuple]:
        # Both are set once, in __init__, and never replaced.
        draft = None if self.slots is None else self.slots.draft
        trees = [self.params] + ([draft.params] if draft is not None else [])
        return {id(t): tuple(jax.tree.leaves(t)) for t in trees}

    def _program(self, name: str, width: int | tuple[int, int], args: tuple) -> StoredProgram:
        """The compiled program `name` for arguments shaped like `args` (`width` tells its
        shapes apart): from `programs`, compiled now if it is not yet."""
        return self.programs.get(name, width, args)

    @functools.cached_property
    def _model_static(self) -> str:
        # A long repr: described once, not once per program.
        return describe((self.graphdef, self.model.config, self.kv_cache))

    @functools.cached_property
    def _embed_static(self) -> str:
        return describe((self.graphdef, self.model.config))

    def _compile(self, name: str, width: int | tuple[int, int], args: tuple) -> StoredProgram:
        """Compiles program `name` for arguments shaped like `args` (`ProgramRegistry` calls
        it, from any thread; `lowbit.server._compile`)."""
        rows = None if self.slots is None else self.slots.draft
        draft = None if rows is None else Source(rows.graphdef, rows.static)
        model = Source(self.graphdef, self._model_static)
        embedder = Source(self.graphdef, self._embed_static)
        return compile_program(name, width, args, model, embedder, draft, self.program_dir)

    def _turn(self) -> bool:
        """One loop turn; False when the loop should end."""
        with self._lock:
            while (
                not self._stop
                and not self._waiting
                and self._prefill is None
                and not self._pending
                and self.busy_slots == 0
                and not self._embedding
            ):
                self._lock.wait()
            if self._stop:
                return False
            self._drop_finished()
            if self._prefill is None and self._pending:
                self._prefill = self._pending.popleft()
            batch = []
            if self._prefill is None and self._waiting:
                batch = self._take_batch()
        if len(batch) > 1:
            self._prefill_batch(batch)
        elif batch:
            self._prefill = self.prefill.begin(batch[0], *self.prefill.lookup(batch[0]))
        state = self._prefill
        if state is not None:
            if state.job.cancelled or time.monotonic() > state.job.deadline:
                state.job.end(CANCELLED if state.job.cancelled else TIMEOUT)
                self._prefill = None
            elif state.first is None:
                self.prefill.advance(state)
                if state.first is not None:
                    self._first_token(state)
            else:
                self._place(state)
        if self._embedding:
            self._embed_batch(self._embedding[0])
        if self.busy_slots:
            waiting = self._prefill is not None or bool(self._waiting or self._pending)
            self.slots.decode(1 if waiting else self.config.steps)
        return True

    def _drop_finished(self) -> None:
        now = time.monotonic()
        for r in self.slots.busy if self.slots is not None else []:
            job = self.slots.jobs[r]
            if job.cancelled:
                self.slots.release(r, CANCELLED)
            elif now > job.deadline:
                self.slots.release(r, TIMEOUT)

    def _end_all(self, reason: str) -> None:
        with self._lock:
            for r in self.slots.busy if self.slots is not None else []:
                self.slots.release(r, reason)
            if self._prefill is not None:
                self._prefill.job.end(reason)
                self._prefill = None
            while self._pending:
                self._pending.popleft().job.end(reason)
            while self._waiting:
                self._waiting.popleft().end(reason)
            while self._embedding:
                self._end_embedding(self._embedding[0], None, reason)

    # -- prefill ------------------------------------------------------------------------------

    def _take_batch(self) -> list[Job]:
        """Pops the oldest waiting job and, when a batch of them is compiled, the waiting jobs
        to prefill with it (`_batch_prefill.partners`), at most the free slots. Call with the
        lock held."""
        head = self._waiting.popleft()
        free = len(self.slots.free)
        picked = self.prefill.partners(head, self._waiting, free)
        if not picked:
            return [head]
        taken = [self._waiting[i] for i in picked]
        self._waiting = collections.deque(j for j in self._waiting if j not in taken)
        return [head, *taken]

    def _prefill_batch(self, jobs: list[Job]) -> None:
        """Prefills `jobs` (waiting prompts of one width) in one pass, hands each its first
        token and places it in a free slot (or leaves it pending until there is room)."""
        for state in self.prefill.batch(jobs):
            self._prefill = state
            self._first_token(state)
            if self._prefill is state:  # no room yet: placed in a later turn
                self._pending.append(state)
        self._prefill = None

    def _first_token(self, state: Prefill) -> None:
        job = state.job
        job.first_token = time.monotonic()
        if job.logprobs is not None and state.first not in job.stop_ids:
            args = (state.logits, jnp.asarray([state.first], jnp.int32))
            arrays = self._run("logprobs", 1, args)
            arrays = jax.tree.map(lambda a: np.asarray(a)[:, None], arrays)  # one step
            job.token_logprobs.extend(host_logprobs(arrays, 0, 1, job.logprobs))
        state.logits = None
        if state.first in job.stop_ids:
            job.end(STOP)
            self._prefill = None
            return
        job.generated = 1
        if job.constraint is not None and not job.constraint.advance(state.first):
            job.end(STOP, [state.first])  # the grammar is complete
            self._prefill = None
            return
        if job.max_tokens == 1:
            job.end(LENGTH, [state.first])
            self._prefill = None
            return
        job.emit([state.first], None)
        self._place(state)

    def _place(self, state: Prefill) -> None:
        """Moves a prefilled prompt into a free slot when there is room (`Slots.place`)."""
        if self.slots.place(state):
            with self._lock:
                self._prefill = None

    # -- embeddings ---------------------------------------------------------------------------

    def _embed_args(self, width: int, inputs: list, indices: list[int]) -> tuple:
        """`embeddings.embed`'s arguments (after the graph definition): `inputs` at `indices`
        in a batch of `width`."""
        rows = embeddings.batch_rows(width, self.single_pass)
        tokens, lengths = embeddings.batch_arrays(inputs, indices, width, rows)
        return self.params, jnp.asarray(tokens), jnp.asarray(lengths)

    def _embed_batch(self, job: embeddings.EmbedJob) -> None:
        """One batch of `job`'s inputs; answers it once every input has its vector."""
        if job.cancelled or time.monotonic() > job.deadline:
            self._end_embedding(job, None, CANCELLED if job.cancelled else TIMEOUT)
            return
        width, indices = embeddings.next_batch(job, self.embed_widths, self.single_pass)
        args = self._embed_args(width, job.inputs, indices)
        out = np.asarray(self._run("embed", width, args))
        for row, i in enumerate(indices):
            job.vectors[i] = out[row]
        if all(v is not None for v in job.vectors):
            self._end_embedding(job, np.stack(job.vectors), None)

    def _end_embedding(
        self, job: embeddings.EmbedJob, vectors: np.ndarray | None, reason: str | None
    ) -> None:
        with self._lock:
            self._embedding.remove(job)
        if not job.finished:
            job.finished = True
            job.done(vectors, reason)


def _fit(context: int) -> int:
    """The largest cache bucket at most `context`."""
    size = 64
    while bucket(size + 1) <= context:
        size = bucket(size + 1)
    return size
