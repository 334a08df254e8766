"""``python -m fuzz [--seconds 120] [harness ...]``: runs each harness for a set time, one after
another, and prints executions, coverage and findings.

Seeds come from `fuzz._seeds` (built from the real SmolLM2 / MiniLM files and files lowbit
writes): small ones are kept in ``fuzz/corpus/<harness>/`` (committed), larger ones and the
corpus libFuzzer grows go to the work directory (``--work``, default ``fuzz/.work``). Inputs that
break a harness's contract (exceptions, hangs past ``--timeout``, memory past ``--rss-mb``) are
saved under ``fuzz/findings/`` and listed; the run's totals are appended to
``<work>/runs.jsonl`` so that several runs add up.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time

HARNESSES = (
    "gguf_reader",
    "gguf_import",
    "gguf_model",
    "safetensors_reader",
    "checkpoint_manifest",
    "recipe_json",
    "gguf_tokenizer",
    "serve_request",
)
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# A seed this small is committed under fuzz/corpus/; larger ones are rebuilt at run time.
_SMALL_SEED = 8 * 1024


def _seed(name: str, work: str) -> list[str]:
    """The harness's seed directories, generated on first use."""
    committed = os.path.join(HERE, "corpus", name)
    generated = os.path.join(work, name, "seeds")
    if not os.path.isdir(generated):
        module = __import__(f"fuzz.{name}", fromlist=["seeds"])
        os.makedirs(generated + ".tmp", exist_ok=True)
        for file, data in module.seeds():
            small = len(data) <= _SMALL_SEED
            directory = committed if small else generated + ".tmp"
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, file), "wb") as f:
                f.write(data)
        os.replace(generated + ".tmp", generated)
    return [d for d in (committed, generated) if os.path.isdir(d)]


def _dictionary(name: str) -> list[str]:
    """libFuzzer's ``-dict`` for the harness: the format's keywords, which random byte edits
    would rarely spell (fuzz/dicts/<harness>.dict, else <its first word>.dict, if any)."""
    for file in (f"{name}.dict", f"{name.split('_')[0]}.dict"):
        path = os.path.join(HERE, "dicts", file)
        if os.path.exists(path):
            return [f"-dict={path}"]
    return []


def _run(name: str, args: argparse.Namespace) -> dict:
    corpus = os.path.join(args.work, name, "corpus")
    findings = os.path.join(HERE, "findings", name)
    os.makedirs(corpus, exist_ok=True)
    os.makedirs(findings, exist_ok=True)
    before = set(os.listdir(findings))
    command = [
        sys.executable,
        "-m",
        f"fuzz.{name}",
        f"-max_total_time={args.seconds}",
        f"-timeout={args.timeout}",
        f"-rss_limit_mb={args.rss_mb}",
        f"-malloc_limit_mb={args.rss_mb}",
        f"-max_len={args.max_len}",
        f"-artifact_prefix={findings}{os.sep}",
        "-print_final_stats=1",
        *_dictionary(name),
        corpus,
        *_seed(name, args.work),
    ]
    start = time.monotonic()
    log_path = os.path.join(args.work, name, "last.log")
    # The data-segment cap each harness sets on itself (see `fuzz._contract`): twice the RSS
    # bound, since thread stacks and allocator arenas count there but are mostly untouched.
    env = {**os.environ, "LOWBIT_FUZZ_DATA_MB": str(2 * args.rss_mb)}
    with open(log_path, "w") as log:
        done = subprocess.run(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=False
        )
    with open(log_path, errors="replace") as log:
        text = log.read()
    stats = {k: int(v) for k, v in re.findall(r"stat::(\w+):\s+(\d+)", text)}
    coverage = re.findall(r"cov: (\d+) ft: (\d+) corp: (\d+)", text)
    new = sorted(set(os.listdir(findings)) - before)
    result = {
        "harness": name,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - start, 1),
        "executions": stats.get("number_of_executed_units", 0),
        "exec_per_s": stats.get("average_exec_per_sec", 0),
        "peak_rss_mb": stats.get("peak_rss_mb", 0),
        "coverage": int(coverage[-1][0]) if coverage else 0,
        "features": int(coverage[-1][1]) if coverage else 0,
        "corpus": int(coverage[-1][2]) if coverage else 0,
        "findings": [os.path.join(findings, f) for f in new],
        "returncode": done.returncode,
    }
    if done.returncode and not new:
        result["findings"].append(f"exit {done.returncode} without an artifact: see {log_path}")
    with open(os.path.join(args.work, "runs.jsonl"), "a") as runs:
        runs.write(json.dumps(result) + "\n")
    return result


def _totals(work: str) -> dict[str, int]:
    totals: dict[str, int] = {}
    path = os.path.join(work, "runs.jsonl")
    if os.path.exists(path):
        with open(path) as runs:
            for line in runs:
                run = json.loads(line)
                totals[run["harness"]] = totals.get(run["harness"], 0) + run["executions"]
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("harness", nargs="*", choices=[[], *HARNESSES], default=[])
    parser.add_argument("--seconds", type=int, default=120, help="per harness (default 120)")
    parser.add_argument("--timeout", type=int, default=10, help="per input, seconds")
    parser.add_argument("--rss-mb", type=int, default=1024, help="memory bound per process")
    parser.add_argument("--max-len", type=int, default=1 << 16, help="largest input, bytes")
    parser.add_argument("--work", default=os.path.join(HERE, ".work"))
    args = parser.parse_args(argv)
    args.work = os.path.abspath(args.work)
    names = args.harness or list(HARNESSES)
    results = []
    for name in names:
        print(f"fuzzing {name} for {args.seconds} s ...", flush=True)
        result = _run(name, args)
        results.append(result)
        print(
            f"  {result['executions']} executions ({result['exec_per_s']}/s), coverage "
            f"{result['coverage']} edges / {result['features']} features, corpus "
            f"{result['corpus']}, peak RSS {result['peak_rss_mb']} MB, "
            f"{len(result['findings'])} findings",
            flush=True,
        )
        for finding in result["findings"]:
            print(f"    finding: {finding}")
    totals = _totals(args.work)
    print("\nharness                executions  exec/s  coverage  peak RSS MB  findings  total")
    for r in results:
        print(
            f"{r['harness']:<22} {r['executions']:>10}  {r['exec_per_s']:>6}  {r['coverage']:>8}"
            f"  {r['peak_rss_mb']:>11}  {len(r['findings']):>8}  {totals.get(r['harness'], 0)}"
        )
    return 1 if any(r["findings"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
