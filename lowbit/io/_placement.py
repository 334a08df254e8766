"""Where an imported tensor goes in a params tree, and how its layout changes on the way.

Importers take a `name_map` callable from a file's tensor name to one of:

  * ``None``: skip the tensor;
  * a path, ``("layers", 0, "attn", "q_proj", "kernel")`` or ``"layers/0/attn/q_proj/kernel"``
    (string parts made of digits become ints, as list indices are in ``nnx.State``);
  * a `Placement` (or any object with the same three attributes, such as the mappings of
    `lowbit.models`): a path plus a transpose and a RoPE row un-interleaving.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

Key = str | int
Path = tuple[Key, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
    """Where one file tensor goes.

    Attributes:
      path: the params path.
      transpose: swap the last two axes (a file's linear weight ``[out, in]`` -> a Flax
        kernel ``[in, out]``; stacked experts ``[E, out, in]`` -> ``[E, in, out]``).
      unpermute_heads: if set, first undo llama.cpp's interleaving of query/key rows for this
        many heads (see `lowbit.models.unpermute_rope_rows`); None or a positive int.
    """

    path: Path
    transpose: bool = False
    unpermute_heads: int | None = None


def resolve(name: str, target: Any) -> Placement | None:
    """A `name_map` result for the tensor `name` as a `Placement` (None: skip).

    Raises:
      TypeError: naming the tensor when the result is none of the accepted kinds.
      ValueError: naming the tensor when its ``unpermute_heads`` is neither None nor a
        positive int.
    """
    placement = _placement(name, target)
    heads = None if placement is None else placement.unpermute_heads
    if heads is not None and (not isinstance(heads, int) or heads <= 0):
        raise ValueError(
            f"name_map({name!r}) gave unpermute_heads={heads!r}; accepted: None or a positive int"
        )
    return placement


def _placement(name: str, target: Any) -> Placement | None:
    if target is None or isinstance(target, Placement):
        return target
    if isinstance(target, str):
        return Placement(path=tuple(int(p) if p.isdigit() else p for p in target.split("/")))
    if isinstance(target, tuple) and all(isinstance(p, str | int) for p in target):
        return Placement(path=target)
    if all(hasattr(target, a) for a in ("path", "transpose", "unpermute_heads")):
        # A `lowbit.models.ParamMapping` may also add an offset, fill one expert's slice or
        # take part of a fused tensor; placing the whole tensor as stored would be wrong.
        extra = {a: getattr(target, a, None) for a in ("offset", "expert", "part")}
        extra = {a: v for a, v in extra.items() if v not in (None, 0, 0.0)}
        if extra:
            raise ValueError(
                f"name_map({name!r}) gave a mapping with {extra}; importers place whole "
                "tensors as stored (load Hugging Face decoders with "
                "lowbit.models.load_decoder_hf)"
            )
        return Placement(
            path=tuple(target.path),
            transpose=bool(target.transpose),
            unpermute_heads=target.unpermute_heads,
        )
    raise TypeError(
        f"name_map({name!r}) returned {target!r}; accepted: None, a path tuple, a 'a/b/c' "
        "string, or a Placement"
    )


def nest(items: Iterable[tuple[Path, Any]]) -> dict[Key, Any]:
    """Nested dicts from (path, value) pairs.

    Raises:
      ValueError: if two tensors land on the same path, or one path is a prefix of another.
    """
    root: dict[Key, Any] = {}
    for path, value in items:
        if not path:
            raise ValueError("name_map returned an empty path")
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"path {path!r} passes through a tensor")
        if path[-1] in node:
            raise ValueError(f"two tensors map to path {path!r}")
        node[path[-1]] = value
    return root


NameMap = Callable[[str], Any]
