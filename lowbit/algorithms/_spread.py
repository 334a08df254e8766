"""GPTQ solves spread over the processes of a multi-process (``jax.distributed``) program.

With data-parallel calibration every process ends up with the same summed Gram matrices and
the same weights, so solving every weight's GPTQ rounding on every process repeats the same
Hessian work ``jax.process_count()`` times. Here each weight is given to one process
(`assign`: largest cost first, to the least loaded process), which solves it on its own copy
of the weight and statistics (no collective inside a solve); the results are exchanged in
rounds (each process's r-th weight in round r, one ``process_allgather`` of bytes per round,
so at most one quantized weight per process is in flight) and placed like the weight, so every
process ends with the same quantized tree, bit for bit the one it would have solved itself.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lowbit.algorithms._rounding import AlgorithmReport, Context, Rescaled
from lowbit.qarray import QArray


def assign(costs: Sequence[float], processes: int) -> list[int]:
    """Deterministic balanced assignment of jobs to processes.

    Jobs go largest cost first (ties: lower index first) to the process with the least cost so
    far (ties: lower process index): every process computes the same answer from the same costs.

    Args:
      costs: [jobs] nonnegative cost of each job.
      processes: number of processes (>= 1).
    Returns:
      [jobs] the process index of each job.
    """
    if processes < 1:
        raise ValueError(f"processes={processes!r}: accepted an int >= 1")
    load = [0.0] * processes
    owner = [0] * len(costs)
    for job in sorted(range(len(costs)), key=lambda j: (-float(costs[j]), j)):
        p = min(range(processes), key=lambda i: (load[i], i))
        owner[job] = p
        load[p] += float(costs[job])
    return owner


def gptq_cost(shape: Sequence[int], stats: Sequence[Any]) -> float:
    """Work of GPTQ on a parameter of `shape`: rows x inputs² per stats entry (one matrix each:
    a stacked layer or an expert), the order of the column updates."""
    size = float(np.prod(shape))
    total = 0.0
    for s in stats:
        held = float(np.prod([shape[axis] for axis, _ in s.fixed])) if s.fixed else 1.0
        total += size / held * float(s.gram.shape[0])  # (rows = size / held / K) x K²
    return total


def spanning_processes(x: Any) -> bool:
    """Whether `x` is a `jax.Array` whose devices are not all this process's."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def held_whole(x: Any) -> bool:
    """Whether this process holds all of `x`: a host array, an array on its own devices, or
    one replicated (over a `NamedSharding`) on every process."""
    if not spanning_processes(x):
        return True
    return isinstance(x.sharding, NamedSharding) and x.sharding.is_fully_replicated


def local_copy(x: Any) -> Any:
    """`x` on this process only: a replicated array spanning processes becomes its copy on one
    of this process's devices (computing on it runs no collective); anything else as it is."""
    if spanning_processes(x):
        return x.addressable_data(0)
    return x


class _LocalStatistics:
    """`Statistics` whose arrays are this process's copies (`local_copy`)."""

    def __init__(self, statistics: Any):
        self.base = statistics
        self.unmapped = statistics.unmapped

    def read_order(self) -> list[str]:
        return self.base.read_order()

    def for_path(self, path: str) -> list:
        return [
            dataclasses.replace(
                s,
                gram=local_copy(s.gram),
                abs_sum=local_copy(s.abs_sum),
                abs_max=local_copy(s.abs_max),
            )
            for s in self.base.for_path(path)
        ]


def local_statistics(statistics: Any) -> Any:
    """`statistics` reading this process's copies; a `Rescaled` view is rescaled locally too
    (dividing an array that spans processes would be a collective only one process runs)."""
    if isinstance(statistics, Rescaled):
        local = copy.copy(statistics)
        local.base = _LocalStatistics(statistics.base)
        local.scale = {p: local_copy(s) for p, s in statistics.scale.items()}
        return local
    return _LocalStatistics(statistics)


