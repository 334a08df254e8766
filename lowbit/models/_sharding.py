"""Tensor- and data-parallel generation of a decoder (Megatron-style) on a device mesh.

Over the mesh axis `model` (tensor parallel, ``tp`` devices):

  * attention: q/k/v kernels (and biases) split by output columns, whole heads per device
    (each device holds its query heads' key/value heads: where ``n_kv_heads`` does not divide
    by ``tp``, zero heads are appended up to a multiple first, `_head_padding`, which leaves
    the model's output unchanged); o_proj split by input rows, the same heads;
  * dense MLP: gate/up split by columns, down by rows;
  * the KV cache split by kv heads, like the k/v columns that fill it.

Over the mesh axis `data` the batch rows (tokens, cache rows) are split. Everything else is
replicated: embedding, norms, output projection, MoE layers' experts, router and shared
expert, and the fused projections of Phi-3 (whose interleaved q/k/v or gate/up columns an
even split would not cut into whole heads; a model axis is refused for them).

The forward pass is one `jax.shard_map` over the mesh (`sharded_forward`): each device runs
the decoder with its share of heads and MLP columns (`local_config`) on its rows and cache
slice, and the partial outputs of o_proj and down_proj are summed over the model axis by a
``psum`` (two all-reduces per layer, none elsewhere). The specs state the layout, so it is
the same on meshes with automatic and explicit axes; inside, each device's quantized weights
are whole local arrays (or laid-out pieces) and take the CPU kernels like a one-device model.

Quantized weights (`QArray` leaves) are placed leaf by leaf: codes take the weight's spec,
scales and zero points the same spec where each piece holds whole groups, replicated where the
axis has a single group (per-channel scales over the split rows). Where a CPU kernel runs a
split weight's pieces, each device's piece is then laid out for it once (`PreparedPieces`),
as a one-device model's weights are (`lowbit.quantize`); weights left whole on every device
keep the layout they came in. Groups run along the
contraction axis, so the column splits are always free; a row split (o_proj, down_proj) needs
the group size to divide the rows per device, else the weight is refused, naming it. Weights
with dynamically quantized activations (w8a8, w4a8) on the row-split projections quantize each
device's slice of the activation with its own per-token scale: the results differ from one
device's by that rounding.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lowbit._processes import allgather
from lowbit.models._head_padding import pad_heads, padded_kv_heads, with_kv_heads
from lowbit.models._kv_cache import KVCache, init_kv_cache
from lowbit.ops import PreparedPieces, PreparedQArray, logical_weights, prepare_weight
from lowbit.qarray import QArray
from lowbit.recipes import path_string

# Path suffixes (after ``layers/<i>/``) and the axis of the kernel that is split.
_COLUMNS = ("attn/q_proj", "attn/k_proj", "attn/v_proj", "gate_proj", "up_proj")
_ROWS = ("attn/o_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class GenerationSharding:
    """Where generation runs: a mesh, the axis heads and MLP columns are split over, the axis
    batch rows are split over. Built by `shard_for_generation`.

    Attributes:
      mesh: the `jax.sharding.Mesh`, its axes typed automatic (`generation_sharding` retypes
        explicit ones: same devices, same names).
      model_axis: the tensor-parallel axis name, or None (no tensor parallelism).
      data_axis: the data-parallel axis name, or None (rows on every device).
      kv_heads: the key/value heads the model runs with, padded with zero heads to a
        multiple of `tp` (`lowbit.models._head_padding`), or None: the model's own.
    """

    mesh: Mesh
    model_axis: str | None
    data_axis: str | None
    kv_heads: int | None = None

    @property
    def tp(self) -> int:
        """Devices along the tensor-parallel axis (1 without one)."""
        return 1 if self.model_axis is None else self.mesh.shape[self.model_axis]

    @property
    def dp(self) -> int:
        """Devices along the data-parallel axis (1 without one)."""
        return 1 if self.data_axis is None else self.mesh.shape[self.data_axis]

    def fit(self, config: Any) -> Any:
        """`config` as it runs on this mesh: with `kv_heads` (and their query heads)."""
        return config if self.kv_heads is None else with_kv_heads(config, self.kv_heads)

    def named(self, *spec: Any) -> NamedSharding:
        return NamedSharding(self.mesh, P(*spec))

    def rows(self, ndim: int) -> NamedSharding:
        """An array of batch rows (axis 0) with `ndim` axes, rows split over `data_axis`."""
        return self.named(self.data_axis, *([None] * (ndim - 1)))

    def cache_shardings(self, cache: KVCache) -> KVCache:
        """The shardings of `cache`'s arrays (a `KVCache` of `NamedSharding`s): codes, scales
        and key offsets ``[batch, H, ...]`` by rows and kv heads, ``start`` by rows, ``length``
        replicated."""

        def one(x: jax.Array) -> NamedSharding:
            if x.ndim == 4:
                return self.named(self.data_axis, self.model_axis, None, None)
            return self.rows(x.ndim) if x.ndim else self.named()

        return jax.tree.map(one, cache)

    def init_cache(self, module: Any, batch: int, max_len: int, kv_cache: Any) -> KVCache:
        """``module.init_cache(batch, max_len, kv_cache)`` created in place on the mesh, with
        the heads of `fit`: each device allocates only its slice (no device or process holds
        the whole cache)."""
        c = self.fit(module.config)
        shape = (c.n_layers, c.n_kv_heads, c.head_dim, batch, max_len)
        make = functools.partial(init_kv_cache, *shape, module.dtype, kv_cache)
        return jax.jit(make, out_shardings=self.cache_shardings(jax.eval_shape(make)))()

    def place_cache(self, cache: KVCache) -> KVCache:
        """`cache` on the mesh (see `cache_shardings`)."""
        return jax.tree.map(put, cache, self.cache_shardings(cache))


def put(x: Any, sharding: NamedSharding) -> jax.Array:
    """`x` placed on `sharding`, which may span several processes: then every process passes
    the same value and keeps only its own pieces of it (built from its host copy)."""
    if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = put(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def fetch(x: jax.Array) -> np.ndarray:
    """The whole of `x` on the host, also when its pieces lie in several processes (every
    process must call it)."""
    if x.is_fully_addressable or x.is_fully_replicated:
        # Every local copy, not only the one read: see lowbit._processes.
        return np.asarray(jax.block_until_ready(x))

    return allgather(x, tiled=True)


def generation_sharding(
    mesh: Mesh, *, model_axis: str | None = "model", data_axis: str | None = "data"
) -> GenerationSharding:
    """A `GenerationSharding` on `mesh`; an axis name the mesh lacks counts as absent.

    Raises:
      ValueError: when `mesh` has neither axis.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = set(mesh.axis_names)
    model = model_axis if model_axis in names else None
    data = data_axis if data_axis in names else None
    if model is None and data is None:
        raise ValueError(
            f"mesh has axes {mesh.axis_names}; generation splits heads over model_axis="
            f"{model_axis!r} and rows over data_axis={data_axis!r}: name one of them "
            "(e.g. jax.make_mesh((2, 4), ('data', 'model')))"
        )
    return GenerationSharding(_automatic(mesh), model, data)


