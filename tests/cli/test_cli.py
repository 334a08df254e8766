"""The `lowbit` command line, called in process: help, recipes, the error and JSON contracts."""

import json
import subprocess
import sys

import pytest

from lowbit.cli import build_parser, main
from lowbit.cli._main import COMMANDS

COMMAND_NAMES = [command.name for command in COMMANDS]


def test_every_expected_command_exists():
    assert set(COMMAND_NAMES) == {
        "quantize",
        "eval",
        "finetune",
        "report",
        "bench",
        "generate",
        "serve",
        "export",
        "demo",
        "recipes",
    }


@pytest.mark.parametrize("argv", [["--help"], *[[name, "--help"] for name in COMMAND_NAMES]])
def test_help(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: lowbit")
    assert "--debug" in out
    if len(argv) == 2:
        assert f"lowbit {argv[0]}" in out


@pytest.mark.parametrize(
    ("flag", "recipe", "target", "expected"),
    [
        # generate / serve (they pass the target) of a GGUF file's own blocks: float16.
        (None, None, "model.Q4_K_M.gguf", "float16"),
        (None, "gguf", "smollm2", "float16"),
        # Asked for: the model's dtype, or another format.
        ("float", None, "model.Q4_K_M.gguf", None),
        ("int8", "gguf", "model.Q4_K_M.gguf", "int8"),
        # Other recipes, and the measuring commands (no target): the model's dtype.
        (None, "float", "model.Q4_K_M.gguf", None),
        (None, None, "smollm2", None),
        (None, "gguf", None, None),
    ],
)
def test_kv_cache_default_is_float16_on_a_gguf_files_own_blocks(flag, recipe, target, expected):
    from lowbit.cli._common import resolve_kv_cache

    kv = resolve_kv_cache(flag, recipe, target)
    assert (None if kv is None else kv.to_text()) == expected


def test_recipes_lists_one_line_per_preset(capsys):
    from lowbit.recipes import preset_names

    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = [line.split()[0] for line in lines]
    assert names == [*preset_names(), "gguf"]
    for required in ("float", "int8w", "int8", "int4w_g32_asym", "int4w_g64", "nf4_g64", "mxfp4"):
        assert required in names
    assert all(len(line.split(maxsplit=1)) == 2 for line in lines)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        ([], "a command is required"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["quantize", "minilm"], "--out"),
        (["quantize", "minilm", "--out", "x"], "give --recipe"),
        (["eval", "no-such-model"], "MODEL 'no-such-model' is not a known model"),
        (["eval", "missing.gguf"], "does not exist"),
        (["eval", "minilm", "--text", "a", "--sentences", "b"], "not allowed with argument"),
        (["demo", "--models", "gpt5"], "--models 'gpt5'"),
        (["demo", "--recipes", "int8w,int2"], "--recipes 'int8w,int2'"),
        (["quantize", "minilm", "--recipe", "int3w", "--out", "x"], "recipe 'int3w'"),
        (["report", "."], "not a checkpoint"),
        (["generate", "smollm2", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["generate", "smollm2", "--prompt", "hi", "--top-p", "1.5"], "top_p"),
        (["eval", "smollm2", "--kv-cache", "int3"], "--kv-cache: 'int3'"),
        (["export", "smollm2", "--gguf", "x.gguf", "--type", "Q7_K"], "'Q7_K' is not supported"),
        (["export", "smollm2"], "--gguf"),
        # Arguments no parser took: the command's closest option and the command's own help.
        (
            ["generate", "smollm2", "--prompt", "hi", "--max-tokens", "20"],
            "--max-tokens 20; did you mean --max-new-tokens? (see `lowbit generate --help`)",
        ),
        (["serve", "x", "--hots=0.0.0.0"], "did you mean --host? (see `lowbit serve --help`)"),
        (["eval", "smollm2", "stray"], "arguments: stray (see `lowbit eval --help`)"),
        (["--bogus"], "unrecognized arguments: --bogus (see `lowbit --help`)"),
    ],
)
def test_errors_are_one_line_without_traceback(argv, fragment, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("lowbit: error: ")
    assert fragment in lines[0]
    assert "Traceback" not in captured.err and captured.out == ""


def test_debug_shows_the_traceback(capsys):
    assert main(["--debug", "eval", "no-such-model"]) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err
    assert main(["eval", "no-such-model", "--debug"]) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err


MINIMAL_ARGS = {
    "quantize": ["m", "--recipe", "r", "--out", "o"],
    "eval": ["m"],
    "finetune": ["m", "--out", "o"],
    "report": ["d"],
    "bench": ["m"],
    "generate": ["m", "--prompt", "p"],
    "serve": ["m"],
    "export": ["m", "--gguf", "o.gguf"],
    "demo": [],
    "recipes": [],
}


@pytest.mark.parametrize("name", COMMAND_NAMES)
def test_debug_is_accepted_after_every_command(name):
    args = build_parser().parse_args([name, *MINIMAL_ARGS[name], "--debug"])
    assert args.debug is True
    assert build_parser().parse_args([name, *MINIMAL_ARGS[name]]).debug is False


def test_print_json_is_one_line_with_null_for_infinity(capsys):
    from lowbit.cli._common import print_json

    print("table above")
    print_json({"sqnr": float("inf"), "rows": [1.5, float("nan")]})
    last = capsys.readouterr().out.splitlines()[-1]
    assert json.loads(last) == {"sqnr": None, "rows": [1.5, None]}


def test_demo_checks_compare_against_the_float_row():
    from lowbit.cli._demo import checks
    from lowbit.eval import ResultRow

    def row(model, recipe, value, metric="ppl"):
        return ResultRow(
            model=model, recipe=recipe, size_bytes=1, float32_bytes=4, metric=metric, value=value
        )

    rows = [
        row("smollm2", "float", 20.0),
        row("smollm2", "int8w", 20.2),  # +1.0%: misses the 0.5% target
        row("smollm2", "int4w_g32_asym", 20.3),  # +1.5%: within 2%
        row("smollm2", "gguf", 20.11),  # +0.55%: misses the 0.5% target
        row("minilm", "int8w", 0.9995, "cosine"),
        row("minilm", "int4w_g32_asym", 0.94, "cosine"),
    ]
    results = {description: ok for description, ok, _ in checks(rows)}
    assert results == {
        "smollm2 int8 weight-only: Δppl <= 0.5%": False,
        "smollm2 asymmetric int4 g32: Δppl <= 2%": True,
        "smollm2 GGUF direct, Q8 activations: Δppl <= 0.5%": False,
        "minilm int8: cosine >= 0.999": True,
        "minilm int4 g32: cosine >= 0.95": False,
    }


def test_a_gguf_declaring_more_layers_than_it_holds_fails_fast_in_one_line(tmp_path, capsys):
    # A small file declaring 10**9 layers once built per-layer maps until memory ran out.
    import gguf
    import numpy as np

    path = tmp_path / "hostile.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in (("block_count", 10**9), ("embedding_length", 8)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_uint32("llama.attention.head_count", 2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(8, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert main(["eval", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("lowbit: error: GGUF file") and "hostile.gguf" in err
    assert "'llama.block_count' declares 1000000000 layers" in err and "holds tensors for 1" in err


def _console(code: str, *argv: str) -> subprocess.CompletedProcess:
    script = f"import sys, threading, time\nfrom lowbit.cli import console\n{code}\nconsole()"
    return subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120
    )