def stats_held_whole(statistics: Any, path: str) -> bool:
    """Whether this process holds every statistic of `path` whole (`held_whole`), so that it can
    solve it alone; read without computing anything."""
    base = statistics.base if isinstance(statistics, Rescaled) else statistics
    arrays = [a for s in base.for_path(path) for a in (s.gram, s.abs_sum, s.abs_max)]
    if isinstance(statistics, Rescaled) and path in statistics.scale:
        arrays.append(statistics.scale[path])
    return all(held_whole(a) for a in arrays)


def stats_span_processes(statistics: Any, paths: Sequence[str]) -> bool:
    """Whether the statistics of `paths` were summed across processes (data-parallel capture:
    every process is in this calibration together)."""
    if jax.process_count() == 1 or statistics is None:
        return False
    base = statistics.base if isinstance(statistics, Rescaled) else statistics
    return any(spanning_processes(s.gram) for p in paths for s in base.for_path(p))


def local_context(ctx: Context, report: AlgorithmReport) -> Context:
    """`ctx` for one process's own solves: local statistics, its own report to fill."""
    return Context(local_statistics(ctx.statistics), report, ctx.strict, ctx.factors)


@dataclasses.dataclass(frozen=True)
class _Solved:
    """What a process sends for one weight: the QArray's host arrays and its report lines, or
    the error it raised (re-raised on every process, so none waits for a missing result)."""

    qarray: QArray | None
    applied: str | None
    notes: list[str]
    error: BaseException | None = None


def _place_like(weight: Any) -> Callable[[np.ndarray], jax.Array]:
    """Puts a host array where a result for `weight` would be: replicated over the weight's
    mesh when the weight spans processes, else on this process's default device."""
    if not spanning_processes(weight):
        return jnp.asarray
    mesh = weight.sharding.mesh

    def place(host: np.ndarray) -> jax.Array:
        sharding = NamedSharding(mesh, PartitionSpec(*([None] * host.ndim)))
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return place


def _no_mesh():
    """A context without a mesh (`jax.set_mesh(None)`), where this JAX has meshes in context."""
    return jax.set_mesh(None) if hasattr(jax, "set_mesh") else contextlib.nullcontext()


def _allgather_bytes(payload: bytes) -> list[bytes]:
    """Every process's `payload` (lengths first, then the bytes padded to the longest)."""
    from jax.experimental import multihost_utils

    lengths = multihost_utils.process_allgather(np.asarray(len(payload), np.int64))
    longest = int(np.max(lengths))
    mine = np.zeros(max(longest, 1), np.uint8)
    mine[: len(payload)] = np.frombuffer(payload, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(mine))
    return [gathered[p, : int(n)].tobytes() for p, n in enumerate(lengths)]


class SpreadSolves:
    """Solves a set of weights with each process solving its share (see the module doc).

    Every process must create it with the same `paths` and `costs` and ask for the results
    (`result`) in the same order: the exchanges are collectives.

    Args:
      paths: the weights to spread, in the order they will be asked for.
      costs: [paths] their costs (`gptq_cost`).
      solve: ``solve(path, ctx) -> QArray`` on this process's copies, filling ``ctx.report``.
      ctx: the calibration context (statistics, report, strict, factor cache).
      weights: ``weights(path)``: the float weight (where results are placed like it).
    """

    def __init__(
        self,
        paths: Sequence[str],
        costs: Sequence[float],
        solve: Callable[[str, Context], QArray],
        ctx: Context,
        weights: Callable[[str], Any],
    ):
        self.processes = jax.process_count()
        self.me = jax.process_index()
        owner = assign(costs, self.processes)
        self.owner = dict(zip(paths, owner, strict=True))
        self.queues = [
            [p for p, o in zip(paths, owner, strict=True) if o == i] for i in range(self.processes)
        ]
        self.rounds = 0
        self.solve = solve
        self.ctx = ctx
        self.weights = weights
        self.done: dict[str, _Solved] = {}

    def __contains__(self, path: str) -> bool:
        return path in self.owner

    def result(self, path: str) -> QArray:
        """The QArray of `path`, running exchange rounds until it has arrived; its report
        lines are written into ``ctx.report``. Raises what the solving process raised."""
        while path not in self.done:
            self._round()
        solved = self.done.pop(path)
        if solved.error is not None:
            raise solved.error
        if solved.applied is not None:
            self.ctx.report.applied[path] = solved.applied
        self.ctx.report.notes += solved.notes
        self.ctx.report.solved_by[path] = self.owner[path]
        place = _place_like(self.weights(path))
        return jax.tree.map(place, solved.qarray)

    def _round(self) -> None:
        r = self.rounds
        self.rounds += 1
        queue = self.queues[self.me]
        payload = b""
        if r < len(queue):
            payload = pickle.dumps(self._solve_one(queue[r]))
        # Peers of one SPMD program: the bytes are what the same code pickled on another
        # process of this run.
        for p, data in enumerate(_allgather_bytes(payload)):
            if r < len(self.queues[p]):
                self.done[self.queues[p][r]] = pickle.loads(data)

    def _solve_one(self, path: str) -> _Solved:
        before = self.ctx.report.applied.get(path)
        report = AlgorithmReport(applied={} if before is None else {path: before})
        try:
            # Out of the caller's mesh context: the local copies live on one device of this
            # process, which a context mesh spanning processes would refuse.
            with _no_mesh():
                q = self.solve(path, local_context(self.ctx, report))
        except Exception as error:  # noqa: BLE001 - re-raised on every process
            note = f" (raised on process {self.me}, which solved {path!r})"
            try:
                error = type(error)(f"{error}{note}")
            except Exception:  # noqa: BLE001 - an exception type taking other arguments
                error = RuntimeError(f"{type(error).__name__}: {error}{note}")
            return _Solved(None, None, [], error)
        host = jax.tree.map(np.asarray, q)
        return _Solved(host, report.applied.get(path), report.notes)


