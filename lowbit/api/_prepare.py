"""`lowbit.prepare`: quantized weights laid out once for the CPU kernels that serve them.

Preparation is one explicit transform with one home. Its two forms:

    served = lowbit.prepare(qparams, fn, *example_args)   # params of `fn(params, *args)`
    lowbit.prepare(qmodel, *example_args)                  # an NNX module, updated in place

trace the call abstractly (nothing runs) to find the axis each 2-D quantized weight is
contracted over, then replace every weight a kernel runs by its `lowbit.ops.PreparedQArray`
(`lowbit.ops.prepare_weights`): the kernel's layout *instead of* the codes, so each weight is
resident once and no call repacks it. Saving, dequantizing and any other use recover the
logical QArray exactly; other leaves are returned as they are. The CLI, the loaders
(`lowbit.serving`) and `QuantizedModel` all prepare through this module and the layout
functions it calls (`_kernel_layout`).
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from lowbit.api._kernel_layout import prepare_module, prepare_params
from lowbit.api._model import QuantizedModel


def prepare(target: Any, *args: Any, **kwargs: Any) -> Any:
    """`lowbit.prepare`: quantized weights laid out once for the CPU kernels (module docstring).

    ``prepare(qparams, fn, *example_args, **example_kwargs)`` returns the params prepared for
    ``fn(qparams, *example_args, **example_kwargs)``.
    ``prepare(module, *example_args, **example_kwargs)`` prepares an NNX module (a
    `QuantizedModel`, or any module whose state holds QArrays) for its ``__call__``, in place,
    and returns it.

    Raises:
      TypeError: for params given without the function they serve.

    Example:
      >>> qparams = lowbit.quantize(params, "int8")
      >>> served = lowbit.prepare(qparams, model.apply, x)
    """
    if isinstance(target, nnx.Module):
        # The wrapper records that it is prepared, so its first call does not trace again.
        if isinstance(target, QuantizedModel):
            target.prepare("__call__", *args, **kwargs)
            return target
        return prepare_module(target, "__call__", *args, **kwargs)
    if not args or not callable(args[0]):
        raise TypeError(
            "lowbit.prepare(qparams, fn, *example_args): params need the function they serve "
            f"as the second argument, got {type(args[0]).__name__ if args else 'nothing'}; "
            "for an NNX module call lowbit.prepare(model, *example_args)"
        )
    fn, *example = args
    return prepare_params(fn, target, *example, **kwargs)
