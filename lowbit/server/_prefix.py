"""The prefix cache's bookkeeping: which pool block holds the keys and values of which token
prefix, and which block to reuse when the pool is full.

The pool (see `lowbit.server._programs.save`) holds ``blocks`` blocks of ``size``
token slots each. A prompt's full blocks are named by a chain of digests: block ``i``'s is the
digest of block ``i - 1``'s and its own tokens, so one name stands for the whole prefix up to
the block's end, and a request reuses blocks only while its prompt agrees token for token
from the first.

Blocks are copies: a request copies what it reuses into its own cache, so no request ever
writes a block another reads, and any block may be evicted between two requests. Eviction is
least recently used. A chain is touched from its last block to its first, so a chain's later
blocks are always older than its earlier ones and go first: evicting a block never leaves its
descendants unreachable while its ancestors stay.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

_ROOT = b"lowbit-prefix"


def chain(tokens: Sequence[int], size: int) -> list[bytes]:
    """The names of `tokens`' full blocks of `size` tokens, first to last."""
    ids = np.asarray(tokens, np.int64)
    names, parent = [], _ROOT
    for i in range(len(ids) // size):
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(ids[i * size : (i + 1) * size].tobytes())
        parent = digest.digest()
        names.append(parent)
    return names


@dataclasses.dataclass
class PrefixStats:
    """Counts since start (Prometheus counters, but for `blocks_used`)."""

    queried_tokens: int = 0  # prompt tokens of requests that looked up the cache
    hit_tokens: int = 0  # of those, tokens read from the cache instead of prefilled
    saved_blocks: int = 0
    evictions: int = 0


class PrefixIndex:
    """Which block of the pool holds which prefix (host side only; the scheduler moves the
    data).

    Args:
      blocks: blocks in the pool.
      size: token slots per block.
    """

    def __init__(self, blocks: int, size: int):
        if blocks < 1 or size < 1:
            raise ValueError(f"blocks={blocks} and size={size} must be >= 1")
        self.blocks = blocks
        self.size = size
        self._where: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU first
        self._free = list(range(blocks - 1, -1, -1))
        self.stats = PrefixStats()

    @property
    def used(self) -> int:
        return len(self._where)

    def match(self, names: Sequence[bytes]) -> list[int]:
        """The pool blocks of the longest cached head of `names` (block ids, first to last)."""
        found = []
        for name in names:
            block = self._where.get(name)
            if block is None:
                break
            found.append(block)
        return found

    def touch(self, names: Sequence[bytes]) -> None:
        """Marks the cached blocks among `names` (one chain, first to last) as just used."""
        for name in reversed(names):
            if name in self._where:
                self._where.move_to_end(name)

    def allocate(self, names: Sequence[bytes]) -> list[tuple[int, int]]:
        """Pool blocks for the blocks of `names` (one chain) not cached yet, as
        ``(index in names, block)`` pairs, in order. Evicts least recently used blocks as
        needed, never one of the chain's own; stops at the first block it cannot place so.
        Call `touch` with `names` once the blocks are written."""
        protected = set(names)
        out = []
        for i, name in enumerate(names):
            if name in self._where:
                continue
            if not self._free:
                victim = next((n for n in self._where if n not in protected), None)
                if victim is None:
                    break
                self._free.append(self._where.pop(victim))
                self.stats.evictions += 1
            block = self._free.pop()
            self._where[name] = block
            out.append((i, block))
        self.stats.saved_blocks += len(out)
        return out

    def forget(self, names: Sequence[bytes]) -> None:
        """Drops `names` (blocks whose copy did not complete)."""
        for name in names:
            block = self._where.pop(name, None)
            if block is not None:
                self._free.append(block)