def digest(text: str) -> bytes:
    """16-byte digest of `text` (what processes compare to agree on a recipe)."""
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def check_same_everywhere(what: str, name: str, text: str, fix: str) -> None:
    """Raises unless every process passes the same `text` (compared by digest; a collective:
    every process must call it).

    Args:
      what: what is compared, for the message ("recipe").
      name: this process's short name for it (shown per process, at most 64 bytes kept).
      text: its full text (e.g. the recipe's JSON).
      fix: the remedy, for the message.
    Raises:
      ValueError: naming each process that disagrees with process 0 and both names.
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    label = name.encode()[:64].ljust(64, b"\0")
    mine = np.frombuffer(digest(text) + label, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(mine))
    digests = [bytes(row[:16]) for row in gathered]
    names = [bytes(row[16:]).rstrip(b"\0").decode(errors="replace") for row in gathered]
    differ = [p for p in range(len(digests)) if digests[p] != digests[0]]
    if differ:
        lines = "; ".join(
            f"process {p} has {what} {names[p]!r} (digest {digests[p].hex()[:12]}"
            f"{', the same name with other settings' if names[p] == names[0] else ''})"
            for p in differ
        )
        raise ValueError(
            f"the processes disagree on the {what}: process 0 has {what} {names[0]!r} (digest "
            f"{digests[0].hex()[:12]}); {lines}; {fix}"
        )


def plan_spread(
    paths: Sequence[str],
    ctx: Context,
    weights: Callable[[str], Any],
    solve: Callable[[str, Context], QArray],
) -> SpreadSolves | None:
    """The GPTQ weights among `paths` to spread over the processes, or None where nothing is.

    Spread only in a program of several processes whose statistics were summed across them
    (every process is in this calibration together), and only weights this process holds
    whole together with their statistics (a weight split over processes is solved by all of
    them, as before).

    Args:
      paths: GPTQ weights in the order their results will be asked for.
      ctx: the calibration context.
      weights: ``weights(path)``: the float weight.
      solve: as for `SpreadSolves`.
    """
    if jax.process_count() == 1 or ctx.statistics is None:
        return None
    if not stats_span_processes(ctx.statistics, paths):
        return None
    chosen = [p for p in paths if held_whole(weights(p)) and stats_held_whole(ctx.statistics, p)]
    base = ctx.statistics.base if isinstance(ctx.statistics, Rescaled) else ctx.statistics
    costs = [gptq_cost(np.shape(weights(p)), base.for_path(p)) for p in chosen]
    return SpreadSolves(chosen, costs, solve, ctx, weights) if chosen else None
