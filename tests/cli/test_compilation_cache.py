"""A second start of the same model through the CLI (JAX's persistent cache and the kept
program files on) compiles nothing: every program, the small ones that convert and lay out
the weights too, is read back from the cache."""

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny_gguf import write_tiny_gguf  # noqa: E402

from lowbit.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _generate(path: Path, cache: Path) -> str:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))
    }
    env.update(LOWBIT_COMPILATION_CACHE=str(cache), JAX_LOG_COMPILES="1", PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from lowbit.cli import console; console()"]
        + ["generate", str(path), "--prompt", "hi", "--max-new-tokens", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_a_second_generate_compiles_and_traces_nothing(tmp_path):
    source = write_tiny_gguf("llama", tmp_path / "tiny.gguf")
    path = tmp_path / "q4_1.gguf"
    assert main(["export", str(source), "--recipe", "int4w_g32_asym", "--gguf", str(path)]) == 0
    first = _generate(path, tmp_path / "cache")
    assert "Finished XLA compilation" in first
    kept = {p.name.split("-")[0] for p in (tmp_path / "cache" / "lowbit-programs").iterdir()}
    assert {"kernel", "fallbacks", "generate"} <= kept
    second = _generate(path, tmp_path / "cache")
    # JAX logs a program read back from its cache as compiled too, after a line saying so.
    compiled = [line for line in second.splitlines() if "Finished XLA compilation" in line]
    hits = [line for line in second.splitlines() if "Persistent compilation cache hit" in line]
    assert compiled and len(hits) == len(compiled), "\n".join(compiled + hits)
