"""Calibration statistics per weight, streamed from the engine's probe.

`capture` runs the float model on calibration batches through `lowbit.engine.probe` (the same
interpreter that serves quantized models) and, at every matmul that reads a wanted weight,
accumulates in float32, over the weight's contracted (input) axes:

  * the Gram matrix ``XᵀX`` (GPTQ's Hessian up to a factor), [K, K];
  * the per-input-channel sum of |x| and max |x| (AWQ, SmoothQuant), [K];
  * optionally a bounded sample of input rows, [<= sample_rows, K] (output-error searches).

Memory is O(K²) per weight; activations are never kept. The input axes are found by mapping the
weight operand's layout back to the parameter (`Use.weight_indices`), so transposed, reshaped
(einsum weights with several contracted axes) and stacked weights are handled: a parameter
indexed at one position of an axis by its use (a `scan` step over stacked layers, a slice of a
stacked table) gets one set of statistics per index (`WeightStats.fixed`). A tied embedding
gets statistics from its matmul use; its lookup (a gather) has no activation.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowbit.engine import Use, probe
from lowbit.recipes import param_leaves, path_string

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
    """

    path: str
    input_axes: tuple[int, ...]
    fixed: tuple[tuple[int, int], ...]
    gram: jax.Array
    abs_sum: jax.Array
    abs_max: jax.Array
    count: int = 0
    sample: np.ndarray | None = None

    @property
    def abs_mean(self) -> jax.Array:
        return self.abs_sum / max(self.count, 1)


@dataclasses.dataclass
class Statistics:
    """What `capture` measured: per (path, fixed index) stats, and uses it could not map.

    Attributes:
      weights: {(path, fixed): WeightStats}.
      unmapped: {path: reason} for uses whose input axes could not be mapped to the parameter
        (e.g. a batched matmul over the weight, a conv); those uses add no statistics.
      batches: number of batches run.
      tokens: input rows per batch of the first use seen (for messages).
    """

    weights: dict[Key, WeightStats] = dataclasses.field(default_factory=dict)
    unmapped: dict[str, str] = dataclasses.field(default_factory=dict)
    batches: int = 0

    def for_path(self, path: str) -> list[WeightStats]:
        return [s for (p, _), s in self.weights.items() if p == path]


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
    ids = np.asarray(use.weight_indices(shape))
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


@jax.jit
def _accumulate(gram, abs_sum, abs_max, x):
    a = jnp.abs(x)
    return (
        gram + jnp.dot(x.T, x, precision=jax.lax.Precision.HIGHEST),
        abs_sum + a.sum(0),
        jnp.maximum(abs_max, a.max(0)),
        jnp.all(jnp.isfinite(x)),
    )


def _rows(use: Use, mapping: _Mapping) -> jax.Array:
    """The activation as [rows, K] float32, columns in the parameter's input order."""
    (lc, rc), _ = use.params["dimension_numbers"]
    a_contract = lc if use.weight_operand == 1 else rc
    x = jnp.asarray(use.activation, jnp.float32)
    rest = [a for a in range(x.ndim) if a not in a_contract]
    x = jnp.transpose(x, [*rest, *a_contract]).reshape(
        -1, int(np.prod([x.shape[a] for a in a_contract]))
    )
    return x if mapping.order is None else x[:, mapping.order]


def capture(
    fn: Callable[..., Any],
    params: Any,
    batches: Iterable[Any],
    *,
    paths: Sequence[str] | None = None,
    sample_rows: int = 0,
    on_batch: Callable[[int], None] | None = None,
) -> Statistics:
    """Streams input statistics of the wanted weights over calibration batches.

    Args:
      fn: ``fn(params, *batch)`` (a batch that is not a tuple is one argument).
      params: float params pytree.
      batches: iterable of batches.
      paths: parameter paths to measure (default: every parameter with 2+ axes).
      sample_rows: keep up to this many input rows per weight (0: none).
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

    def visit(use: Use, batch_index: int, shared: dict) -> None:
        if use.activation is None or use.op != "dot_general":
            for path in use.paths & wanted:
                if use.op != "gather":
                    stats.unmapped.setdefault(path, f"{use.op} inputs are not captured")
            return
        for path in use.paths & wanted:
            cache_key = (path, use.layout_key, use.params["dimension_numbers"], use.weight_operand)
            if cache_key not in mappings:
                mappings[cache_key] = _map_use(use, shapes[path])
            mapping = mappings[cache_key]
            if isinstance(mapping, str):
                stats.unmapped.setdefault(path, mapping)
                continue
            key = (path, mapping.fixed)
            # q, k and v read the same activation: compute its statistics once.
            site = (
                id(use.activation),
                use.params["dimension_numbers"],
                use.weight_operand,
                None if mapping.order is None else mapping.order.tobytes(),
            )
            x = shared.get(site)
            if x is None:
                x = shared[site] = (use.activation, _rows(use, mapping))
            rows = x[1]
            s = stats.weights.get(key)
            if s is None:
                k = rows.shape[1]
                zeros = jnp.zeros((k,), jnp.float32)
                s = stats.weights[key] = WeightStats(
                    path,
                    mapping.input_axes,
                    mapping.fixed,
                    jnp.zeros((k, k), jnp.float32),
                    zeros,
                    zeros,
                )
            gram, abs_sum, abs_max, finite = _accumulate(s.gram, s.abs_sum, s.abs_max, rows)
            if not bool(finite):
                layer = path + "".join(f"[{i}]" for _, i in mapping.fixed)
                raise CalibrationError(
                    f"calibration batch {batch_index}: the inputs of {layer} at {use.location} "
                    "contain NaN or Inf; check the calibration data (token ids in range, no "
                    "empty sequences) and that the float model is finite on it"
                )
            s.gram, s.abs_sum, s.abs_max = gram, abs_sum, abs_max
            s.count += int(rows.shape[0])
            if sample_rows:
                _add_sample(s, rows, sample_rows)

    for i, batch in enumerate(batches):
        args = batch if isinstance(batch, tuple) else (batch,)
        shared: dict = {}
        probe(
            fn,
            params,
            args,
            {},
            functools.partial(visit, batch_index=i, shared=shared),
            name=path_string,
            concrete=True,
        )
        stats.batches += 1
        if on_batch is not None:
            on_batch(i + 1)
    if stats.batches == 0:
        raise CalibrationError("calibration: batches is empty; give at least one batch")
    return stats


def _add_sample(s: WeightStats, rows: jax.Array, limit: int) -> None:
    have = 0 if s.sample is None else s.sample.shape[0]
    if have >= limit:
        return
    take = min(limit - have, rows.shape[0])
    stride = max(1, rows.shape[0] // take)
    new = np.asarray(rows[::stride][:take])
    s.sample = new if s.sample is None else np.concatenate([s.sample, new])
