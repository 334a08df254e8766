"""GPTQ solves spread over the processes of a multi-process (``jax.distributed``) program.

With data-parallel calibration every process ends up with the same summed Gram matrices and
the same weights, so solving every weight's GPTQ rounding on every process repeats the same
Hessian work ``jax.process_count()`` times. Here each weight is given to one process
(`assign`: largest cost first, to the least loaded process), which solves it on its own copy
of the weight and statistics (no collective inside a solve); the results are exchanged in
rounds (each process's r-th weight in round r, one ``allgather`` of bytes per round,
so at most one quantized weight per process is in flight) and placed like the weight, so every
process ends with the same quantized tree, bit for bit the one it would have solved itself.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lowbit._processes import allgather
from lowbit.algorithms._capture import CalibrationError
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
    """Whether this process holds all of `x` on each of its devices: a host array, or an
    array replicated over its devices (over a `NamedSharding` where they span processes)."""
    if not isinstance(x, jax.Array):
        return True
    if spanning_processes(x) and not isinstance(x.sharding, NamedSharding):
        return False
    return x.sharding.is_fully_replicated


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
    """What a process sends for one weight: the QArray's leaves on the host and its report
    lines, or the error it raised (re-raised on every process, so none waits for a missing
    result)."""

    leaves: list[np.ndarray]
    applied: str | None
    notes: list[str]
    error: tuple[str, str] | None = None  # (exception class name, message)


# Exceptions a solve raises that keep their type on the other processes; others arrive as the
# first of these they derive from (RuntimeError if none), their message naming their type.
_ERRORS = {e.__name__: e for e in (ValueError, CalibrationError, TypeError, RuntimeError)}


def _encode(solved: _Solved) -> bytes:
    """`solved` as bytes: an 8-byte header length, a JSON header (report lines, error, each
    leaf's dtype and shape), then each leaf's raw bytes (bit for bit)."""
    leaves = [np.ascontiguousarray(leaf) for leaf in solved.leaves]
    header = json.dumps(
        {
            "applied": solved.applied,
            "notes": solved.notes,
            "error": solved.error,
            "leaves": [[leaf.dtype.name, list(leaf.shape)] for leaf in leaves],
        }
    ).encode()
    return b"".join([len(header).to_bytes(8, "little"), header, *(a.tobytes() for a in leaves)])


def _decode(data: bytes) -> _Solved:
    """The `_Solved` that `_encode` wrote."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n].decode())
    leaves, offset = [], 8 + n
    for name, shape in header["leaves"]:
        dtype = jnp.dtype(name)
        size = int(np.prod(shape)) * dtype.itemsize
        leaves.append(np.frombuffer(data, dtype, int(np.prod(shape)), offset).reshape(shape))
        offset += size
    error = header["error"]
    return _Solved(
        leaves, header["applied"], header["notes"], None if error is None else tuple(error)
    )


def _place_like(weight: Any) -> Callable[[np.ndarray], jax.Array]:
    """Puts a host array where a result for a `held_whole` `weight` would be: replicated over
    the weight's devices (its mesh for a `NamedSharding`); a host weight's on this process's
    default device."""
    if not isinstance(weight, jax.Array):
        return jnp.asarray
    if not isinstance(weight.sharding, NamedSharding):
        return lambda host: jax.device_put(host, weight.sharding)
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
    lengths = allgather(np.asarray(len(payload), np.int64))
    longest = int(np.max(lengths))
    mine = np.zeros(max(longest, 1), np.uint8)
    mine[: len(payload)] = np.frombuffer(payload, np.uint8)
    gathered = allgather(mine)
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
      template: ``template(path)``: a QArray with the structure of the solve's result (its
        rounding to nearest, on this process's copy).
    """

    def __init__(
        self,
        paths: Sequence[str],
        costs: Sequence[float],
        solve: Callable[[str, Context], QArray],
        ctx: Context,
        weights: Callable[[str], Any],
        template: Callable[[str], QArray],
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
        self.template = template
        self.treedefs: dict[str, Any] = {}  # of the weights solved here
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
            kind, message = solved.error
            raise _ERRORS.get(kind, RuntimeError)(message)
        if solved.applied is not None:
            self.ctx.report.applied[path] = solved.applied
        self.ctx.report.notes += solved.notes
        self.ctx.report.solved_by[path] = self.owner[path]
        place = _place_like(self.weights(path))
        # The solve returns its rounding-to-nearest QArray with new codes: that QArray's
        # structure, which every process can make for itself.
        treedef = self.treedefs.pop(path, None)
        if treedef is None:
            with _no_mesh():
                treedef = jax.tree.structure(self.template(path))
        return jax.tree.unflatten(treedef, [place(leaf) for leaf in solved.leaves])

    def _round(self) -> None:
        r = self.rounds
        self.rounds += 1
        queue = self.queues[self.me]
        payload = b""
        if r < len(queue):
            payload = _encode(self._solve_one(queue[r]))
        for p, data in enumerate(_allgather_bytes(payload)):
            if r < len(self.queues[p]):
                self.done[self.queues[p][r]] = _decode(data)

    def _solve_one(self, path: str) -> _Solved:
        before = self.ctx.report.applied.get(path)
        report = AlgorithmReport(applied={} if before is None else {path: before})
        try:
            # Out of the caller's mesh context: the local copies live on one device of this
            # process, which a context mesh spanning processes would refuse.
            with _no_mesh():
                q = self.solve(path, local_context(self.ctx, report))
        except Exception as error:  # noqa: BLE001 - re-raised on every process
            message = f"{error} (raised on process {self.me}, which solved {path!r})"
            known = [c.__name__ for c in type(error).__mro__ if c.__name__ in _ERRORS]
            kind = known[0] if known else "RuntimeError"
            if kind != type(error).__name__:
                message = f"{type(error).__name__}: {message}"
            return _Solved([], None, [], (kind, message))
        self.treedefs[path] = jax.tree.structure(q)
        leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(q)]
        return _Solved(leaves, report.applied.get(path), report.notes)


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

    label = name.encode()[:64].ljust(64, b"\0")
    mine = np.frombuffer(digest(text) + label, np.uint8)
    gathered = allgather(mine)
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
    template: Callable[[str], QArray],
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
      solve, template: as for `SpreadSolves`.
    """
    if jax.process_count() == 1 or ctx.statistics is None:
        return None
    if not stats_span_processes(ctx.statistics, paths):
        return None
    chosen = [p for p in paths if held_whole(weights(p)) and stats_held_whole(ctx.statistics, p)]
    base = ctx.statistics.base if isinstance(ctx.statistics, Rescaled) else ctx.statistics
    costs = [gptq_cost(np.shape(weights(p)), base.for_path(p)) for p in chosen]
    return SpreadSolves(chosen, costs, solve, ctx, weights, template) if chosen else None
