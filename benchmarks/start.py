"""Start time: `lowbit serve` until `/health` says ok, and `lowbit generate` of 8 tokens,
the first time (empty caches) and the second (JAX's compilation cache and the kept programs
from the first), on the bundled SmolLM2-135M GGUF (Q4_1 / Q8_0) and a random Qwen2-1.5B-shaped
Q4_K_M file; llama.cpp's server started on the same file beside them.

Each start is its own process with the same settings as a user's (`--recipe gguf` by default
for a .gguf). The cache directory is a fresh temporary one (`LOWBIT_COMPILATION_CACHE`), so
the first start is cold however the machine's own cache stands.

``LOWBIT_BENCH_BIG_GGUF=PATH``: use that Qwen2-1.5B-shaped Q4_K_M file (one an earlier run
wrote with `benchmarks._big_gguf.write_gguf`) instead of writing a new one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._machine import cpu_model
from benchmarks.serve import _free_port, _start, _stop

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-c", "import sys; from lowbit.cli import console; console()"]


def _serve_start(path: str, cache: str, logs: Path) -> float:
    """Seconds from launching `lowbit serve` to its first ``/health`` 200. The server is
    stopped once its background compile is done (``/health``'s ``compiling`` 0), as a
    server that ran a while is: so a second start finds every program kept."""
    import httpx

    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), LOWBIT_COMPILATION_CACHE=cache)
    begin = time.perf_counter()
    proc = _start(
        [*CLI, "serve", path, "--port", str(port)],
        f"http://127.0.0.1:{port}/health",
        logs / f"serve-{port}.log",
        env=env,
    )
    seconds = time.perf_counter() - begin
    url = f"http://127.0.0.1:{port}/health"
    while httpx.get(url, timeout=10).json().get("compiling", 0):
        time.sleep(0.5)
    _stop(proc)
    return seconds


def _generate(path: str, cache: str) -> float:
    """Seconds `lowbit generate` takes for 8 new tokens, from launch to exit."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), LOWBIT_COMPILATION_CACHE=cache)
    begin = time.perf_counter()
    subprocess.run(
        [*CLI, "generate", path, "--prompt", "The capital of France is", "--max-new-tokens", "8"],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - begin


def _llama_server_start(path: str, logs: Path) -> float | None:
    try:
        import llama_cpp.server.app  # noqa: F401
    except ImportError:
        return None
    port = _free_port()
    begin = time.perf_counter()
    proc = _start(
        [sys.executable, "-m", "llama_cpp.server", "--model", path, "--port", str(port)],
        f"http://127.0.0.1:{port}/v1/models",
        logs / "llama.log",
    )
    seconds = time.perf_counter() - begin
    _stop(proc)
    return seconds


def run() -> str:
    from benchmarks._big_gguf import write_gguf
    from lowbit import kernels
    from lowbit.models import smollm2_gguf_path

    lines = ["## Start time: `lowbit serve` and `lowbit generate`, first and second start", ""]
    rows = []
    begin = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        files = [("SmolLM2-135M Q4_1 (bundled)", str(smollm2_gguf_path()))]
        big = os.environ.get("LOWBIT_BENCH_BIG_GGUF") or write_gguf(
            os.path.join(tmp, "qwen2-1.5b-Q4_K_M.gguf"), "qwen2-1.5b"
        )
        files.append(("Qwen2-1.5B-shaped Q4_K_M (random)", big))
        for name, path in files:
            cache = os.path.join(tmp, f"cache-{len(rows)}")
            serve = [_serve_start(path, cache, logs) for _ in range(2)]
            generate = [_generate(path, cache) for _ in range(2)]
            peer = _llama_server_start(path, logs)
            rows.append((name, serve, generate, peer))
            print(f"[start] {name}: {serve} {generate} {peer}", file=sys.stderr, flush=True)
    load = os.getloadavg()[0]
    lines += [
        f"- Date: {time.strftime('%Y-%m-%d')}; CPU: {cpu_model()}, {os.cpu_count()} cores "
        f"(load average {load:.1f} at the end); {kernels.status()}.",
        "- serve: from launch to the first `/health` 200 (8 slots, 2048-token cache, prefill "
        "widths up to 256: 12 model programs, the prefix cache on; the decode step and the "
        "row copy compiled before it, the others in the background after, each start stopped "
        "once they are); generate: launch to exit, "
        "8 new tokens. First: empty cache directory; second: the same directory again. "
        "`python -m benchmarks start`.",
        "",
        "| file | serve first s | serve second s | generate first s | generate second s "
        "| llama.cpp server s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, serve, generate, peer in rows:
        lines.append(
            f"| {name} | {serve[0]:.1f} | {serve[1]:.1f} | {generate[0]:.1f} | "
            f"{generate[1]:.1f} | {'-' if peer is None else f'{peer:.1f}'} |"
        )
    lines += ["", f"Section time: {time.perf_counter() - begin:.0f} s.", ""]
    return "\n".join(lines)