def _automatic(mesh: Mesh) -> Mesh:
    """`mesh` with every axis typed automatic (same devices and names). Generation states its
    layout in a `shard_map`'s specs, which do not depend on axis types; outside it (sampling,
    the decode loop's bookkeeping) explicit types would have to be threaded through the
    quantization engine's trace, which traces with unsharded stand-ins."""
    axis_type = getattr(jax.sharding, "AxisType", None)
    if axis_type is None or all(t == axis_type.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(axis_type.Auto,) * mesh.devices.ndim)


def _role(path: str) -> str | None:
    """ "columns", "rows" or None (replicated) for the parameter at `path`."""
    parts = path.split("/")
    if len(parts) < 2 or parts[-1] not in ("kernel", "bias"):
        return None
    owner = "/".join(parts[:-1])
    if "/moe/" in f"/{owner}/":
        return None  # MoE layers run whole on every device
    if owner.endswith(_COLUMNS):
        return "columns"
    if owner.endswith(_ROWS):
        return "rows" if parts[-1] == "kernel" else None
    return None


def _spec(ndim: int, axis: int, name: str) -> P:
    return P(*[name if a == axis else None for a in range(ndim)])


def _place_qarray(q: QArray, axis: int, plan: GenerationSharding, path: str) -> QArray:
    """Codes split along `axis` over the model axis, scales with whole groups per piece."""
    tp, name = plan.tp, plan.model_axis
    n = q.shape[axis]
    local = n // tp
    block = q.block_shape[axis]
    if q.fmt.scales_in_codes or q.codes.ndim != q.ndim:
        raise ValueError(
            f"{path}: a {q.format} weight keeps its scales inside the codes, which "
            f"shard_for_generation cannot split over {tp} devices; requantize it with a "
            "lowbit recipe (e.g. int4w_g32_asym) or generate without a model axis"
        )
    if q.packed_axis == axis and q.fmt.packed_length(local) * tp != q.codes.shape[axis]:
        raise ValueError(
            f"{path}: {tp} pieces of {local} {q.format} codes along axis {axis} split bytes "
            f"of the packed codes; use a model axis whose pieces fill whole bytes"
        )
    codes = plan.named(*_spec(q.ndim, axis, name))
    if q.scale.shape[axis] == 1:
        scales = plan.named()  # one group over the whole axis: every piece uses it
    elif local % block == 0:
        scales = plan.named(*_spec(q.ndim, axis, name))
    else:
        raise ValueError(
            f"{path}: groups of {block} along axis {axis} straddle two devices: the model "
            f"axis splits {n} into pieces of {local}. Quantize with a group size that "
            f"divides {local}, or use a smaller model axis"
        )
    fields: dict[str, Any] = {"codes": put(q.codes, codes), "scale": put(q.scale, scales)}
    if q.zero_point is not None:
        fields["zero_point"] = put(q.zero_point, scales)
    for extra in ("tensor_scale", "activation_bounds"):
        if getattr(q, extra) is not None:
            fields[extra] = put(getattr(q, extra), plan.named())
    if q.input_scale is not None:
        spec = codes if q.input_scale.shape[axis] != 1 else plan.named()
        fields["input_scale"] = put(q.input_scale, spec)
    return dataclasses.replace(q, **fields)


