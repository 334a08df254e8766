"""Calibration statistics per weight, streamed from the engine's probe.

`capture` runs the float model on calibration batches through `lowbit.engine.probe` (the same
interpreter that serves quantized models; the walk `lowbit.calibrate` shares, `_walk`) and,
at every matmul that reads a wanted weight, accumulates in float32, over the weight's
contracted (input) axes:

  * the Gram matrix ``XᵀX`` (GPTQ's Hessian up to a factor), [K, K];
  * the per-input-channel sum of |x| and max |x| (AWQ, SmoothQuant), [K];
  * optionally a bounded sample of input rows, [<= sample_rows, K] (output-error searches).

Memory is O(K²) per weight; activations are never kept. The input axes are found by mapping the
weight operand's layout back to the parameter (`Use.weight_indices`), so transposed, reshaped
(einsum weights with several contracted axes) and stacked weights are handled: a parameter
indexed at one position of an axis by its use (a `scan` step over stacked layers, a slice of a
stacked table) gets one set of statistics per index (`WeightStats.fixed`). A tied embedding
gets statistics from its matmul use; its lookup (a gather) has no activation.

Routed experts (a ``[experts, in, out]`` weight read by ``ragged_dot(rows, W, group_sizes)``,
rows grouped by expert) get one set of statistics per expert, keyed like a stacked weight
(``fixed = ((0, e),)``, input axis 1): expert `e`'s statistics count only its rows
(``offset_e .. offset_e + size_e``), so an expert that received no row has ``count == 0``
and zero sums (`WeightStats.ragged` marks them). The per-expert Gram matrices are one
ragged matmul (``rowsᵀ rows`` ragged over the rows), so this costs what one dense Gram does.
A ``row_mask`` does not apply to the routed rows (they are (token, expert) pairs, not
positions).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lowbit._processes import allgather
from lowbit.algorithms._walk import activation_rows, batch_args, kept_rows, walk_batch
from lowbit.engine import Use
from lowbit.recipes import param_leaves

Key = tuple[str, tuple[tuple[int, int], ...]]


class CalibrationError(ValueError):
    """Calibration data that cannot give usable statistics (the message names the layer)."""


@dataclasses.dataclass
class WeightStats:
    """Statistics of the inputs of one weight (or one layer of a stacked weight).

    Attributes:
      path: the parameter path.
      input_axes: parameter axes the inputs are contracted with, flattened row-major into K.
      fixed: ``((axis, index), ...)`` parameter axes held at one index (stacked layers).
      gram: [K, K] float32 sum of ``xᵀx`` over all input rows.
      abs_sum: [K] float32 sum of |x|.
      abs_max: [K] float32 max |x|.
      count: input rows seen.
      sample: [n <= sample_rows, K] float32 input rows, or None.
      activation_scale: the parameters that could absorb a per-channel scale of every input
        row, ``frozenset({(path, axis), ...})``: a norm's 1-D scale (axis 0), or a linear
        layer's weight and its output axis (`lowbit.engine.Scaled`); None if there is none.
      ragged: the statistics of one group of a `ragged_dot` (one expert, ``fixed`` its
        index): only the rows routed to it, possibly none.
    """

    path: str
    input_axes: tuple[int, ...]
    fixed: tuple[tuple[int, int], ...]
    gram: jax.Array
    abs_sum: jax.Array
    abs_max: jax.Array
    count: int = 0
    sample: np.ndarray | None = None
    activation_scale: frozenset[tuple[str, int]] | None = None
    ragged: bool = False

    @property
    def abs_mean(self) -> jax.Array:
        return self.abs_sum / max(self.count, 1)


def single_matrix_use(stats: list[WeightStats]) -> bool:
    """Whether a weight's statistics are one use as a plain matrix (one input axis, no stacked
    layer index): what per-input-channel scales and the clip search need."""
    return len(stats) == 1 and not stats[0].fixed and len(stats[0].input_axes) == 1


def expert_use(stats: list[WeightStats]) -> bool:
    """Whether a weight's statistics are one use as routed experts: one set per expert
    ``e = 0 .. E-1`` (``fixed == ((0, e),)``, input axis 1 of a ``[E, in, out]`` weight), all
    of one `ragged_dot` (the same scale sources)."""
    if not stats or not all(s.ragged and s.input_axes == (1,) for s in stats):
        return False
    experts = sorted(s.fixed for s in stats)
    return experts == [((0, e),) for e in range(len(stats))] and (
        len({s.activation_scale for s in stats}) == 1
    )


@dataclasses.dataclass
class Statistics:
    """What `capture` measured: per (path, fixed index) stats, and uses it could not map.

    Attributes:
      weights: {(path, fixed): WeightStats}.
      unmapped: {path: reason} for uses whose input axes could not be mapped to the parameter
        (e.g. a batched matmul over the weight, a conv); those uses add no statistics.
      escaped: parameters also read by ops other than matmuls / gathers, and parameters whose
        scaled output (`lowbit.engine.Scaled`) is: a scale folded into them would change the
        model.
      scale_readers: {path of a `Scaled` source: weights reading an activation it can scale}.
      reader_axes: {path: {input axis, ...}} of every parameter reading a `Scaled`
        activation as a plain matrix (no stacked index; -1 for any other use): a parameter
        left in float can take a folded scale along that axis (a router).
      reader_scales: {path: {activation_scale of each matmul use}} (None for an input that
        nothing can scale).
      read_directly: parameters read by ops other than matmuls / gathers themselves.
      batches: number of batches run.
      rows: input rows per batch at the first captured activation.
    """

    weights: dict[Key, WeightStats] = dataclasses.field(default_factory=dict)
    unmapped: dict[str, str] = dataclasses.field(default_factory=dict)
    escaped: set[str] = dataclasses.field(default_factory=set)
    scale_readers: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    reader_axes: dict[str, set[int]] = dataclasses.field(default_factory=dict)
    reader_scales: dict[str, set] = dataclasses.field(default_factory=dict)
    read_directly: set[str] = dataclasses.field(default_factory=set)
    batches: int = 0
    rows: list[int] = dataclasses.field(default_factory=list)

    def for_path(self, path: str) -> list[WeightStats]:
        return [s for (p, _), s in self.weights.items() if p == path]

    def read_order(self) -> list[str]:
        """The measured paths in the order the model first read them."""
        return list(dict.fromkeys(p for p, _ in self.weights))


@dataclasses.dataclass(frozen=True)
class _Mapping:
    input_axes: tuple[int, ...]
    fixed: tuple[tuple[int, int], ...]
    order: np.ndarray | None  # activation column for each parameter input index (None: identity)


def _varies(c: np.ndarray, axis: int) -> bool:
    first = np.take(c, [0], axis=axis)
    return bool((c != first).any())


def _map_use(use: Use, shape: tuple[int, ...]) -> _Mapping | str:
    """How the contracted axes of the weight operand map to the parameter's axes, or why not."""
    (lc, rc), (lb, rb) = use.params["dimension_numbers"]
    w_contract, w_batch = (rc, rb) if use.weight_operand == 1 else (lc, lb)
    if w_batch:
        return "the weight has batch dimensions in its matmul"
    return _map_ids(np.asarray(use.weight_indices(shape)), tuple(w_contract), shape)


