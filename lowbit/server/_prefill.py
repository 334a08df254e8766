"""A prompt's way into the KV cache: one pass, a batch of prompts in one pass, or chunks, and
the prefix cache that the chunks read and every prefill fills.

A short prompt is prefilled in one pass, left-padded to its bucket, into a cache of the widest
one-pass width (so one program moves any of them into a slot); prompts of one chunk or less
that wait together are prefilled in one batch (`lowbit.server._batch_prefill`); a longer one,
or one whose head the prefix cache holds, in chunks into a cache as long as a slot, after the
cached blocks are copied in. The scheduler runs the programs (`run`), knows which are compiled
(`ready`), and moves a finished `Prefill` into a slot.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.models import bucket
from lowbit.server import _batch_prefill as batch_prefill
from lowbit.server._job import Job, SchedulerConfig
from lowbit.server._prefix import PrefixIndex, chain
from lowbit.server._programs import RowSampling
from lowbit.server._registry import Programs


@dataclasses.dataclass(eq=False)
class Prefill:
    """A request being prefilled (possibly over several chunks) or waiting for room."""

    job: Job
    width: int
    cache: Any
    tokens: np.ndarray
    chunked: bool = False  # prefilled in chunks into a cache of a slot's length
    begin: int = 0  # chunked: the first slot to prefill (those before come from the pool)
    next_chunk: int = 0  # chunked: index of the next chunk; single pass: unused
    first: int | None = None  # the first sampled token once prefilled
    logits: Any = None  # ``[1, V]``, what `first` was drawn from
    source: int = 0  # the prompt's first slot in `cache`
    row: int = 0  # the prompt's row in `cache` (a batch's: `_batch_prefill`)
    names: list[bytes] = dataclasses.field(default_factory=list)  # its blocks' prefix names


def cache_key(cache: Any) -> int | tuple[int, int]:
    """The key of the programs that copy out of a prefill cache (`insert`, `save`): its
    slots, and its rows for a batch's."""
    return cache.max_len if cache.batch == 1 else (cache.max_len, cache.batch)


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