def _shard_on(x: jax.Array, device: Any) -> jax.Array:
    """The piece of `x` that `device` holds."""
    return next(s.data for s in x.addressable_shards if s.device == device)


def _prepared_pieces(q: QArray, axis: int, plan: GenerationSharding) -> PreparedPieces | None:
    """`q`, placed by `_place_qarray` (split along `axis` over the model axis), with each
    device's piece laid out for the CPU kernels (`PreparedPieces`): the kernels then run the
    pieces as they are, where a split logical `QArray` is laid out inside every call. None
    where no kernel runs the pieces, or a piece keeps a scale beside its layout.

    Each process lays out the pieces of its own devices only, each piece once (devices along
    the data axis hold copies)."""
    mesh, name = plan.mesh, plan.model_axis
    where = mesh.axis_names.index(name)
    position = {d: index[where] for index, d in np.ndenumerate(mesh.devices)}
    shape = list(q.shape)
    shape[axis] //= plan.tp
    fields = ("codes", "scale", "zero_point", "tensor_scale", "input_scale")
    laid: dict[int, PreparedQArray] = {}
    pieces: dict[Any, PreparedQArray] = {}
    for device in q.codes.sharding.addressable_devices:
        i = position[device]
        if i not in laid:
            present = [f for f in fields if getattr(q, f) is not None]
            parts = {f: _shard_on(getattr(q, f), device) for f in present}
            piece = prepare_weight(dataclasses.replace(q, **parts, shape=tuple(shape)), 0)
            kept = isinstance(piece, PreparedQArray) and (
                piece.scale is not None or piece.zero_point is not None
            )
            if not isinstance(piece, PreparedQArray) or kept:
                return None  # no kernel, or a scale kept beside the layout
            laid[i] = piece
        pieces[device] = jax.device_put(laid[i], device)
    treedef = jax.tree.structure(next(iter(pieces.values())))
    leaves = {d: jax.tree.leaves(p) for d, p in pieces.items()}
    sharding = plan.named(name)
    stacked = [
        jax.make_array_from_single_device_arrays(
            (plan.tp, *leaf.shape), sharding, [leaves[d][j][None] for d in pieces]
        )
        for j, leaf in enumerate(leaves[next(iter(pieces))])
    ]
    return PreparedPieces(jax.tree.unflatten(treedef, stacked), name, axis, q.shape, q.dtype)