def _ragged_mappings(use: Use, shape: tuple[int, ...]) -> tuple[_Mapping, ...] | str:
    """One `_Mapping` per group of a ``ragged_dot(rows [m, k], W [g, k, n], sizes)``."""
    dims = use.params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = dims.dot_dimension_numbers
    standard = (
        use.weight_operand == 1
        and (tuple(lc), tuple(rc), tuple(lb), tuple(rb)) == ((1,), (1,), (), ())
        and tuple(dims.lhs_ragged_dimensions) == (0,)
        and tuple(dims.rhs_group_dimensions) == (0,)
        and np.ndim(use.activation) == 2
        and use.group_sizes is not None
    )
    if not standard:
        return (
            "ragged_dot with other dimension numbers than rows [m, k] grouped along m and "
            "weight [groups, k, n]"
        )
    ids = np.asarray(use.weight_indices(shape))
    out = []
    for e in range(ids.shape[0]):
        mapping = _map_ids(ids[e], (0,), shape)
        if isinstance(mapping, str):
            return f"group {e}: {mapping}"
        out.append(mapping)
    if len({None if m.order is None else m.order.tobytes() for m in out}) != 1:
        return "the groups of the ragged_dot read their inputs in different orders"
    return tuple(out)


def _map_ids(ids: np.ndarray, w_contract: tuple[int, ...], shape: tuple[int, ...]):
    """`_map_use` on the weight operand's parameter indices `ids`, contracted on `w_contract`."""
    free = [a for a in range(ids.ndim) if a not in w_contract]
    kc = int(np.prod([ids.shape[a] for a in w_contract]))
    table = np.transpose(ids, [*w_contract, *free]).reshape(kc, -1)
    if table.size > 1 << 22:  # large tables: check a strided subset of rows and columns
        table = table[:: max(1, table.shape[0] // 256), :: max(1, table.shape[1] // 256)]
        full_k = False
    else:
        full_k = True
    coords = np.unravel_index(table, shape)
    input_axes, fixed = [], []
    for axis, c in enumerate(coords):
        along_k, along_free = _varies(c, 0), _varies(c, 1)
        if along_k and along_free:
            return f"parameter axis {axis} is spread over contracted and free axes of the matmul"
        if along_k:
            input_axes.append(axis)
        elif not along_free and shape[axis] > 1:
            fixed.append((axis, int(c.flat[0])))
    k = int(np.prod([shape[a] for a in input_axes]))
    if k != kc:
        return f"the matmul contracts {kc} elements of a {k}-element input slice of the parameter"
    if not full_k:
        table = np.transpose(ids, [*w_contract, *free]).reshape(kc, -1)[:, :1]
        coords = np.unravel_index(table, shape)
    flat = np.ravel_multi_index(
        [coords[a][:, 0] for a in input_axes], [shape[a] for a in input_axes]
    )
    if len(np.unique(flat)) != kc:
        return "the matmul reads some parameter inputs twice"
    order = None if np.array_equal(flat, np.arange(kc)) else np.argsort(flat)
    return _Mapping(tuple(input_axes), tuple(fixed), order)


def _rows(use: Use, mapping: _Mapping) -> tuple[jax.Array, tuple[int, ...]]:
    """`activation_rows` with the columns in the parameter's input order."""
    x, row_shape = activation_rows(use)
    return (x if mapping.order is None else x[:, mapping.order]), row_shape


def _replicated(rows: jax.Array) -> NamedSharding | None:
    """A replicated output sharding for a sum over `rows` split over devices on a mesh with
    explicit axes (data-parallel calibration: each process's rows, one global Gram), else None
    (the compiler chooses)."""
    sharding = getattr(jax.typeof(rows), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None or not any(spec):
        return None
    return NamedSharding(sharding.mesh, PartitionSpec())


def _on_host(x: jax.Array) -> np.ndarray:
    """`x` in this process's memory. Rows split over processes (data-parallel calibration) are
    gathered: a sample of activation rows, small, and the same in every process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return allgather(x, tiled=True)
    return np.asarray(x)


def _increment(use: Use, mapping: _Mapping, mask: jax.Array | None, sample_rows: int) -> tuple:
    """One batch's (gram, abs sum, abs max, finite, sample, valid sample rows, count) of a
    `dot_general` activation (the rows `mask` keeps)."""
    rows, row_shape = _rows(use, mapping)
    count = jnp.asarray(rows.shape[0], jnp.int32)
    keep = kept_rows(mask, row_shape)
    if keep is not None:
        rows = jnp.where(keep[:, None], rows, 0.0)
        count = jnp.sum(keep, dtype=jnp.int32)
    finite = jnp.all(jnp.isfinite(rows))  # of the rows that count
    a = jnp.abs(rows)
    gram = jnp.dot(
        rows.T, rows, precision=jax.lax.Precision.HIGHEST, out_sharding=_replicated(rows)
    )
    # Evenly spaced rows (a batch's first rows are one sequence's start), half the sample from
    # each of the first two batches: more sequences in it (a single batch gives half a
    # sample). Masked rows go last.
    stride = max(1, rows.shape[0] // max(-(-sample_rows // 2), 1))
    sample = valid = None
    if sample_rows:
        sample = rows[::stride]
        valid = jnp.asarray(sample.shape[0], jnp.int32)
        if keep is not None:
            sample = sample[jnp.argsort(~keep[::stride], stable=True)]
            valid = jnp.sum(keep[::stride], dtype=jnp.int32)
        sample = sample[:sample_rows]
    return gram, a.sum(0), a.max(0), finite, sample, valid, count


# ``rowsᵀ rows`` per group: contract the rows, ragged along them.
_GROUP_GRAM = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
)


def _ragged_increments(use: Use, mapping: _Mapping, sample_rows: int) -> list[tuple]:
    """`_increment` per group of a ``ragged_dot(rows [m, k], W [g, k, n], sizes)``: group `e`
    counts rows ``offset_e .. offset_e + sizes[e]`` only (rows past ``sum(sizes)`` none)."""
    x = jnp.asarray(use.activation, jnp.float32)
    if mapping.order is not None:
        x = x[:, mapping.order]
    m = x.shape[0]
    sizes = jnp.maximum(jnp.asarray(use.group_sizes, jnp.int32), 0)
    g = sizes.shape[0]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    group = jnp.searchsorted(ends, jnp.arange(m), side="right")  # g for rows past the groups
    grams = jax.lax.ragged_dot_general(
        x, x, sizes, _GROUP_GRAM, precision=jax.lax.Precision.HIGHEST
    )
    a = jnp.abs(x)
    abs_sum = jax.ops.segment_sum(a, group, num_segments=g)
    abs_max = jnp.maximum(jax.ops.segment_max(a, group, num_segments=g), 0.0)  # -inf if empty
    count = jax.ops.segment_sum(jnp.ones(m, jnp.int32), group, num_segments=g)
    bad = jax.ops.segment_max(
        (~jnp.all(jnp.isfinite(x), axis=1)).astype(jnp.int32), group, num_segments=g
    )
    out = []
    for e in range(g):
        sample = valid = None
        if sample_rows:
            # Evenly spaced rows of the group, as for a dense activation.
            n = min(max(-(-sample_rows // 2), 1), m)
            stride = jnp.maximum(1, count[e] // n)
            index = starts[e] + jnp.arange(n) * stride
            valid = jnp.sum(index < ends[e], dtype=jnp.int32)
            sample = x[jnp.clip(index, 0, m - 1)][:sample_rows]
        out.append((grams[e], abs_sum[e], abs_max[e], bad[e] <= 0, sample, valid, count[e]))
    return out


@dataclasses.dataclass
class _Site:
    """One activation read by one or more wanted weights (q, k and v read the same one)."""

    rows: int
    location: str
    keys: list[Key]


def capture(
    fn: Callable[..., Any],
    params: Any,
    batches: Iterable[Any],
    *,
    paths: Sequence[str] | None = None,
    sample_rows: int = 0,
    row_mask: Callable[..., Any] | None = None,
    on_batch: Callable[[int], None] | None = None,
) -> Statistics:
    """Streams input statistics of the wanted weights over calibration batches.

    The probe walk of one batch, with the statistics' updates, is compiled once (`jax.jit`)
    and run per batch; statistics of an activation shared by several weights are stored once.

    Args:
      fn: ``fn(params, *batch)`` (a batch that is not a tuple is one argument). Batches
        should share one shape (each new shape compiles the step again).
      params: float params pytree.
      batches: iterable of batches.
      paths: parameter paths to measure (default: every parameter with 2+ axes).
      sample_rows: keep up to this many input rows per weight (0: none), evenly spaced over
        the first batch (and the next ones if it has fewer).
      row_mask: ``row_mask(*batch) -> [*row_shape]`` nonzero for the positions that count,
        e.g. ``lambda tokens, mask: mask`` for a padded encoder batch: rows of an activation
        whose non-contracted axes have that shape (``[batch, seq, hidden]`` inputs of
        ``[batch, seq]`` masks) enter the statistics only where the mask is set, so padded
        positions, which run through the model like tokens, do not. Activations of other
        shapes count every row.
      on_batch: called with the number of batches done after each batch (progress).
    Returns:
      `Statistics`.
    Raises:
      CalibrationError: for no batches, or NaN/Inf in the inputs of a weight (naming the
        weight, the op's source line and the batch).
    """
    shapes = {path: tuple(np.shape(leaf)) for path, leaf in param_leaves(params)}
    wanted = set(paths) if paths is not None else {p for p, s in shapes.items() if len(s) >= 2}
    stats = Statistics()
    mappings: dict[tuple[str, Any], _Mapping | str] = {}
    meta: dict[str, Any] = {}  # of the last trace: sites and what each key is

    def mapping_of(use: Use, path: str) -> Any:
        dims = use.params.get("dimension_numbers", use.params.get("ragged_dot_dimension_numbers"))
        cache_key = (path, use.layout_key, dims, use.weight_operand, use.op)
        if cache_key not in mappings:
            if use.op == "ragged_dot":
                mappings[cache_key] = _ragged_mappings(use, shapes[path])
            else:
                mappings[cache_key] = _map_use(use, shapes[path])
        return mappings[cache_key]

    def reader_axis(use: Use, path: str) -> int:
        """The input axis of a plain-matrix use of `path` (-1 for any other use)."""
        if use.op != "dot_general" or len(shapes[path]) != 2:
            return -1
        mapping = mapping_of(use, path)
        if isinstance(mapping, str) or mapping.fixed or mapping.order is not None:
            return -1
        return mapping.input_axes[0] if len(mapping.input_axes) == 1 else -1

    def increments(params, args):
        sites: list[_Site] = []
        site_index: dict[Any, int] = {}
        key_info: dict[Key, tuple[str, tuple[int, ...], tuple]] = {}
        values: list[Any] = []
        alive: list[Any] = []

        def visit(use: Use, mask: jax.Array | None) -> None:
            if use.op == "other":
                stats.escaped.update(use.paths)
                if use.params.get("direct"):
                    stats.read_directly.update(use.paths)
                return
            if use.activation is None or use.op not in ("dot_general", "ragged_dot"):
                for path in use.paths & wanted:
                    if use.op != "gather":
                        stats.unmapped.setdefault(path, f"{use.op} inputs are not captured")
                return
            for source, _ in use.activation_scale or ():
                stats.scale_readers.setdefault(source, set()).update(use.paths)
            ragged = use.op == "ragged_dot"
            for path in use.paths:
                stats.reader_scales.setdefault(path, set()).add(use.activation_scale)
                if use.activation_scale:
                    stats.reader_axes.setdefault(path, set()).add(reader_axis(use, path))
            for path in use.paths & wanted:
                mapping = mapping_of(use, path)
                if isinstance(mapping, str):
                    stats.unmapped.setdefault(path, mapping)
                    continue
                group_mappings = mapping if ragged else (mapping,)
                scale = use.activation_scale if group_mappings[0].order is None else None
                keys = [(path, m.fixed) for m in group_mappings]
                for key, m in zip(keys, group_mappings, strict=True):
                    old = key_info.get(key)
                    key_scale = None if old is not None and old[3] != scale else scale
                    key_info[key] = (path, m.input_axes, m.fixed, key_scale, ragged)
                first = group_mappings[0]
                order = None if first.order is None else first.order.tobytes()
                dims = use.params.get(
                    "dimension_numbers", use.params.get("ragged_dot_dimension_numbers")
                )
                site = (id(use.activation), dims, use.weight_operand, order)
                if ragged:
                    site = (*site, id(use.group_sizes))
                if site not in site_index:
                    if ragged:
                        new_values = _ragged_increments(use, first, sample_rows)
                    else:
                        new_values = [_increment(use, first, mask, sample_rows)]
                    site_index[site] = len(sites)
                    for inc in new_values:
                        values.append(inc)
                        n_rows = int(np.size(use.activation)) // int(inc[0].shape[-1])
                        sites.append(_Site(n_rows, use.location, []))
                    # Keep the activation alive so its id is not reused within this trace.
                    alive.append((use.activation, use.group_sizes))
                for i, key in enumerate(keys):
                    sites[site_index[site] + i].keys.append(key)

        walk_batch(fn, params, args, visit, row_mask=row_mask)
        meta["sites"], meta["key_info"] = sites, key_info
        return values

    # The running sums are donated and each batch's statistics are added inside the compiled
    # walk, so memory holds the sums once (plus one site's increment at a time), not the sums
    # and a whole batch's increments.
    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(acc, params, args):
        inc = increments(params, args)
        return [
            (g + g2, s + s2, jnp.maximum(m, m2), f2, smp2, v2, n + n2)
            for (g, s, m, *_, n), (g2, s2, m2, f2, smp2, v2, n2) in zip(acc, inc, strict=True)
        ]

    def zeros(params, args):  # |x| >= 0, so 0 also starts the running max
        return jax.tree.map(
            lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(increments, params, args)
        )

    acc = None
    samples: dict[int, list[np.ndarray]] = {}
    for i, batch in enumerate(batches):
        args = tuple(jnp.asarray(a) for a in batch_args(batch))
        if acc is None:
            acc = zeros(params, args)
        inc = acc = step(acc, params, args)
        sites = meta["sites"]
        for j, value in enumerate(inc):
            if not bool(value[3]):
                path, _, fixed, *_ = meta["key_info"][sites[j].keys[0]]
                layer = path + "".join(f"[{k}]" for _, k in fixed)
                raise CalibrationError(
                    f"calibration batch {i}: the inputs of {layer} at {sites[j].location} "
                    "contain NaN or Inf; check the calibration data (token ids in range, no "
                    "empty sequences) and that the float model is finite on it"
                )
        if sample_rows:
            for j, value in enumerate(inc):
                have = sum(len(x) for x in samples.get(j, []))
                if have < sample_rows:
                    take = min(sample_rows - have, int(value[5]))  # masked rows are last
                    samples.setdefault(j, []).append(_on_host(value[4])[:take])
        stats.batches += 1
        stats.rows.append(sites[0].rows if sites else 0)
        if on_batch is not None:
            on_batch(i + 1)
    if acc is None:
        raise CalibrationError("calibration: batches is empty; give at least one batch")
    _collect(stats, acc, meta, samples)
    return stats


def _collect(stats: Statistics, acc, meta, samples) -> None:
    """WeightStats per key from per-site sums (a key read at several sites sums them)."""
    per_key: dict[Key, list[int]] = {}
    for j, site in enumerate(meta["sites"]):
        for key in site.keys:
            per_key.setdefault(key, []).append(j)
    for key, js in per_key.items():
        path, input_axes, fixed, scale, ragged = meta["key_info"][key]
        gram, abs_sum, abs_max = acc[js[0]][:3]
        for j in js[1:]:
            gram, abs_sum = gram + acc[j][0], abs_sum + acc[j][1]
            abs_max = jnp.maximum(abs_max, acc[j][2])
        count = sum(int(acc[j][6]) for j in js)
        sample = None
        if samples:
            sample = np.concatenate([x for j in js for x in samples.get(j, [])])
        stats.weights[key] = WeightStats(
            path, input_axes, fixed, gram, abs_sum, abs_max, count, sample, scale, ragged
        )
