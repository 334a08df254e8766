"""`lowbit recipes`: the preset recipes, one line each."""

from __future__ import annotations

import argparse

from lowbit.cli._common import Command
from lowbit.recipes import preset_names
from lowbit.serving import GGUF_RECIPE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds this command's arguments to its sub-parser."""
    parser.epilog = (
        "A recipe is a preset name or a .json file (Recipe.to_json); 'gguf' imports a GGUF "
        "file's own quantized blocks."
    )


def run(args: argparse.Namespace) -> int:
    """Runs the command with parsed `args`; returns the exit status (errors raise)."""
    names = dict(preset_names())
    names[GGUF_RECIPE] = (
        "a GGUF file's own blocks (every type of llama.cpp's mixes), each on its type's kernel, "
        "multiplied on int8 activations as llama.cpp does (the default for a .gguf MODEL)"
    )
    width = max(len(n) for n in names)
    for name, description in names.items():
        print(f"{name:<{width}}  {description}")
    return 0


COMMAND = Command(
    "recipes",
    "list the preset recipes (one line each: name and description)",
    add_arguments,
    run,
)