def _check_config(config: Any, tp: int) -> None:
    for field, name in (("fused_qkv", "qkv_proj"), ("fused_gate_up", "gate_up_proj")):
        if getattr(config, field, False):
            raise ValueError(
                f"DecoderConfig.{field}: the fused {name} interleaves its outputs, which "
                f"shard_for_generation cannot split by heads over {tp} devices; generate "
                "without a model axis (a data axis alone works)"
            )
    if not config.n_experts and config.ffn_dim % tp:
        raise ValueError(
            f"DecoderConfig.ffn_dim={config.ffn_dim} does not divide over {tp} devices of the "
            "model axis; use a model axis that divides it"
        )


def shard_for_generation(
    params: Any,
    mesh: Mesh | GenerationSharding,
    config: Any = None,
    *,
    model_axis: str | None = "model",
    data_axis: str | None = "data",
) -> tuple[Any, GenerationSharding]:
    """`params` placed on `mesh` for tensor-parallel generation (see the module docstring).

    Args:
      params: a decoder's params (an NNX `State` or nested dicts; float arrays, `QArray`s,
        or CPU-kernel `PreparedQArray`s as `lowbit.quantize` returns them: those left whole
        on every device keep their layout, the split ones are split as `QArray`s and each
        piece laid out again, `PreparedPieces`).
      mesh: a `Mesh`, or a `GenerationSharding` from an earlier call.
      config: the `DecoderConfig`, to pad kv heads that do not divide over the model axis
        (the returned plan's `kv_heads`) and check the MLP width divides (None skips both;
        the weights' own sizes are still checked).
      model_axis, data_axis: axis names (see `generation_sharding`).
    Returns:
      ``(placed params, GenerationSharding)``; pass both to `generate_tokens` (``params=``,
      ``mesh=``), or place the KV cache with `GenerationSharding.place_cache`.
    Raises:
      ValueError: an MLP width or quantization group that does not divide over the model
        axis (naming the parameter), a weight that cannot be padded with zero heads, or fused
        projections with a model axis.
    """
    plan = (
        mesh
        if isinstance(mesh, GenerationSharding)
        else generation_sharding(mesh, model_axis=model_axis, data_axis=data_axis)
    )
    if config is not None and plan.tp > 1:
        _check_config(config, plan.tp)
        kv_heads = padded_kv_heads(config, plan.tp)
        if kv_heads != config.n_kv_heads:  # every device needs whole key/value heads
            params = pad_heads(params, config, kv_heads)
            plan = dataclasses.replace(plan, kv_heads=kv_heads)
    replicated = plan.named()

    def place(key_path: tuple, x: Any) -> Any:
        path = path_string(key_path)
        role = _role(path) if plan.tp > 1 else None
        if isinstance(x, PreparedPieces):  # placed by an earlier call: placed again
            x = x.logical()
        if role is None:
            if isinstance(x, QArray | PreparedQArray):  # a kernel layout stays as it is
                return jax.tree.map(lambda a: put(a, replicated), x)
            return put(x, replicated) if hasattr(x, "dtype") else x
        x = logical_weights(x)
        axis = x.ndim - 1 if role == "columns" else x.ndim - 2
        if x.shape[axis] % plan.tp:
            raise ValueError(
                f"{path}: axis {axis} of shape {tuple(x.shape)} does not divide over "
                f"{plan.tp} devices of the model axis {plan.model_axis!r}"
            )
        if isinstance(x, QArray):
            placed = _place_qarray(x, axis, plan, path)
            if x.ndim == 2 and path.endswith("/kernel"):
                return _prepared_pieces(placed, axis, plan) or placed
            return placed
        return put(x, plan.named(*_spec(x.ndim, axis, plan.model_axis)))

    placed = jax.tree_util.tree_map_with_path(
        place, params, is_leaf=lambda x: isinstance(x, QArray | PreparedQArray | PreparedPieces)
    )
    return placed, plan