# An object Python's teardown of the module would free, saying so.
TORN_DOWN = """
import os
class Kept:
    def __del__(self, write=os.write):
        write(2, b"torn down\\n")
kept = Kept()
"""


def test_the_console_script_exits_with_mains_status_and_all_its_output():
    done = _console(TORN_DOWN, "recipes")
    assert done.returncode == 0
    assert done.stderr == ""  # the interpreter was not torn down
    assert done.stdout.count("\n") > 10 and "int8w" in done.stdout
    failed = _console("", "quantize", "no-such-model")
    assert failed.returncode == 2 and failed.stderr.startswith("lowbit: error:")
    # An exit handler still runs, as at any exit.
    handler = "import atexit; atexit.register(lambda: print('handled', file=sys.stderr))"
    assert _console(handler, "recipes").stderr == "handled\n"


def test_the_console_script_waits_for_a_thread_that_is_not_a_daemon():
    late = "threading.Thread(target=lambda: (time.sleep(1), print('late', flush=True))).start()"
    done = _console(TORN_DOWN + late, "recipes")
    assert done.returncode == 0 and done.stdout.endswith("late\n")
    assert done.stderr == "torn down\n"  # Python's own exit, after the thread


def test_a_log_names_only_the_steps_that_ran():
    """Without a live display each finished step is a ``done:`` line; a step that may have
    nothing to do (calibrating a recipe without data, rotating a recipe without a rotation)
    is named only if it advanced."""
    import io

    from rich.console import Console
    from rich.progress import Progress

    from lowbit.cli._common import step

    log = io.StringIO()
    with Progress(console=Console(file=log, force_terminal=False)) as bar:
        with step(bar, "loading"):
            pass
        with step(bar, "calibrating", only_if_used=True):
            pass
        with step(bar, "rounding weights", only_if_used=True) as advance:
            advance(1, 2)
    lines = [line.split(" (")[0] for line in log.getvalue().splitlines() if line]
    assert lines == ["done: loading", "done: rounding weights"]
