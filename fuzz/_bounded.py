"""Runs a harness's `test_one` on given inputs under a memory and a time bound that follow the
input's size: the resource half of the fuzz contract.

libFuzzer's ``-rss_limit_mb`` and ``-timeout`` are fixed per run, so a 5 MB file that declares
10**9 layers and takes 2 GiB is a finding only if the run's limit is set below that. Here each
input gets ``base + per_byte * len(input)`` of address space above what the process already
maps (after imports and a call on an empty input, so that JAX's and NumPy's start-up is not
charged to it), and ``seconds + len(input) / bytes_per_second`` of time. Exceeding either is a
finding.

``python -m fuzz._bounded HARNESS FILE...`` runs them in this process and prints one JSON line
per input; `run_bounded` starts that in a subprocess and returns the lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import resource
import signal
import subprocess
import sys
import time
import traceback

# The target: peak memory at most 4x the input plus 256 MiB.
PER_BYTE = 4
BASE_BYTES = 256 * 2**20
# A parser reads tens of MB a second; a second of start-up for small inputs.
BASE_SECONDS = 5.0
BYTES_PER_SECOND = 10 * 2**20
# Address space kept aside while an input runs, for lifting the bounds after it.
RESERVE_BYTES = 8 * 2**20


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One input's result: ``ok`` (returned or raised its documented error), ``memory``,
    ``time`` or ``contract`` (another exception), with the seconds it took."""

    file: str
    verdict: str
    seconds: float
    detail: str = ""


def _mapped_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmSize in /proc/self/status")


class _TimeUp(BaseException):
    """Raised by the alarm; a BaseException so that no `except Exception` swallows it."""


def _alarm(_signum, _frame):
    raise _TimeUp


def _one(test_one, file: str) -> Outcome:
    with open(file, "rb") as f:
        data = f.read()
    limit = BASE_BYTES + PER_BYTE * len(data)
    seconds = BASE_SECONDS + len(data) / BYTES_PER_SECOND
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    # Freed before the bounds are lifted: lifting them allocates (each call's result), and an
    # input that ran into the address-space limit left none (a MemoryError from `setrlimit`
    # itself ended a run under xdist with no verdict).
    reserve = bytearray(RESERVE_BYTES)
    soft = _mapped_bytes() + limit
    resource.setrlimit(resource.RLIMIT_AS, (soft if hard < 0 else min(soft, hard), hard))
    signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    error = None
    try:
        try:
            test_one(data)
        finally:
            del reserve[:]
            signal.setitimer(signal.ITIMER_REAL, 0)  # no alarm from here on
    except BaseException as err:  # classified below, once the bounds are lifted
        error = err
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    # Classified once the bounds are lifted: a traceback formatted under the address-space
    # limit, or an alarm inside an except clause, could end the process with no verdict.
    if error is None:
        verdict, detail = "ok", ""
    elif isinstance(error, MemoryError):
        verdict, detail = "memory", f"needed more than {limit >> 20} MiB above start-up"
    elif isinstance(error, _TimeUp):
        verdict, detail = "time", f"ran past {seconds:.1f} s"
    else:  # any other escape breaks the harness's contract
        verdict = "contract"
        detail = "".join(traceback.format_exception_only(error)).strip()[-500:]
    return Outcome(file, verdict, round(time.monotonic() - start, 3), detail)


def main(argv: list[str]) -> int:
    harness, files = argv[0], argv[1:]
    module = importlib.import_module(f"fuzz.{harness}")
    module._load()
    signal.signal(signal.SIGALRM, _alarm)
    # Warm up on an empty input, unbounded: lazy imports run now, not under the first bound.
    with contextlib.suppress(Exception):
        module.test_one(b"")
    # And JAX's CPU client, whose thread pools start with the first program: importing lowbit
    # runs none, and an address-space bound then fails their creation (a process abort).
    import jax

    jax.block_until_ready(jax.jit(lambda x: x + 1)(jax.numpy.zeros(8)))
    for file in files:
        print(json.dumps(dataclasses.asdict(_one(module.test_one, file))), flush=True)
    return 0


def run_bounded(harness: str, files: list[str], *, timeout: float = 300) -> list[Outcome]:
    """Runs `harness` on `files` in a subprocess under the bounds; one `Outcome` per file
    (a crash of the whole process, e.g. a killed allocation, is a ``crash`` outcome)."""
    done = subprocess.run(
        [sys.executable, "-m", "fuzz._bounded", harness, *files],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    outcomes = [Outcome(**json.loads(line)) for line in done.stdout.splitlines() if line]
    if done.returncode or len(outcomes) != len(files):
        seen = {o.file for o in outcomes}
        tail = done.stderr[-500:]
        outcomes += [
            Outcome(f, "crash", 0.0, f"exit {done.returncode}: {tail}")
            for f in files
            if f not in seen
        ]
    return outcomes


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