@functools.cache
def _summed_dot(axis: str):
    """A `dot_general` whose partial products are summed over mesh `axis` (the all-reduce
    after a row-split projection). Cached: one object per axis keeps graphdefs equal, so
    compiled programs are reused."""

    def dot(lhs, rhs, dimension_numbers, **kwargs):
        return jax.lax.psum(jax.lax.dot_general(lhs, rhs, dimension_numbers, **kwargs), axis)

    return dot


def local_config(config: Any, tp: int) -> Any:
    """`config` with one device's share of the heads and the MLP width (MoE layers stay
    whole: their experts are replicated)."""
    return dataclasses.replace(
        config,
        n_heads=config.n_heads // tp,
        n_kv_heads=config.n_kv_heads // tp,
        ffn_dim=config.ffn_dim if config.n_experts else config.ffn_dim // tp,
    )


@functools.lru_cache(maxsize=64)
def local_graphdef(module_type: type, config: Any, dtype: Any, plan: GenerationSharding):
    """The graphdef each device runs: the decoder of `local_config`, with o_proj and (dense
    layers') down_proj summing their partial outputs over the model axis."""
    module = module_type.abstract(local_config(config, plan.tp), dtype=dtype)
    if plan.model_axis is None:
        return nnx.split(module)[0]
    summed = _summed_dot(plan.model_axis)
    for layer in module.layers:
        layer.attn.o_proj.dot_general = summed
        if hasattr(layer, "mlp"):
            layer.mlp.down_proj.dot_general = summed
    return nnx.split(module)[0]


def param_specs(params: Any, plan: GenerationSharding) -> Any:
    """A `PartitionSpec` per array of `params` (float arrays, or the logical arrays the
    quantization engine traces in their place), as `shard_for_generation` places them."""

    def spec(key_path: tuple, x: Any) -> P:
        role = _role(path_string(key_path)) if plan.tp > 1 else None
        if role is None:
            return P()
        return _spec(x.ndim, x.ndim - 1 if role == "columns" else x.ndim - 2, plan.model_axis)

    return jax.tree_util.tree_map_with_path(spec, params)


def cache_specs(cache: KVCache, plan: GenerationSharding) -> KVCache:
    """A `PartitionSpec` per array of `cache` (see `GenerationSharding.cache_shardings`)."""
    return jax.tree.map(lambda s: s.spec, plan.cache_shardings(cache))


def sharded_forward(
    module_type: type,
    config: Any,
    dtype: Any,
    plan: GenerationSharding,
    params: Any,
    tokens: jax.Array,
    cache: KVCache,
    fresh: bool = False,
) -> tuple[jax.Array, KVCache]:
    """The decoder's last-position logits and updated cache, one `shard_map` over the mesh.

    Each device runs `local_graphdef` on its heads, MLP columns, rows and cache slice; the
    partial outputs of o_proj and down_proj are summed over the model axis (two all-reduces
    per layer). Logits and cache come back split like the tokens and cache went in.

    Args:
      params: the global params (placed by `shard_for_generation`).
      tokens: ``[batch, seq]`` int32.
      cache: the global `KVCache` (placed by `GenerationSharding.place_cache`).
      fresh: the tokens start the cache (`Decoder.__call__`'s ``fresh``).
    Returns:
      ``(logits [batch, 1, vocab], new cache)``.
    """
    graphdef = local_graphdef(module_type, config, dtype, plan)
    specs = cache_specs(cache, plan)

    def body(params, tokens, cache):
        return nnx.merge(graphdef, params)(tokens, cache=cache, last_only=True, fresh=fresh)

    run = jax.shard_map(
        body,
        mesh=plan.mesh,
        in_specs=(param_specs(params, plan), P(plan.data_axis, None), specs),
        out_specs=(P(plan.data_axis, None, None), specs),
        # Outputs are the same on every device of the model axis by construction (the
        # residual stream is summed after o_proj and down_proj); not re-checked by the trace.
        check_vma=False,
    )
    return run(params, tokens, cache)
