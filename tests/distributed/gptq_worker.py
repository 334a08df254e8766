"""worker.py with gptq_scenarios.py as its `scenarios` module (imported when worker.py looks a
scenario up: after `jax.distributed.initialize`, which must come before lowbit starts a
backend)."""

import importlib
import runpy
import sys
import types
from pathlib import Path


class _Scenarios(types.ModuleType):
    def __getattr__(self, name):
        return getattr(importlib.import_module("gptq_scenarios"), name)


# This checkout's lowbit (not an installed one), and the scenarios next to this file.
sys.path[:0] = [str(Path(__file__).parents[2]), str(Path(__file__).parent)]
sys.modules["scenarios"] = _Scenarios("scenarios")
runpy.run_path(str(Path(__file__).with_name("worker.py")), run_name="__main__")
