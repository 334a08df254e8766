"""The `lowbit` command: argument parsing, dispatch, and the error contract.

Every command has ``--help``. Errors print one line, ``lowbit: error: <message>``, on stderr and
exit with status 2; ``--debug`` (before or after the command name) shows the traceback instead.

``--json`` (commands that take it): on success the result is one JSON object and the only line
on stdout (tables and progress go to stderr), so ``lowbit eval ... --json | jq`` works; on any
error, stdout gets one JSON object ``{"error": message, "type": ..., "exit_code": 2}`` as well,
so a script can parse every outcome. A command that takes ``--json`` prints its result with
`print_json` and everything else to stderr when ``args.json`` is set.
"""

from __future__ import annotations

import argparse
import atexit
import difflib
import os
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import NoReturn

import jax

from lowbit.cli import (
    _cmd_bench,
    _cmd_eval,
    _cmd_export,
    _cmd_finetune,
    _cmd_generate,
    _cmd_quantize,
    _cmd_recipes,
    _cmd_report,
    _cmd_serve,
    _demo,
)
from lowbit.cli._common import Command, print_json

EXIT_OK = 0
EXIT_ERROR = 2

# In the order of `lowbit --help`.
COMMANDS: tuple[Command, ...] = (
    _cmd_quantize.COMMAND,
    _cmd_eval.COMMAND,
    _cmd_finetune.COMMAND,
    _cmd_report.COMMAND,
    _cmd_bench.COMMAND,
    _cmd_generate.COMMAND,
    _cmd_serve.COMMAND,
    _cmd_export.COMMAND,
    _demo.COMMAND,
    _cmd_recipes.COMMAND,
)


class UsageError(Exception):
    """A command-line usage error, reported as one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's default prints usage and exits
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `lowbit` and all its commands."""
    debug = _Parser(add_help=False)
    debug.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show the full traceback of an error",
    )
    parser = _Parser(
        prog="lowbit",
        description="Quantize JAX models, evaluate them and report sizes, quality and speed.",
        parents=[debug],
    )
    parser.set_defaults(debug=False)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for command in COMMANDS:
        sub = subparsers.add_parser(
            command.name, help=command.help, description=command.help, parents=[debug]
        )
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def _unrecognized(parser: argparse.ArgumentParser, command: str | None, extra: list[str]) -> str:
    """The error for arguments no parser took, naming the closest option of the command and
    pointing at the command's own help (argparse names the top-level one: the subcommand's
    parser hands what it does not know up to it)."""
    sub = parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            sub = action.choices[command]
    options = [s for action in sub._actions for s in action.option_strings]
    message = f"unrecognized arguments: {' '.join(extra)}"
    for arg in extra:
        if arg.startswith("-"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], options, n=1)
            if close:
                message += f"; did you mean {close[0]}?"
                break
    return f"{message} (see `{sub.prog} --help`)"


def _one_line(err: BaseException) -> str:
    text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    if isinstance(err, UsageError | ValueError | FileNotFoundError | TypeError):
        return text or type(err).__name__
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


COMPILATION_CACHE_ENV = "LOWBIT_COMPILATION_CACHE"


def _use_compilation_cache() -> None:
    """JAX's persistent compilation cache in the user's cache directory, so that a second
    `serve`, `generate` or `bench` of the same model loads its compiled programs instead of
    compiling them again. ``LOWBIT_COMPILATION_CACHE=DIR`` moves it, ``=0`` turns it off; a
    cache directory the user configured for JAX is left as it is."""
    setting = os.environ.get(COMPILATION_CACHE_ENV, "")
    if setting == "0" or jax.config.jax_compilation_cache_dir:
        return
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    jax.config.update("jax_compilation_cache_dir", setting or os.path.join(base, "lowbit", "jax"))
    # Every program, however quickly it compiles: a start runs some fifty small ones (the
    # GGUF blocks' conversions, the layouts, per shape), 20-40 ms each to compile and a few
    # to read back, about a second of every start; each is a file of a few kB.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `lowbit` command line.

    Args:
      argv: arguments without the program name; defaults to ``sys.argv[1:]``.
    Returns:
      The exit status: 0 on success, 2 on any error.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    # Scanned like --debug, so that a usage error is reported as JSON too.
    json_mode = "--json" in argv
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra:
            raise UsageError(_unrecognized(parser, getattr(args, "command", None), extra))
        _use_compilation_cache()
        if getattr(args, "run", None) is None:
            raise UsageError("a command is required (see `lowbit --help`)")
        return int(args.run(args) or EXIT_OK)
    except SystemExit as exit_:  # --help and --version exit through argparse
        return int(exit_.code or 0) if isinstance(exit_.code, int | None) else EXIT_ERROR
    except KeyboardInterrupt as err:
        print("lowbit: interrupted", file=sys.stderr)
        _json_error(json_mode, "interrupted", err)
        return EXIT_ERROR
    except Exception as err:
        if debug:
            traceback.print_exc()
        else:
            print(f"lowbit: error: {_one_line(err)}", file=sys.stderr)
        _json_error(json_mode, _one_line(err), err)
        return EXIT_ERROR


def console() -> NoReturn:
    """The ``lowbit`` console script: `main`, then the process ends without tearing down its
    interpreter.

    Python's teardown frees every module's objects one by one (JAX's arrays and compiled
    programs, the model's weights): 0.6-0.8 s after a 1.5B model's `lowbit generate`, a tenth
    of a warm start, for memory the system takes back at exit anyway. So after `main`, stdout
    and stderr are flushed and the exit handlers run (JAX's, logging's), as at any exit, and
    the process ends there. Where a thread that is not a daemon still runs (Python would wait
    for it), the exit is the usual one.
    """
    code = main()
    if any(not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`lowbit ... | head`), a closed stream
            code = code or EXIT_ERROR
    atexit._run_exitfuncs()  # the handlers Python's own exit would run
    os._exit(code)


def _json_error(json_mode: bool, message: str, err: BaseException) -> None:
    if json_mode:
        print_json({"error": message, "type": type(err).__name__, "exit_code": EXIT_ERROR})
