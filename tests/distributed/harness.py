"""Runs one scenario in N local JAX processes (a coordinator on a free localhost port, CPU
devices, gloo collectives) and collects what each wrote; a worker that fails or hangs fails
the test with its log."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

WORKER = Path(__file__).with_name("worker.py")
# The checkout the tests run from: workers import lowbit from it, not from an installed copy.
ROOT = Path(__file__).resolve().parents[2]
LOCAL_DEVICES = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(
    scenario: str,
    processes: int,
    out: Path,
    *,
    timeout: float = 240.0,
    args: tuple = (),
    exits: dict[int, int] | None = None,
) -> list[dict[str, np.ndarray] | None]:
    """Runs `worker.py scenario` in `processes` processes; returns each one's saved arrays.

    Args:
      exits: exit codes expected of some workers (default: 0 for all); a worker that exits
        as expected with a code other than 0 has None as its result.
    Raises:
      AssertionError: a worker exited with another code or ran past `timeout` seconds (every
        worker is killed), with the tail of each worker's log.
    """
    exits = exits or {}
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = dict(os.environ)
    # The suite's other XLA flags (tests/conftest.py), with this harness's device count.
    flags = env.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([f"--xla_force_host_platform_device_count={LOCAL_DEVICES}", *flags])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    logs = [out / f"worker{i}.log" for i in range(processes)]
    procs = []
    for i in range(processes):
        cmd = [sys.executable, str(WORKER), scenario, str(i), str(processes), str(port), str(out)]
        with open(logs[i], "w") as log:
            procs.append(
                subprocess.Popen(
                    [*cmd, *map(str, args)], stdout=log, stderr=subprocess.STDOUT, env=env
                )
            )
    deadline = time.monotonic() + timeout
    failed = []
    for i, proc in enumerate(procs):
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = "timeout"
        if code != exits.get(i, 0):
            failed.append((i, code))
    if failed:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGUSR1)  # worker.py logs every thread's stack
        time.sleep(2.0)
        for proc in procs:
            proc.kill()
            proc.wait()
        tails = "\n".join(
            f"--- worker {i} ({code}) ---\n" + "\n".join(logs[i].read_text().splitlines()[-60:])
            for i, code in failed
        )
        raise AssertionError(f"scenario {scenario!r} on {processes} processes failed:\n{tails}")
    return [
        dict(np.load(out / f"result{i}.npz")) if exits.get(i, 0) == 0 else None
        for i in range(processes)
    ]
