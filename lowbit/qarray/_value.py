"""`EngineValue`: the one protocol every value the engine carries in place of an array follows.

The engine (`lowbit.engine.interpret`) runs unmodified JAX functions on values that stand for
float arrays: packed `QArray`s, `lowbit.ops.PreparedQArray` (a served weight in a kernel's
layout), `lowbit.ops.QatWeight`, `lowbit.ops.LoraWeight`, `lowbit.ops.Fp8Weight` and
`NMSparse`. It tells them apart by nothing but this protocol, as optax's transforms are all one
`(init, update)` pair: each value says

  * its logical `shape` and `dtype` (a dataclass field or a property; `ndim` follows here),
  * what float array it stands for (`dequantize`) and its logical form (`logical`),
  * how a layout op (transpose, reshape, slice, ...) maps over it (`map_layout`),
  * how it takes part in a `dot_general`, `conv_general_dilated` or `ragged_dot_general`
    (the output and the implementation path the report counts, or `NoRule`: "dequantize me"),
  * how it reads in the engine report (`describe`),
  * how it crosses a `scan` or `shard_map` as leaves (`scan_parts`, `scan_output_parts`,
    `shard_parts`), given the engine's function for a `QArray`.

As in equinox, the base is abstract and every concrete value is final: a new kind of weight is
one new class in one module (plus its tests), never an edit of the engine's rules.

It sits in the lowest layer that defines a value (`lowbit.qarray`), so `QArray` and the values
of `lowbit.ops` share it.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import jax


class NoRule(Exception):
    """A value cannot take part in this op as it is: the engine then dequantizes it (counted in
    the report) or, in strict mode, raises `EngineFallbackError` with this message as reason."""


class EngineValue(abc.ABC):
    """A value that stands for a float array of `shape` and `dtype` inside the engine.

    Subclasses are frozen dataclasses registered as pytrees; they define `shape` and `dtype`
    (fields or properties) and the abstract methods below, and override the op methods they
    take part in (by default a value takes part in none: it runs dense, counted).

    Attributes:
      engine_priority: when both operands of an op are engine values, the rule of the one with
        the higher priority runs (as NumPy's ``__array_priority__``): N:M sparse (refuses) >
        LoRA > fp8 > QAT > packed arrays.
    """

    shape: tuple[int, ...]
    dtype: Any
    engine_priority: ClassVar[int] = 0

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @abc.abstractmethod
    def dequantize(self) -> jax.Array:
        """The float array this value stands for in the forward pass: [*shape] `dtype`."""

    def logical(self) -> EngineValue:
        """This value in its logical form (a kernel layout recovers its `QArray`; others are
        already logical)."""
        return self

    @abc.abstractmethod
    def map_layout(self, qarray_fn: Callable[[Any], Any], float_fn: Callable[[Any], Any]) -> Any:
        """A layout op applied to this value.

        Args:
          qarray_fn: the op on a packed array (`QArray` -> `QArray`; may raise `NoRule`).
          float_fn: the same op on a float array.
        Returns:
          A value of the same kind.
        Raises:
          NoRule: when the op cannot keep this value's kind (the engine dequantizes it).
        """

    @abc.abstractmethod
    def describe(self) -> str:
        """A short description for the engine report and errors, e.g. ``QArray(int4, ...)``."""

    # --- how it computes: (output, path), NotImplemented, or NoRule ---------------------------
    # NotImplemented (as in Python's binary operators) says that `lowbit.ops`' own op takes
    # this value as an operand as it is (packed arrays); the engine then calls that op.
    def dot_general(
        self, lhs: Any, rhs: Any, dimension_numbers: Any, **kwargs: Any
    ) -> tuple[jax.Array, str]:
        """`lax.dot_general(lhs, rhs, dimension_numbers, **kwargs)` with `self` one operand.

        Returns:
          (output, implementation path), or NotImplemented (see above).
        Raises:
          NoRule: the value does not take part in this product as it is.
        """
        raise NoRule(f"has no dot_general rule for {type(self).__name__}: runs dense")

    def conv_general_dilated(self, lhs: Any, rhs: Any, **params: Any) -> tuple[jax.Array, str]:
        """As `dot_general`, for `lax.conv_general_dilated` (params: its equation's)."""
        raise NoRule(f"has no conv rule for {type(self).__name__}: runs dense")

    def ragged_dot_general(
        self, lhs: Any, rhs: Any, group_sizes: Any, **params: Any
    ) -> tuple[jax.Array, str]:
        """As `dot_general`, for `lax.ragged_dot_general` (params: its equation's)."""
        raise NoRule(f"has no ragged_dot rule for {type(self).__name__}: runs dense")

    # --- how it crosses control flow: as leaves, rebuilt inside the body --------------------
    # `qarray_parts` is the engine's function for a packed `QArray`; a value made of packed
    # and float parts applies it to the packed ones.
    def scan_parts(self, qarray_parts: Callable[[Any], Any]) -> tuple[Any, Callable[[Any], Any]]:
        """A value a `scan` runs over (along axis 0), as (leaves, rebuild).

        Args:
          qarray_parts: `QArray` -> (leaves, rebuild of one step's QArray).
        Returns:
          (leaves with the scanned axis leading, leaves of one step -> one step's value). By
          default the value's own pytree leaves, each scanned alike.
        Raises:
          NoRule: the value cannot be split per step (the engine dequantizes it first).
        """
        return self, lambda part: part

    def scan_output_parts(
        self, qarray_parts: Callable[[Any], Any]
    ) -> tuple[Any, Callable[[Any, int], Any]]:
        """A per-step output of a scan body (e.g. weights handed back by `nnx.scan`), as
        (leaves, restack(stacked leaves, length) -> the value with a new leading axis).

        Raises:
          NoRule: by default: such an output leaves the loop dequantized (counted).
        """
        raise NoRule("is a per-step scan output")

    def shard_parts(
        self, spec: Any, qarray_parts: Callable[[Any, Any], Any]
    ) -> tuple[Any, Any, Callable[[Any], Any]]:
        """A `shard_map` operand with `PartitionSpec` `spec`, as (leaves, their specs, rebuild
        from one shard's leaves). By default its pytree leaves, all under `spec`.

        Args:
          qarray_parts: (`QArray`, spec) -> the same triple for a packed array.
        Raises:
          NoRule: the value cannot be sharded as it is (the engine dequantizes it, counted).
        """
        return self, spec, lambda local: local


class ArrayBacked(EngineValue):
    """An `EngineValue` whose logical shape and dtype are those of one of its fields.

    A value wrapping an array (a QAT or fp8 weight's float `value`, a LoRA weight's `base`, a
    prepared weight's logical `meta`) names that field once in `backing`, instead of writing
    the same `shape` / `dtype` pair of properties again.

    Attributes:
      backing: the name of the field whose `shape` and `dtype` this value has.
    """

    backing: ClassVar[str]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, self.backing).shape)

    @property
    def dtype(self) -> Any:
        return getattr(self, self.backing).dtype

    def map_backing(
        self, qarray_fn: Callable[[Any], Any], float_fn: Callable[[Any], Any], what: str
    ) -> ArrayBacked:
        """This value with a layout op that leaves the shape alone (a copy, a cast) applied to
        its backing field: `qarray_fn` on a packed value, `float_fn` on a float array.

        A wrapper's extra state (an adapter, a rotation, fp8 scales) is laid out for the
        backing's shape, so an op that changes the shape cannot keep it.

        Raises:
          NoRule: the op changes the shape ("changes the shape of `what`"); the engine then
            dequantizes the value.
        """
        old = getattr(self, self.backing)
        new = qarray_fn(old) if isinstance(old, EngineValue) else float_fn(old)
        if tuple(new.shape) != tuple(old.shape):
            raise NoRule(f"changes the shape of {what}")
        return dataclasses.replace(self, **{self.backing: new})

    def describe_backing(self) -> str:
        """The backing field for the report: its own description, or ``float(shape)``."""
        x = getattr(self, self.backing)
        return x.describe() if isinstance(x, EngineValue) else f"float{tuple(x.shape)}"
