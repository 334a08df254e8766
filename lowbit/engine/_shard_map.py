"""`shard_map` with quantized operands: codes and scales are sharded together.

An operand's `PartitionSpec` names mesh axes per logical axis. Its codes take the same spec (a
packed axis splits into whole byte groups); its scale takes the spec where each shard holds
whole blocks, and is replicated along axes with a single block (every shard uses it whole).
Inside the body each shard sees a `QArray` of the local shape. Quantized outputs of the body are
dequantized (counted): outputs are activations.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec

from lowbit.engine import _compat
from lowbit.engine._layout_rules import LayoutUnsupported, codes_per_group
from lowbit.engine._values import NoRule, is_quantized
from lowbit.qarray import QArray


def _axis_names(spec: PartitionSpec, axis: int) -> tuple[str, ...]:
    entry = spec[axis] if axis < len(spec) else None
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple | list) else (entry,)


def _split_qarray(q: QArray, spec: PartitionSpec, mesh: Any) -> tuple[dict, dict, Callable]:
    """(leaves, their specs, rebuild from local leaves) for one quantized operand."""
    scale_spec, local_shape = [], []
    for axis, n in enumerate(q.shape):
        names = _axis_names(spec, axis)
        shards = math.prod(mesh.shape[name] for name in names)
        local = n // shards
        count, block = q.scale.shape[axis], q.block_shape[axis]
        if not names or count == 1:
            scale_spec.append(None)
        elif local % block == 0:
            scale_spec.append(spec[axis])
        else:
            raise LayoutUnsupported(f"shards axis {axis} into {local} elements, not whole blocks")
        if axis == q.packed_axis and names and local % codes_per_group(q):
            raise LayoutUnsupported(f"shards the packed axis into {local} codes, not whole bytes")
        local_shape.append(local)
    codes_spec = PartitionSpec(*[spec[a] if a < len(spec) else None for a in range(q.ndim)])
    scale_spec = PartitionSpec(*scale_spec)
    leaves = {"codes": q.codes, "scale": q.scale}
    specs = {"codes": codes_spec, "scale": scale_spec}
    for name in ("zero_point", "tensor_scale", "activation_bounds"):
        if getattr(q, name) is not None:
            leaves[name] = getattr(q, name)
            specs[name] = scale_spec if name == "zero_point" else PartitionSpec()
    if q.input_scale is not None:
        # Full along the axes it varies on (sharded like the codes there), 1 elsewhere.
        leaves["input_scale"] = q.input_scale
        specs["input_scale"] = PartitionSpec(
            *[codes_spec[a] if q.input_scale.shape[a] != 1 else None for a in range(q.ndim)]
        )

    def rebuild(local):
        fields = {name: local.get(name) for name in ("zero_point", "tensor_scale")}
        return dataclasses.replace(
            q,
            codes=local["codes"],
            scale=local["scale"],
            activation_bounds=local.get("activation_bounds"),
            input_scale=local.get("input_scale"),
            shape=tuple(local_shape),
            **fields,
        )

    return leaves, specs, rebuild


def _split(x: Any, spec: PartitionSpec, mesh: Any) -> tuple[Any, Any, Callable]:
    if not is_quantized(x):
        return x, spec, lambda local: local
    return x.shard_parts(spec, lambda q, q_spec: _split_qarray(q, q_spec, mesh))


def _enterable(ctx, eqn, dequantize_counted, x: Any, spec: PartitionSpec, mesh: Any):
    """`_split` of `x`, or of its dequantized value when it cannot enter as it is (counted)."""
    try:
        return _split(x, spec, mesh)
    except NoRule as err:
        if isinstance(err, LayoutUnsupported):
            raise  # the equation falls back as a whole
        return _split(dequantize_counted(ctx, eqn, x, str(err)), spec, mesh)


def shard_map_rule(eval_jaxpr, dequantize_counted, ctx, eqn, invals) -> list[Any]:
    p = _compat.shard_map_params(eqn)
    mesh = p["mesh"]
    splits = [
        _enterable(ctx, eqn, dequantize_counted, x, spec, mesh)
        for x, spec in zip(invals, p["in_specs"], strict=True)
    ]

    def body(*local_parts):
        values = [rebuild(part) for (_, _, rebuild), part in zip(splits, local_parts, strict=True)]
        outs = eval_jaxpr(ctx, p["body"], values)
        return tuple(
            dequantize_counted(ctx, eqn, v, "is an output of shard_map") if is_quantized(v) else v
            for v in outs
        )

    run = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=tuple(specs for _, specs, _ in splits),
        out_specs=p["out_specs"],
        axis_names=p["axis_names"],
        check_vma=p["check_vma"],
    )
    return list(run(*(leaves for leaves, _, _ in splits)))
