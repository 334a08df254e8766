"""The `lowbit` command line: quantize, eval, report, bench, demo, recipes."""

from lowbit.cli._main import build_parser, console, main

__all__ = ["build_parser", "console", "main"]
