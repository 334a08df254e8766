"""`lowbit quantize MODEL --bits B | --max-bytes N`: a format per weight chosen under a size
budget (`lowbit.api.choose_plan`), written as a checkpoint or, for a ``.gguf`` output, as a
GGUF file whose tensors carry the chosen GGML types.

Candidates are scored on the model's output change (`--sensitivity output`, backward passes
over the calibration set) unless ``--sensitivity gram`` asks for the layers' own output errors.
The plan is a recipe: printed as a table with the bits per layer, saved with ``--plan-out``
(reused by ``--recipe plan.json``), drawn with ``--plot``, and stored in the checkpoint.
Calibration statistics of every weight are held in memory (one Gram matrix per weight), and
so is the model.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from flax import nnx

from lowbit import serving
from lowbit._atomic import atomic_write
from lowbit.api import (
    AlgorithmOptions,
    check_budget,
    measure_candidates,
    plan_within,
    planned_weights,
    quantize_params,
    time_candidates,
)
from lowbit.cli._common import (
    META_KIND,
    META_MODEL,
    META_RECIPE,
    calibration_sequences,
    progress,
    step,
)
from lowbit.eval import (
    calibrator,
    float32_bytes,
    output_sensitivity_of,
    param_bytes,
    plot_bits_per_layer,
)
from lowbit.io import check_save_path, export_gguf, gguf_plan_bytes, save_checkpoint
from lowbit.recipes import default_candidates, parse_candidates, storable
from lowbit.serving import ready

PLAN_NAME = "plan"


def add_budget_arguments(parser: argparse.ArgumentParser) -> None:
    """``--bits``, ``--max-bytes``, ``--candidates``, ``--target``, ``--sensitivity``,
    ``--max-ms-per-token``, ``--plan-out``, ``--plot``."""
    budget = parser.add_argument_group(
        "size budget (instead of --recipe): a format per weight chosen on calibration data"
    )
    budget.add_argument(
        "--bits",
        type=float,
        metavar="B",
        help="mean stored bits per weight over the planned weights, scales included (e.g. 3.5)",
    )
    budget.add_argument(
        "--max-bytes",
        type=int,
        metavar="N",
        help="the size of the model's GGUF file (Llama-family models: --out FILE.gguf, or "
        "`lowbit export DIR --gguf FILE` from the checkpoint), metadata, norms and padding "
        "included, each weight counted in the GGUF type the export writes it as; for other "
        "models, the checkpoint's stored bytes of the planned weights",
    )
    budget.add_argument(
        "--candidates",
        metavar="LIST",
        help="comma-separated FORMAT[:gN][:sym|asym][:gptq] (e.g. int4:g64:asym,nf4:g64,"
        "int3:g64:gptq,q4_k,q8_0); default: lowbit's 2- to 8-bit formats, or for a GGUF "
        "target the GGML types lowbit encodes",
    )
    budget.add_argument(
        "--target",
        choices=("lowbit", "gguf"),
        help="what stores the plan (default: gguf when --out ends in .gguf, else lowbit)",
    )
    budget.add_argument(
        "--sensitivity",
        choices=("gram", "output"),
        help="what a candidate's error is: output (default), the model's output change (a "
        "Gauss-Newton score from backward passes); gram, each layer's own output error on the "
        "calibration inputs (no backward passes: faster and lighter, but blind to how much a "
        "layer's error reaches the output; its plans were far worse on SmolLM2 and MiniLM)",
    )
    budget.add_argument(
        "--max-ms-per-token",
        type=float,
        metavar="MS",
        help="also limit the planned weights' kernel time for one token (a decode step), each "
        "candidate timed on this machine",
    )
    budget.add_argument("--plan-out", metavar="FILE.json", help="write the plan (a recipe) here")
    budget.add_argument("--plot", metavar="FILE.png", help="draw the bits per layer here")


def budget_requested(args: argparse.Namespace) -> bool:
    """Whether the command chooses a plan (``--bits`` / ``--max-bytes``) instead of a recipe.

    Raises:
      ValueError: for a recipe and a budget together, neither, or plan-only options without
        a budget.
    """
    budget = args.bits is not None or args.max_bytes is not None
    if budget and args.recipe is not None:
        raise ValueError("give --recipe or a budget (--bits / --max-bytes), not both")
    if not budget and args.recipe is None:
        raise ValueError("give --recipe NAME|FILE.json, or a budget: --bits B or --max-bytes N")
    if not budget:
        extra = [
            f
            for f in ("candidates", "sensitivity", "max_ms_per_token", "plan_out", "plot")
            if getattr(args, f) is not None
        ]
        if extra:
            flag = "--" + extra[0].replace("_", "-")
            raise ValueError(f"{flag} goes with a budget (--bits / --max-bytes)")
    return budget


def target_of(args: argparse.Namespace) -> str:
    """``"gguf"`` or ``"lowbit"``: ``--target``, else by the output's suffix.

    Raises:
      ValueError: for ``--target gguf`` with an output that is not a ``.gguf`` file.
    """
    suffix_gguf = str(args.out).endswith(".gguf")
    target = args.target or ("gguf" if suffix_gguf else "lowbit")
    if target == "gguf" and not suffix_gguf:
        raise ValueError(f"--target gguf writes a GGUF file: give --out FILE.gguf, not {args.out}")
    return target


def run_budget(args: argparse.Namespace) -> int:
    """Chooses, prints and writes a plan, then the quantized model (see module docstring)."""
    target = target_of(args)
    given = parse_candidates(args.candidates) if args.candidates else None
    candidates = storable(given or default_candidates(target), target)  # before the slow work
    for flag in ("plan_out", "plot"):
        _check_writable(getattr(args, flag), "--" + flag.replace("_", "-"))
    sequences = calibration_sequences(args)  # checked before the slow work
    if args.max_ms_per_token is not None and not args.max_ms_per_token > 0:
        raise ValueError(f"--max-ms-per-token={args.max_ms_per_token} must be > 0")
    name = Path(args.plan_out).stem if args.plan_out else PLAN_NAME
    with progress() as bar:
        with step(bar, f"loading {args.model}"):
            loaded = serving.load_model(args.model)
        pure = nnx.to_pure_dict(nnx.split(loaded.model)[1])
        _check_gguf_model(loaded, target)
        paths = tuple(planned_weights(pure, candidates))
        file = _gguf_file(loaded, pure, paths) if args.max_bytes is not None else None
        if file is not None and given is None:
            # In the file, a lowbit format that is not a GGML type is requantized to Q8_0:
            # it costs Q8_0's bytes for more error than Q8_0's, so only GGML types are worth
            # their bytes (and they give the knapsack finer steps: Q5_0, Q5_1, Q6_K, ...).
            candidates = default_candidates("gguf")
        check_budget(
            pure,
            bits=args.bits,
            max_bytes=args.max_bytes,
            candidates=candidates,
            target=target,
            file=file,
        )
        with step(bar, "calibrating") as on_batch:
            calibrate = calibrator(args.calibration, sequences, on_batch=on_batch)
            statistics = calibrate(loaded, pure, paths, 0)
        sensitivity = None
        if (args.sensitivity or "output") == "output":
            with step(bar, "output sensitivity (backward passes)"):
                sensitivity = output_sensitivity_of(
                    loaded, pure, paths, args.calibration, sequences
                )
        with step(bar, "measuring candidates") as on_weight:
            measured = measure_candidates(
                pure,
                statistics,
                candidates=candidates,
                target=target,
                on_weight=on_weight,
                sensitivity=sensitivity,
                file=file,
            )
        if args.max_ms_per_token is not None:
            with step(bar, "timing candidates") as on_weight:
                measured = time_candidates(measured, on_weight=on_weight)
        plan = plan_within(
            measured,
            bits=args.bits,
            max_bytes=args.max_bytes,
            name=name,
            max_ms_per_token=args.max_ms_per_token,
        )
        print(plan)
        if args.plan_out:
            atomic_write(args.plan_out, (plan.recipe.to_json() + "\n").encode("utf-8"))
            print(f"wrote plan {args.plan_out} (reuse it with --recipe {args.plan_out})")
        if args.plot:
            title = f"{loaded.name}: {plan.bits:.3f} bits per weight ({target})"
            plot_bits_per_layer(plan.bits_per_layer(), args.plot, title=title)
            print(f"wrote {args.plot}")
        with step(bar, f"quantizing with plan {name}"):
            options = AlgorithmOptions(statistics=statistics)
            params = quantize_params(pure, plan.recipe, algorithm_options=options)
        write_output(bar, args, loaded, params, plan.recipe, name)
    return 0


def write_output(bar: Any, args: Any, loaded: Any, params: Any, recipe: Any, label: str) -> None:
    """Writes quantized `params` (logical QArrays) to ``args.out``: a GGUF file when it ends
    in ``.gguf`` (each weight as its direct GGML type), else a checkpoint directory."""
    if str(args.out).endswith(".gguf"):
        _check_gguf_model(loaded, "gguf")
        lines: list[str] = []
        with step(bar, f"writing {args.out}"):
            report = export_gguf(
                params,
                args.out,
                config=loaded.model.config,
                source=loaded.gguf_path,
                log=lines.append,
            )
        for line in lines:
            print(line)
        counts: dict[str, int] = {}
        for t in report.tensors:
            counts[t.ggml_type] = counts.get(t.ggml_type, 0) + 1
        types = ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
        print(f"wrote {args.out}: {report.nbytes / 1e6:.2f} MB, tensors {types}")
        return

    check_save_path(args.out)
    metadata = {META_MODEL: loaded.spec, META_RECIPE: label, META_KIND: loaded.kind}
    with step(bar, f"writing {args.out}"):
        save_checkpoint(args.out, ready(loaded, params), recipe=recipe, metadata=metadata)
    size, reference = param_bytes(params), float32_bytes(params)
    print(
        f"wrote {args.out}: {loaded.name} with recipe {label}, {size / 1e6:.2f} MB "
        f"({size / reference:.3f} of float32 {reference / 1e6:.2f} MB)"
    )


def _gguf_file(loaded: Any, pure: Any, paths: tuple[str, ...]) -> Any:
    """How the GGUF file of a Llama-family model counts a plan's bytes (`gguf_plan_bytes`),
    for a ``--max-bytes`` budget: the file written by ``--out FILE.gguf``, or by ``lowbit
    export DIR --gguf FILE`` from the checkpoint. None for other models (their budget is the
    checkpoint's planned weights)."""
    if loaded.kind != "lm" or not hasattr(getattr(loaded.model, "config", None), "n_kv_heads"):
        return None
    return gguf_plan_bytes(pure, paths, config=loaded.model.config, source=loaded.gguf_path)


def _check_gguf_model(loaded: Any, target: str) -> None:
    config = getattr(loaded.model, "config", None)
    if target == "gguf" and (loaded.kind != "lm" or not hasattr(config, "n_kv_heads")):
        raise ValueError(
            f"a GGUF output holds a Llama-family language model; {loaded.name!r} is not one: "
            "write a checkpoint directory instead (--out DIR)"
        )


def _check_writable(path: str | None, flag: str) -> None:
    if path is None:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError(f"{flag} {path}: directory {directory!r} does not exist")
