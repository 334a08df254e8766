"""A decoder converted one layer at a time with calibrated rounding (GPTQ, AWQ, SmoothQuant).

`convert_checkpoint(..., model=config, calibration=batches)` runs this for a recipe whose rules
round with an algorithm, as the GPTQ paper quantizes deep models: the calibration tokens are
embedded, then for each layer in turn its float weights are read from the file, its statistics
are captured on the hidden states entering it, its weights are rounded (`lowbit.quantize` on
that layer alone, so every rule, algorithm and option applies as to a loaded model) and
written, and the hidden states go through the *quantized* layer to the next one; the layer's
float weights are then dropped. The final norm and the output projection (a tied embedding is
the output projection too) come last, calibrated on the last hidden states; the embedding
table itself is read first, for the lookups, and written last.

Resident at once: one layer's float weights and statistics, the embedding table, and the
hidden states of the calibration batches (batches x tokens x dim float32).

A layer's statistics come from the quantized layers below it (GPTQ's sequential form), where
`lowbit.quantize` on the whole loaded model captures every layer from the float model (or in
`AlgorithmOptions.sequential` passes): the two agree closely, not bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowbit._host_memory import release_free_memory
from lowbit.api import AlgorithmOptions, quantize, run
from lowbit.io._placement import nest
from lowbit.models import Decoder, DecoderConfig
from lowbit.recipes import Recipe

Path = tuple


def _split_paths(paths: Iterable[Path], n_layers: int) -> tuple[list[list[Path]], list[Path]]:
    """(paths of each layer, the other paths)."""
    layers: list[list[Path]] = [[] for _ in range(n_layers)]
    rest = []
    for path in paths:
        if len(path) > 2 and path[0] == "layers" and isinstance(path[1], int):
            layers[path[1]].append(path)
        else:
            rest.append(path)
    return layers, rest


def _leaves(tree: Any, prefix: Path = ()) -> Iterable[tuple[Path, Any]]:
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, (*prefix, key))
    else:
        yield prefix, tree


def _check_tokens(calibration: Sequence[Any], vocab: int) -> list[np.ndarray]:
    batches = []
    for i, batch in enumerate(calibration):
        tokens = np.asarray(batch[0] if isinstance(batch, tuple) else batch)
        if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer) or tokens.size == 0:
            raise ValueError(
                f"calibration[{i}] must be token ids [batch, seq] (ints), got "
                f"{tokens.dtype}{list(tokens.shape)}"
            )
        if tokens.min() < 0 or tokens.max() >= vocab:
            raise ValueError(
                f"calibration[{i}] holds token ids outside the model's vocabulary of {vocab}"
            )
        batches.append(tokens.astype(np.int32))
    if not batches:
        raise ValueError("calibration is empty: give token batches [batch, seq]")
    return batches


def convert_layers(
    read: Callable[[Path], Any],
    paths: Sequence[Path],
    write: Callable[[Path, Any], None],
    recipe: Recipe,
    config: DecoderConfig,
    calibration: Sequence[Any],
    *,
    options: AlgorithmOptions | None = None,
) -> None:
    """Quantizes a decoder read tensor by tensor, one layer at a time (module docstring).

    Args:
      read: ``read(path) -> array``, the float tensor of the source at a params path.
      paths: every params path the source holds (``("layers", 3, "attn", "q_proj",
        "kernel")``).
      write: ``write(path, leaf)``, called once per path with the quantized (or kept) leaf.
      recipe: the recipe (its rules may round with algorithms).
      config: the decoder the paths belong to.
      calibration: token batches, each ``[batch, seq]`` ints (or a 1-tuple of one).
      options: `AlgorithmOptions` for the algorithms.
    Raises:
      ValueError: for calibration that is not token batches of this model's vocabulary, or a
        source that lacks a tensor the decoder needs.
    """
    batches = _check_tokens(calibration, config.vocab_size)
    model = Decoder.abstract(config)
    needed = [p for p, _ in _leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))]
    missing = sorted(set(needed) - set(map(tuple, paths)), key=str)
    if missing:
        raise ValueError(
            f"the source lacks {len(missing)} tensors the decoder needs, e.g. "
            f"{'/'.join(map(str, missing[0]))!r}"
        )
    layer_paths, rest = _split_paths(paths, config.n_layers)
    # The decoder without layers: embedding, final norm and output projection.
    top = Decoder.abstract(dataclasses.replace(config, n_layers=0))
    extra = {} if options is None else {"algorithm_options": options}

    def merged(module: nnx.Module, params: dict) -> Any:
        graphdef, state = nnx.split(module)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)

    def embed(params: dict, tokens: jax.Array) -> jax.Array:
        return merged(top, params).embed_tokens(tokens)

    def head(params: dict, x: jax.Array) -> jax.Array:
        return merged(top, params).head(x)

    # Per batch shape, the layers' rotary tables and masks: computed here, outside any trace,
    # and closed over as constants.
    inputs = {t.shape: top.layer_inputs(t.shape) for t in batches}

    def layer_fn(i: int) -> Callable:
        def fn(params: dict, x: jax.Array) -> jax.Array:
            block = merged(model.layers[i], params["layers"][i])
            return block(x, inputs[tuple(x.shape[:2])].of(config, i), None)[0]

        return fn

    def calibrated(params: dict, fn: Callable, hidden: list) -> dict:
        return quantize(
            params,
            recipe,
            fn=fn,
            calibration=[(x,) for x in hidden],
            kernel_layouts=False,
            **extra,
        )

    table = nest((p, jnp.asarray(read(p))) for p in rest if p[0] == "embed")
    lookup = jax.jit(embed)
    hidden = [lookup(table, jnp.asarray(t)) for t in batches]
    del table
    for i in range(config.n_layers):
        fn = layer_fn(i)
        q = calibrated(nest((p, jnp.asarray(read(p))) for p in layer_paths[i]), fn, hidden)
        forward = jax.jit(run(fn))
        hidden = [forward(q, x) for x in hidden]
        for path, leaf in _leaves(q):
            write(path, leaf)
        del q
        release_free_memory()
    q = calibrated(nest((p, jnp.asarray(read(p))) for p in rest), head, hidden)
    for path, leaf in _leaves(q):
        write(path, leaf)
