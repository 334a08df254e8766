"""Laying out every weight of a params tree for the CPU kernels, and back.

`prepare_weights` is the one function that lays served weights out (`QuantizedModel`,
`lowbit.prepare`, `load_checkpoint` and `import_gguf` go through it); `with_int8_activations`
switches the prepared weights' products to llama.cpp's int8 activation blocks, and
`logical_weights` turns every layout back into its `QArray`. One weight's layout is
`_prepared.prepare_weight`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Container, Mapping
from typing import Any

import jax

from lowbit import kernels
from lowbit.ops._operand import quantized
from lowbit.ops._prepared import (
    as_gguf_tiles,
    holds_as_gguf_tiles,
    is_prepared,
    prepare_transposed,
    prepare_weight,
)


def prepare_leaves(
    flat: list[tuple[Any, Any]],
    axes: Mapping[Any, int] | Callable[[Any], int | None],
    transposed: Container[int] = (),
    *,
    donate: bool = False,
) -> None:
    """`prepare_weights` on a flattened tree, in place: ``flat[i] = (key path, leaf)``.

    Each entry is replaced as soon as its weight is prepared, so when `flat` holds the only
    reference to the logical QArrays their codes are freed one weight at a time. With
    `donate` (`flat` holds them, and nothing else does: a loader's own), a layout the size of
    its codes is written over them (`prepare_weight`'s), so not even the weight being laid
    out is held twice.

    The entries at the indices in `transposed` hold the transpose of their weight (a 2-D
    QArray as a file stores it, ``[out, in]``): each becomes its weight, laid out from those
    bytes where `axes` names it (`prepare_transposed`: no transposed copy), else transposed.
    """
    lookup = axes.get if isinstance(axes, Mapping) else axes
    for i, (keys, leaf) in enumerate(flat):
        if i in transposed:
            axis = lookup(tuple(keys))
            leaf = jax.tree.map(_untyped, leaf)
            flat[i] = (
                keys,
                leaf.T if axis is None else prepare_transposed(leaf, axis, donate=donate),
            )
        elif quantized(leaf):
            axis = lookup(tuple(keys))
            if axis is not None:
                leaf = jax.tree.map(_untyped, leaf)
                flat[i] = (keys, prepare_weight(leaf, axis, donate=donate))
        elif is_prepared(leaf):
            # Laid out by convention (a `kernel` contracted over axis 0) but used along the
            # other axis: laid out again for the use, else every call would unpack it.
            axis = lookup(tuple(keys))
            if axis is not None and axis != leaf.axis:
                flat[i] = (keys, prepare_weight(leaf.logical(), axis))
        del leaf


def on_explicit_axes(x: Any) -> bool:
    """Whether `x` is an array placed on a mesh with explicit axes (shardings in the types)."""
    mesh = getattr(getattr(x, "sharding", None), "mesh", None)
    types = getattr(mesh, "axis_types", ())
    return any(t == jax.sharding.AxisType.Explicit for t in types)


def _untyped(x: Any) -> Any:
    """An array on a one-device mesh with explicit axes, as a plain one-device array (the same
    buffer): its layout program is then built like any other's, where the explicit type would
    ask every reshape for an output sharding. Other arrays unchanged."""
    if isinstance(x, jax.Array) and on_explicit_axes(x) and len(x.devices()) == 1:
        return jax.device_put(x, jax.sharding.SingleDeviceSharding(next(iter(x.devices()))))
    return x


def prepare_weights(tree: Any, axes: Mapping[Any, int] | Callable[[Any], int | None]) -> Any:
    """Every QArray that `axes` names replaced by its `PreparedQArray` (see `prepare_weight`).

    The one function that lays served weights out for the CPU kernels: `QuantizedModel`,
    `lowbit.prepare`, `load_checkpoint` and `import_gguf` all go through it.

    Args:
      tree: a params pytree with QArray leaves.
      axes: key path of a leaf (as `jax.tree_util.tree_flatten_with_path` gives it, QArrays as
        leaves) -> the axis a traced use contracts it over (`lowbit.engine.kernel_axes`), as a
        mapping or a function; leaves absent (or mapped to None) stay logical.
    Returns:
      The tree with `PreparedQArray`s in place of the prepared QArrays.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: quantized(x) or is_prepared(x)
    )
    prepare_leaves(flat, axes)
    return jax.tree_util.tree_unflatten(treedef, [leaf for _, leaf in flat])


def with_int8_activations(
    tree: Any, enabled: bool = True, kinds: tuple[str, ...] | None = None
) -> Any:
    """`tree` with its prepared int8 / int4 / uint4 weight-only weights asking the kernels for
    int8 activations, or no longer asking (`enabled=False`).

    Each activation row is quantized per weight group (absmax / 127, round half to even, as
    llama.cpp's Q8 blocks, which llama.cpp itself uses for these weight types) and multiplied
    in integers, for one decode row, a decode batch and a prefill alike (BENCHMARKS.md,
    "Generation"), at the price of the activations' rounding error. The layouts are shared,
    not copied. Other leaves (logical QArrays, other kernels) are returned as they are.

    An int4 / int8 weight in groups of 32 with float16 scales (a GGUF file's Q4_0 / Q8_0
    tensor) moves onto Q4_0's / Q8_0's tiles (`as_gguf_tiles`: the same values, faster), and
    back to its own layout with ``enabled=False``. Where the active CPU path has no
    int8-activation kernel for another weight's kind (int8 weights on AVX-512 without VNNI:
    `lowbit.kernels.int8_activations_supported`), that weight keeps float activations; the
    engine report names each product's path, ``"cpu_kernel_int4+int8_act"`` for integer dots
    and ``"cpu_kernel_int8"`` for a weight that kept float activations.

    `kinds`: only the weights of these kernel kinds (e.g. `lowbit.kernels.GGUF_KINDS`); default
    every kind that has the int8 path.
    """
    wanted = kernels.INT8_ACTIVATION_KINDS if kinds is None else kinds

    def one(x):
        if not is_prepared(x):
            return x
        if enabled and x.route.kind in wanted:
            tiled = as_gguf_tiles(x)  # the same values on a faster integer layout
            if tiled is not None:
                return dataclasses.replace(
                    tiled, route=dataclasses.replace(tiled.route, int8_activations=True)
                )
        elif not enabled and holds_as_gguf_tiles(x) and x.meta.format in wanted:
            return prepare_weight(x.logical(), x.axis)  # float activations: its own layout
        if x.route.kind in wanted:
            route = dataclasses.replace(x.route, int8_activations=bool(enabled))
            return dataclasses.replace(x, route=route)
        return x

    return jax.tree.map(one, tree, is_leaf=is_prepared)


def logical_weights(tree: Any) -> Any:
    """Every `PreparedQArray` (and `PreparedPieces`) of a pytree back to its logical `QArray`
    (e.g. to save it)."""
    laid_out = lambda x: is_prepared(x, pieces=True)
    return jax.tree.map(lambda x: x.logical() if laid_out(x) else x, tree, is_leaf=laid_out)
