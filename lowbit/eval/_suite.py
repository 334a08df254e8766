"""Evaluate one reference model under several recipes: the loop behind the demo and benchmarks."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence

from lowbit.eval._report import ResultRow
from lowbit.eval._session import ModelSession
from lowbit.eval._sqnr import output_sqnr, weight_sqnr
from lowbit.eval._variants import quantize_variant
from lowbit.serving import FLOAT_RECIPE, load_model, rotated_for_spec

# ``stage(description)`` -> context manager yielding ``advance(done, total)``: progress display.
Stage = Callable[[str], contextlib.AbstractContextManager[Callable[[int, int], None]]]


@contextlib.contextmanager
def _silent(description: str) -> Iterator[Callable[[int, int], None]]:
    del description
    yield lambda done, total: None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SuiteResult:
    """Attributes:
    rows: one `ResultRow` per recipe, in order.
    layer_sqnr: ``{"model/recipe": {"weight": {path: dB}, "output": {path: dB}}}`` for every
      recipe but ``float``.
    """

    rows: tuple[ResultRow, ...]
    layer_sqnr: dict[str, dict[str, dict[str, float]]]


def evaluate_recipes(
    model: str,
    recipes: Sequence[str],
    *,
    max_tokens: int = 4096,
    context: int = 512,
    measure_speed: bool = True,
    calibration_sequences: int | None = None,
    stage: Stage | None = None,
    on_row: Callable[[ResultRow], None] | None = None,
) -> SuiteResult:
    """Loads `model` once and measures each recipe: size, quality, speed, per-layer SQNR.

    Args:
      model: a model spec (`lowbit.serving.load_model`), e.g. ``"smollm2"``.
      recipes: recipe specs: preset names, recipe JSON paths, ``"float"``, ``"gguf"``.
      max_tokens: tokens scored for perplexity (language models).
      context: perplexity window, also the prefill length timed.
      measure_speed: time prefill and decode.
      calibration_sequences: calibration size for data-driven recipes (default: the CLI's).
      stage: progress display (see `Stage`); silent by default.
      on_row: called with each recipe's row as soon as it is measured (long runs).
    Returns:
      A `SuiteResult`.
    Raises:
      ValueError / FileNotFoundError: from loading the model or a recipe.
    """
    stage = stage or _silent
    with stage(f"loading {model}"):
        loaded = load_model(model)
        session = ModelSession(loaded, max_tokens=max_tokens, context=context)
    rows, layer_sqnr = [], {}
    for recipe in recipes:
        # A rotating recipe runs on its rotated model (another structure: its own session).
        variant = rotated_for_spec(loaded, recipe)
        if variant is not loaded:
            measured = ModelSession(variant, max_tokens=max_tokens, context=context)
        else:
            measured = session
        with stage(f"{loaded.name}: quantizing with {recipe}") as advance:
            params, _ = quantize_variant(
                variant,
                measured.float_params,
                recipe,
                calibration_sequences=calibration_sequences,
                on_batch=advance,
            )
        what = "perplexity" if loaded.kind == "lm" else "cosine"
        with stage(
            f"{loaded.name} {recipe}: {what}" + (" and speed" if measure_speed else "")
        ) as advance:
            rows.append(
                measured.row(recipe, params, measure_speed=measure_speed, on_window=advance)
            )
        if on_row is not None:
            on_row(rows[-1])
        if recipe != FLOAT_RECIPE:
            with stage(f"{loaded.name} {recipe}: per-layer SQNR"):
                layer_sqnr[f"{loaded.name}/{recipe}"] = {
                    "weight": weight_sqnr(measured.float_params, params),
                    "output": output_sqnr(measured.float_params, params),
                }
        del params
    return SuiteResult(rows=tuple(rows), layer_sqnr=layer_sqnr)
