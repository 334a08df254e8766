"""``python -m fuzz [--seconds 120] [harness ...]``: runs each harness for a set time, one after
another, and prints executions, coverage and findings.

Seeds come from `fuzz._seeds` (built from the real SmolLM2 / MiniLM files and files lowbit
writes): small ones are kept in ``fuzz/corpus/<harness>/`` (committed), larger ones and the
corpus libFuzzer grows go to the work directory (``--work``, default ``fuzz/.work``). Inputs that
break a harness's contract (exceptions, hangs past ``--timeout``, memory past the contract's bound,
`fuzz._bounded`: 4x the largest input plus 256 MiB above start-up, as a data-segment cap) are
saved under ``fuzz/findings/`` and listed. After each run, every input of the corpus and seeds
is replayed under the bound of its own size (`fuzz._bounded.run_bounded`). The run's totals are
appended to ``<work>/runs.jsonl`` so that several runs add up.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time

from fuzz._bounded import BASE_BYTES, BASE_SECONDS, BYTES_PER_SECOND, PER_BYTE, run_bounded

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
# Inputs replayed under their own bound by one process each (a crash loses only its chunk).
_REPLAY_CHUNK = 200
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
        *([f"-runs={args.runs}"] if args.runs else []),
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
    # The contract's memory bound for the largest input, which each harness sets on itself as
    # a data-segment cap above its start-up (`fuzz._contract`).
    env = {
        **os.environ,
        "LOWBIT_FUZZ_ABOVE_MB": str(_above_mb(args.max_len)),
        "LOWBIT_FUZZ_FINDINGS": findings,
    }
    with open(log_path, "w") as log:
        done = subprocess.run(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=False
        )
    with open(log_path, errors="replace") as log:
        text = log.read()
    stats = {k: int(v) for k, v in re.findall(r"stat::(\w+):\s+(\d+)", text)}
    startup = re.search(r"lowbit-fuzz start-up: rss_mb=(\d+)", text)
    startup_rss = int(startup.group(1)) if startup else 0
    coverage = re.findall(r"cov: (\d+) ft: (\d+) corp: (\d+)", text)
    new = sorted(set(os.listdir(findings)) - before)
    result = {
        "harness": name,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - start, 1),
        "executions": stats.get("number_of_executed_units", 0),
        "exec_per_s": stats.get("average_exec_per_sec", 0),
        "peak_rss_mb": stats.get("peak_rss_mb", 0),
        "startup_rss_mb": startup_rss,
        "cap_above_mb": _above_mb(args.max_len),
        "coverage": int(coverage[-1][0]) if coverage else 0,
        "features": int(coverage[-1][1]) if coverage else 0,
        "corpus": int(coverage[-1][2]) if coverage else 0,
        "findings": [os.path.join(findings, f) for f in new],
        "returncode": done.returncode,
    }
    if done.returncode and not new:
        result["findings"].append(f"exit {done.returncode} without an artifact: see {log_path}")
    if args.replay:
        result["bounded"], bounded_findings = _replay(name, [corpus, *_seed(name, args.work)])
        result["findings"] += bounded_findings
    with open(os.path.join(args.work, "runs.jsonl"), "a") as runs:
        runs.write(json.dumps(result) + "\n")
    return result


def _replay(name: str, directories: list[str]) -> tuple[dict[str, int], list[str]]:
    """Every input of the corpus and seeds run again under the bound of its own size
    (`fuzz._bounded`); an input that breaks it is copied to the findings.

    Returns:
      (verdict -> count, the findings' paths).
    """
    files = sorted(
        os.path.join(d, f) for d in directories for f in os.listdir(d) if not f.startswith(".")
    )
    counts: dict[str, int] = {}
    found = []
    for start in range(0, len(files), _REPLAY_CHUNK):
        chunk = files[start : start + _REPLAY_CHUNK]
        timeout = 120 + sum(_timeout(os.path.getsize(f)) for f in chunk)
        for outcome in run_bounded(name, chunk, timeout=timeout):
            counts[outcome.verdict] = counts.get(outcome.verdict, 0) + 1
            if outcome.verdict != "ok":
                target = os.path.join(
                    HERE,
                    "findings",
                    name,
                    f"bounded-{outcome.verdict}-" + os.path.basename(outcome.file),
                )
                shutil.copyfile(outcome.file, target)
                found.append(f"{target}: {outcome.detail}")
    return counts, found


def _above_mb(max_len: int) -> int:
    """The contract's memory bound above start-up for inputs of up to `max_len` bytes, MiB."""
    return -(-(BASE_BYTES + PER_BYTE * max_len) // 2**20)


def _timeout(max_len: int) -> int:
    """The contract's time bound for inputs of up to `max_len` bytes, whole seconds."""
    return math.ceil(BASE_SECONDS + max_len / BYTES_PER_SECOND)


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
    parser.add_argument("--runs", type=int, default=0, help="stop after N executions (0: none)")
    parser.add_argument(
        "--timeout", type=int, default=0, help="per input, seconds (default: the contract's)"
    )
    parser.add_argument(
        "--rss-mb", type=int, default=2048, help="libFuzzer's absolute RSS limit, a backstop"
    )
    parser.add_argument("--max-len", type=int, default=1 << 16, help="largest input, bytes")
    parser.add_argument("--work", default=os.path.join(HERE, ".work"))
    parser.add_argument(
        "--no-replay",
        dest="replay",
        action="store_false",
        help="skip replaying the corpus under each input's own memory and time bound",
    )
    args = parser.parse_args(argv)
    args.work = os.path.abspath(args.work)
    args.timeout = args.timeout or _timeout(args.max_len)
    names = args.harness or list(HARNESSES)
    results = []
    for name in names:
        runs = f" or {args.runs} executions" if args.runs else ""
        print(f"fuzzing {name} for {args.seconds} s{runs} ...", flush=True)
        result = _run(name, args)
        results.append(result)
        print(
            f"  {result['executions']} executions ({result['exec_per_s']}/s), coverage "
            f"{result['coverage']} edges / {result['features']} features, corpus "
            f"{result['corpus']}, peak RSS {result['peak_rss_mb']} MB (start-up "
            f"{result['startup_rss_mb']} MB, cap {result['cap_above_mb']} MiB above it), "
            f"{len(result['findings'])} findings",
            flush=True,
        )
        if "bounded" in result:
            print(f"  replayed under each input's own bound: {result['bounded']}", flush=True)
        for finding in result["findings"]:
            print(f"    finding: {finding}")
    totals = _totals(args.work)
    print(
        "\nharness                executions  exec/s  coverage  peak RSS MB  above start-up MB"
        "  findings  total"
    )
    for r in results:
        above = r["peak_rss_mb"] - r["startup_rss_mb"]
        print(
            f"{r['harness']:<22} {r['executions']:>10}  {r['exec_per_s']:>6}  {r['coverage']:>8}"
            f"  {r['peak_rss_mb']:>11}  {above:>17}  {len(r['findings']):>8}"
            f"  {totals.get(r['harness'], 0)}"
        )
    return 1 if any(r["findings"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