class Prefiller:
    """The prefills of a scheduler's requests (see the module docstring).

    Args:
      model: the served `Decoder`; `params`: its parameters; `kv_cache`: the cache format.
      config: the scheduler's settings (slot length, one-pass and chunk widths, batch rows,
        the prefix cache's budget and block size).
      slots_bytes: the bytes of the slots' cache (half of it is the prefix cache's default
        budget).
      programs: how it runs the scheduler's programs (`Programs`).
      sampling: a job's sampling settings as one row (`SamplingRows.one`).

    Attributes:
      single_pass: the longest prompt prefilled in one pass.
      prefill_widths: the one-pass widths; `chunk_widths`: the chunked prefill's (a slot's
        length), or none.
      batch_sizes: the rows of the batched prefills.
      prefix, pool: the prefix cache's index and its blocks (a cache of one row per block),
        or None without one.
    """

    def __init__(
        self,
        model: Any,
        params: Any,
        kv_cache: Any,
        config: SchedulerConfig,
        slots_bytes: int,
        programs: Programs,
        sampling: Callable[[Job], RowSampling],
    ):
        self.model, self.params, self.kv_cache, self.config = model, params, kv_cache, config
        self._run, self._ready, self._sampling = programs.run, programs.ready, sampling
        c = config
        self.single_pass = min(c.single_pass, c.max_len)
        self.prefill_widths = [w for w in _widths(0, bucket(self.single_pass)) if w <= c.max_len]
        # Longer prompts are prefilled in chunks into a cache as long as a slot's: one program.
        self.chunk_widths = [c.max_len] if self.prefill_widths[-1] < c.max_len else []
        rows = 1 if c.deterministic else c.prefill_rows
        self.batch_sizes = batch_prefill.batch_sizes(min(rows, c.slots))
        self.prefix, self.pool = self._prefix_pool(slots_bytes)
        if self.prefix is not None and not self.chunk_widths:
            # The rest of a prompt whose head is cached is prefilled in chunks.
            self.chunk_widths = [c.max_len]

    def _prefix_pool(self, slots_bytes: int) -> tuple[PrefixIndex | None, Any]:
        c = self.config
        budget = slots_bytes // 2 if c.kv_memory is None else c.kv_memory
        if budget == 0:
            return None, None
        one = self.empty_cache(1, c.prefix_block, abstract=True).nbytes()
        blocks = budget // one
        if blocks < 1:
            raise ValueError(
                f"kv_memory={budget} bytes holds no prefix-cache block of {c.prefix_block} "
                f"tokens ({one} bytes each); give at least {one}, or 0 for no prefix cache"
            )
        pool = self.model.init_cache(blocks, c.prefix_block, self.kv_cache)
        return PrefixIndex(blocks, c.prefix_block), pool

    def empty_cache(self, rows: int, slots: int, abstract: bool = False) -> Any:
        """An empty KV cache of `rows` rows of `slots` slots; `abstract`: its leaves' shapes
        and dtypes only (`jax.ShapeDtypeStruct`), which example arguments need, without
        allocating or filling anything."""
        if abstract:
            make = functools.partial(self.model.init_cache, rows, slots, self.kv_cache)
            return jax.eval_shape(make)
        return self.model.init_cache(rows, slots, self.kv_cache)

    # -- one prompt ---------------------------------------------------------------------------

    def lookup(self, job: Job) -> tuple[list[bytes], list[int]]:
        """The names of the prompt's full blocks, and the pool blocks holding its head.

        Only a prompt longer than one chunk reads the pool: the rest is prefilled in chunks
        ending at its last token, and the one chunk of a shorter prompt would write over every
        slot read (a quantized cache's key offset included). Until the copy out of the pool is
        compiled (in the background after start) nothing is read: the prompt is prefilled
        whole, and its blocks are still saved."""
        if self.prefix is None:
            return [], []
        n, size = len(job.prompt), self.config.prefix_block
        names = chain(job.prompt, size)
        if not self._ready("load", self.config.max_len):
            return names, []
        self.prefix.stats.queried_tokens += n
        if n <= self.config.chunk:
            return names, []
        # The last token is always prefilled: its logits give the first new token.
        return names, self.prefix.match(names[: (n - 1) // size])

    def begin(
        self,
        job: Job,
        names: Sequence[bytes] = (),
        hit: Sequence[int] = (),
        chunked: bool | None = None,
        abstract: bool = False,
    ) -> Prefill:
        """The prefill of `job`: one pass, or chunks after the `hit` pool blocks (its prompt's
        first blocks, named `names[:len(hit)]`) are copied in. `abstract`: its cache's shapes
        only (`empty_cache`), as example arguments."""
        n = len(job.prompt)
        if chunked is None:
            chunked = bool(hit) or n > self.single_pass
        if not chunked:
            # Exactly as `generate_tokens` runs a batch of one: left-padded to bucket(n).
            width = bucket(n)
            tokens = np.zeros((1, width), np.int32)
            tokens[0, width - n :] = job.prompt
            # Every width prefills into a cache of the widest one's slots (the slots past the
            # prompt stay empty and unseen), so one program moves any of them into a row.
            cache = self.empty_cache(1, self.prefill_widths[-1], abstract)
            cache = dataclasses.replace(cache, start=jnp.asarray([width - n], jnp.int32))
            return Prefill(job, width, cache, tokens, source=width - n, names=list(names))
        width = self.config.max_len
        tokens = np.zeros((1, width), np.int32)
        tokens[0, :n] = job.prompt
        cache = self.empty_cache(1, width, abstract)
        size = self.config.prefix_block
        for i, block in enumerate(hit):
            args = (cache, self.pool, jnp.int32(block), jnp.int32(i * size))
            cache = self._run("load", width, args)
        if hit:
            self.prefix.touch(names[: len(hit)])
            job.cached_tokens = len(hit) * size
            self.prefix.stats.hit_tokens += job.cached_tokens
        return Prefill(
            job, width, cache, tokens, chunked=True, begin=len(hit) * size, names=list(names)
        )

    def args(self, state: Prefill) -> tuple[str, tuple]:
        """The program for `state`'s next pass or chunk, and its arguments (after the graph
        definition)."""
        job = state.job
        if not state.chunked:
            tokens = jnp.asarray(state.tokens)
            return "prefill", (self.params, tokens, state.cache, self._sampling(job))
        c = self.config.chunk
        # The last chunk ends at the prompt's last token (it may overlap the one before).
        at = min(state.begin + state.next_chunk * c, len(job.prompt) - c)
        cache = dataclasses.replace(state.cache, length=jnp.int32(at))
        return "prefill_chunk", (self.params, jnp.asarray(state.tokens[:, at : at + c]), cache)

    def advance(self, state: Prefill) -> None:
        """One pass (a short prompt) or one chunk (a long one); after the last, `state.first`
        is its first token, and its full blocks are saved to the prefix cache."""
        job = state.job
        name, args = self.args(state)
        out, state.cache = self._run(name, state.width, args)
        if name == "prefill":
            first, state.logits = out
            state.first = int(first[0])
            self.save(state)
            return
        state.next_chunk += 1
        if state.next_chunk == -(-(len(job.prompt) - state.begin) // self.config.chunk):
            args = (out, self._sampling(job))
            state.logits = out
            state.first = int(self._run("sample", 1, args)[0])
            self.save(state)

    def save(self, state: Prefill) -> None:
        """Copies the prompt's full blocks that the pool lacks into it (evicting as needed);
        nothing until the copy is compiled (in the background after start)."""
        if self.prefix is None or not state.names:
            return
        key = cache_key(state.cache)
        if not self._ready("save", key):
            return
        size = self.config.prefix_block
        for i, block in self.prefix.allocate(state.names):
            slot = jnp.int32(state.source + i * size)
            args = (self.pool, state.cache, slot, jnp.int32(block), jnp.int32(state.row))
            self.pool = self._run("save", key, args)
        self.prefix.touch(state.names)

    # -- prompts in a batch -------------------------------------------------------------------

    def batch_width(self, n: int) -> int | None:
        """The prefill width of a prompt of `n` tokens that may be prefilled in a batch
        (`_batch_prefill`: one chunk or less), else None."""
        return bucket(n) if n <= self.config.chunk else None

    def partners(self, head: Job, waiting: Sequence[Job], free: int) -> list[int]:
        """The indices of the `waiting` jobs to prefill in one batch with `head`, at most
        ``free - 1`` of them (`_batch_prefill.partners`); none until that batch's programs are
        compiled."""
        width = self.batch_width(len(head.prompt))
        most = min(free, self.batch_sizes[-1] if self.batch_sizes else 1) - 1
        if width is None or most < 1:
            return []
        prompts = [job.prompt for job in waiting]
        picked = batch_prefill.partners(prompts, width, self.batch_width, most)
        rows = batch_prefill.batch_size(1 + len(picked), self.batch_sizes)
        if not picked or not self._ready("prefill", (width, rows)):
            return []
        if not self._ready("insert", (self.prefill_widths[-1], rows)):
            return []
        return picked

    def batch_args(self, jobs: Sequence[Job], rows: int, abstract: bool = False) -> tuple:
        """`programs.prefill`'s arguments (after the graph definition) for `jobs`' prompts
        (of one width) in a batch of `rows`; `abstract`: the cache's shapes only."""
        width = bucket(len(jobs[0].prompt))
        prompts = [job.prompt for job in jobs]
        tokens, start = batch_prefill.batch_tokens(prompts, width, rows)
        cache = self.empty_cache(rows, self.prefill_widths[-1], abstract)
        cache = dataclasses.replace(cache, start=jnp.asarray(start))
        # Rows past the prompts repeat the first one (their output is dropped).
        one = [self._sampling(jobs[i] if i < len(jobs) else jobs[0]) for i in range(rows)]
        sampling = jax.tree.map(lambda *a: jnp.asarray(np.concatenate(a)), *one)
        return self.params, jnp.asarray(tokens), cache, sampling

    def batch(self, jobs: list[Job]) -> list[Prefill]:
        """Prefills `jobs` (waiting prompts of one width) in one pass: each one's state, its
        first token drawn and its blocks saved to the prefix cache."""
        rows = batch_prefill.batch_size(len(jobs), self.batch_sizes)
        args = self.batch_args(jobs, rows)
        width = args[1].shape[1]
        (first, logits), cache = self._run("prefill", (width, rows), args)
        first = np.asarray(first)
        tokens = np.asarray(args[1])
        states = []
        for i, job in enumerate(jobs):
            names, _ = self.lookup(job)  # one chunk or less: never read from the pool
            state = Prefill(
                job,
                width,
                cache,
                tokens[i : i + 1],
                first=int(first[i]),
                logits=logits[i : i + 1] if job.logprobs is not None else None,
                source=width - len(job.prompt),
                names=names,
                row=i,
            )
            self.save(state)
            states.append(state)
        return states

    # -- its programs -------------------------------------------------------------------------

    def batch_specs(
        self, dummy: Job, insert_args: Callable[[Prefill, int, int], tuple]
    ) -> list[tuple[str, Any, tuple]]:
        """The batched prefills (each width of one chunk or less, each batch size) and their
        copies into a row (`insert_args`, the scheduler's) and into the prefix cache's pool,
        with example arguments."""
        out = []
        for rows in self.batch_sizes:
            for width in self.prefill_widths:
                if width > self.config.chunk:
                    break
                job = dataclasses.replace(dummy, prompt=[0] * width)
                out.append(("prefill", (width, rows), self.batch_args([job], rows, True)))
            job = dataclasses.replace(dummy, prompt=[0] * self.prefill_widths[0])
            _, tokens, cache, _ = self.batch_args([job], rows, True)
            state = Prefill(job, self.prefill_widths[0], cache, tokens)
            out.append(("insert", cache_key(cache), insert_args(state, 0, len(job.prompt))))
            if self.prefix is not None:
                zero = jnp.int32(0)
                out.append(("save", cache_key(cache), (self.pool, cache, zero, zero, zero)))
        return out

    def prefix_specs(self) -> list[tuple[str, Any, tuple]]:
        """The prefix cache's copies (out of the pool into a slot-long cache, and into the
        pool out of a one-pass or a slot-long one), with example arguments; none without one."""
        if self.prefix is None:
            return []
        t, zero = self.config.max_len, jnp.int32(0)
        big = self.empty_cache(1, t, abstract=True)
        out = [("load", t, (big, self.pool, zero, zero))]
        for slots in sorted({self.prefill_widths[-1], t}):
            src = big if slots == t else self.empty_cache(1, slots, abstract=True)
            out.append(("save", slots, (self.pool, src, zero, zero, zero)))
        return out
