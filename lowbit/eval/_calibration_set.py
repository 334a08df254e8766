"""Calibration batches for data-driven algorithms (GPTQ, AWQ, SmoothQuant), and a cache of the
statistics captured from them so several recipes of one model share one calibration pass.

Language models: ``sequences`` consecutive windows of ``length`` tokens of the calibration text
(default: `calibration_text`, speeches disjoint from the evaluation text), in batches of
``batch`` windows. Encoders: the text's lines and sentences, padded in batches.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
from flax import nnx

from lowbit.algorithms import capture, output_sensitivity
from lowbit.eval._corpus import calibration_text, read_text
from lowbit.eval._harness import pad_batch
from lowbit.serving import Calibrate, LoadedModel, model_fn

SEQUENCES = 128
LENGTH = 512
BATCH = 2
# An encoder calibrates on sentences (~24 tokens each), not 512-token windows: 4096 of them (all
# 4059 of the default text, ~97k tokens) is the LM default's order of token count (65k). GPTQ on
# MiniLM needs it: its FFN output layer reads 1536 inputs, and 128 sentences (~3k rows) gave a
# cosine of 0.9877, 512 0.9895, 2048 0.9903, 4096 0.9907 (int4 g32 asym; 0.9910 batched by length).
ENCODER_SENTENCES = 4096

_STATS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def lm_batches(
    tokenizer: Any,
    text: str | None = None,
    *,
    sequences: int = SEQUENCES,
    length: int = LENGTH,
    batch: int = BATCH,
) -> list[np.ndarray]:
    """[batch, length] int32 token windows (the last batch may be smaller).

    Raises:
      ValueError: if the text has fewer than `length` tokens.
    """
    text = calibration_text() if text is None else text
    ids = np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, np.int32)
    n = min(sequences, len(ids) // length)
    if n < 1:
        raise ValueError(
            f"calibration text has {len(ids)} tokens; one sequence needs {length}: give a longer "
            "text"
        )
    windows = ids[: n * length].reshape(n, length)
    return [windows[i : i + batch] for i in range(0, n, batch)]


def encoder_batches(
    tokenizer: Any, text: str | None = None, *, sequences: int = ENCODER_SENTENCES, batch: int = 16
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens, mask) batches of up to `sequences` sentences of the text."""
    text = calibration_text() if text is None else text
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+|\n+", text) if len(s.strip()) > 20]
    if not sentences:
        raise ValueError("calibration text has no sentence longer than 20 characters")
    # Batched by length: few padded positions run through the model (`row_mask` keeps them
    # out of the statistics) and few padded widths compile the capture walk.
    sentences = sorted(sentences[:sequences], key=len)
    return [pad_batch(tokenizer, sentences[i : i + batch]) for i in range(0, len(sentences), batch)]


def row_mask(kind: str) -> Callable[..., Any] | None:
    """The calibration positions that count (`capture`'s `row_mask`): an encoder batch's
    attention mask (its padded positions run through the model like tokens); None for LMs,
    whose windows are all tokens."""
    return None if kind == "lm" else (lambda tokens, mask: mask)


def cached_statistics(model: nnx.Module, key: Any, compute: Callable[[], Any]) -> Any:
    """Statistics of `model` under `key` (calibration set and weights), computed once."""
    per_model = _STATS.setdefault(model, {})
    if key not in per_model:
        per_model[key] = compute()
    return per_model[key]


def calibrator(
    calibration_file: str | None = None,
    sequences: int | None = None,
    *,
    on_batch: Callable[[int, int], None] | None = None,
) -> Calibrate:
    """`lowbit.eval.calibrator`: the `lowbit.serving.Calibrate` of this calibration set.

    The statistics are cached per model and calibration set, so recipes of one model share one
    calibration pass.

    Args:
      calibration_file: a text file to calibrate on instead of the default speeches.
      sequences: number of calibration sequences (default `SEQUENCES` of `LENGTH` tokens; for
        an encoder, sentences: default `ENCODER_SENTENCES`).
      on_batch: progress callback ``(done, total)`` over the calibration batches.
    """

    def calibrate(loaded: LoadedModel, params: Any, paths: tuple[str, ...], rows: Any) -> Any:
        n, batches = _batches(loaded, calibration_file, sequences)
        fn = model_fn(loaded.model, loaded.kind)
        progress = None if on_batch is None else (lambda done: on_batch(done, len(batches)))
        key = (calibration_file, n, paths, rows)
        return cached_statistics(
            loaded.model,
            key,
            lambda: capture(
                fn,
                params,
                batches,
                paths=paths,
                sample_rows=rows,
                row_mask=row_mask(loaded.kind),
                on_batch=progress,
            ),
        )

    return calibrate


def lm_calibration_batches(
    tokenizer: Any, calibration_file: str | None = None, sequences: int | None = None
) -> list[np.ndarray]:
    """A language model's calibration set in `tokenizer`'s ids: `lm_batches` of the text file
    (default: `calibration_text`), `sequences` windows (default `SEQUENCES`)."""
    text = None if calibration_file is None else read_text(calibration_file)
    return lm_batches(tokenizer, text, sequences=SEQUENCES if sequences is None else sequences)


def _batches(loaded: LoadedModel, calibration_file: str | None, sequences: int | None):
    """(sequences, batches) of the calibration set for the model's kind."""
    if loaded.kind == "lm":
        n = SEQUENCES if sequences is None else sequences
        return n, lm_calibration_batches(loaded.tokenizer, calibration_file, n)
    text = None if calibration_file is None else read_text(calibration_file)
    n = ENCODER_SENTENCES if sequences is None else sequences
    return n, encoder_batches(loaded.tokenizer, text, sequences=n)


SENSITIVITY_BATCHES = 16
"""Calibration batches `output_sensitivity_of` runs backward passes on (spread evenly over the
set). On MiniLM, 16 of its 254 default batches planned as well as all of them (3.5 bits:
cosine 0.911 against 0.905), in a sixteenth of the backward passes."""


def output_sensitivity_of(
    loaded: LoadedModel,
    params: Any,
    paths: tuple[str, ...],
    calibration_file: str | None = None,
    sequences: int | None = None,
    *,
    probes: int = 4,
) -> dict[str, Any]:
    """`lowbit.algorithms.output_sensitivity` of a loaded model on this calibration set (at
    most `SENSITIVITY_BATCHES` of its batches, `probes` projections each)."""
    _, batches = _batches(loaded, calibration_file, sequences)
    if len(batches) > SENSITIVITY_BATCHES:
        picks = np.linspace(0, len(batches) - 1, SENSITIVITY_BATCHES).round().astype(int)
        batches = [batches[i] for i in picks]
    return output_sensitivity(
        model_fn(loaded.model, loaded.kind),
        params,
        batches,
        paths=paths,
        probes=probes,
        row_mask=row_mask(loaded.kind),
    )
