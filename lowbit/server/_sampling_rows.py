"""Each slot's sampling settings, kept on the host and handed to the decode programs.

A row's settings (seed, temperature, top-k, top-p, penalties, logit bias, grammar mask) are
written when a request takes the slot and cleared when it leaves; `device()` gives them as the
`RowSampling` of every slot. The large per-row inputs (the bias ``[V]`` and the grammar's bits
``[V / 32]``) are uploaded again only after a row changed (`DeviceRows`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.server import _programs as programs
from lowbit.server._job import Job
from lowbit.server._programs import RowSampling


class DeviceRows:
    """A ``[rows, n]`` host array kept on the device too, uploaded again only after a row
    changed: per-row sampling inputs that change when a request starts or ends, or for a few
    rows a step (a grammar's mask)."""

    def __init__(self, default: np.ndarray, rows: int):
        self.default = default
        self.host = np.tile(default, (rows, 1))
        self._device: jax.Array | None = None

    def set(self, r: int, row: np.ndarray | None = None) -> None:
        """Row `r` becomes `row` (None: the default)."""
        row = self.default if row is None else row
        if not np.array_equal(self.host[r], row):
            self.host[r] = row
            self._device = None

    def device(self) -> jax.Array:
        """The rows on the device."""
        if self._device is None:
            self._device = jnp.asarray(self.host)
        return self._device


class SamplingRows:
    """The sampling settings of `slots` rows over a vocabulary of `vocab` tokens.

    Attributes:
      count: each row's tokens sampled so far (the first one's sampling differs).
      counts: ``[slots, vocab]`` int32 on the device, each row's generated tokens counted
        (the penalties', `lowbit.server._penalties`); the decode programs return it updated.
      bias, allowed: each row's logit bias and its grammar's bits (`DeviceRows`).
    """

    def __init__(self, slots: int, vocab: int):
        self.keys = np.zeros((slots, 2), np.uint32)
        self.count = np.zeros((slots,), np.int32)
        self.temperature = np.zeros((slots,), np.float32)
        self.top_k = np.zeros((slots,), np.int32)
        self.top_p = np.ones((slots,), np.float32)
        self.presence = np.zeros((slots,), np.float32)
        self.frequency = np.zeros((slots,), np.float32)
        self.counts = jnp.zeros((slots, vocab), jnp.int32)
        self.bias = DeviceRows(np.zeros((vocab,), np.float32), slots)
        self.allowed = DeviceRows(programs.allowed_bits(-(-vocab // 32), vocab), slots)

    def job_bias(self, job: Job) -> np.ndarray | None:
        """``[V]`` float32: what `job` adds to its logits (its `logit_bias`), or None."""
        if not job.logit_bias:
            return None
        row = self.bias.default.copy()
        for token, bias in job.logit_bias:
            row[token] += bias
        return row

    def job_allowed(self, job: Job) -> np.ndarray:
        """`job`'s next token's mask (`RowSampling.allowed`): its grammar's, or all."""
        return self.allowed.default if job.constraint is None else job.constraint.bits

    def one(self, job: Job) -> RowSampling:
        """`job`'s settings as a `RowSampling` of one row, before its first token (a
        prefill's sampling)."""
        key = jax.random.key_data(jax.random.key(job.seed))
        bias = self.job_bias(job)
        if bias is None:
            bias = self.bias.default
        return RowSampling(
            keys=jnp.asarray(key)[None],
            count=jnp.zeros((1,), jnp.int32),
            temperature=jnp.asarray([job.temperature], jnp.float32),
            top_k=jnp.asarray([job.top_k], jnp.int32),
            top_p=jnp.asarray([job.top_p], jnp.float32),
            presence=jnp.asarray([job.presence_penalty], jnp.float32),
            frequency=jnp.asarray([job.frequency_penalty], jnp.float32),
            bias=jnp.asarray(bias)[None],
            allowed=jnp.asarray(self.job_allowed(job))[None],
        )

    def place(self, r: int, job: Job) -> None:
        """Row `r` takes `job`'s settings, its first token sampled."""
        self.keys[r] = np.asarray(jax.random.key_data(jax.random.key(job.seed)))
        self.count[r] = 1
        self.temperature[r] = job.temperature
        self.top_k[r] = job.top_k
        self.top_p[r] = job.top_p
        self.presence[r] = job.presence_penalty
        self.frequency[r] = job.frequency_penalty
        self.bias.set(r, self.job_bias(job))
        self.allowed.set(r, self.job_allowed(job))

    def clear(self, r: int) -> None:
        """Row `r` back to greedy with no penalty, bias or mask (its job left)."""
        self.temperature[r] = 0.0
        self.top_k[r] = 0
        self.presence[r] = self.frequency[r] = 0.0
        self.bias.set(r)
        self.allowed.set(r)

    def device(self) -> RowSampling:
        """Every row's settings, as the decode programs take them."""
        return RowSampling(
            keys=jnp.asarray(self.keys),
            count=jnp.asarray(self.count),
            temperature=jnp.asarray(self.temperature),
            top_k=jnp.asarray(self.top_k),
            top_p=jnp.asarray(self.top_p),
            presence=jnp.asarray(self.presence),
            frequency=jnp.asarray(self.frequency),
            bias=self.bias.device(),
            allowed=self.allowed.device(),
        )
