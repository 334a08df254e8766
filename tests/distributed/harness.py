"""Runs one scenario in N local JAX processes (a coordinator on a free localhost port, CPU
devices, gloo collectives) and collects what each wrote; a worker that fails or hangs fails
the test with its log."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

WORKER = Path(__file__).with_name("worker.py")
LOCAL_DEVICES = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(
    scenario: str, processes: int, out: Path, *, timeout: float = 240.0, args: tuple = ()
) -> list[dict[str, np.ndarray]]:
    """Runs `worker.py scenario` in `processes` processes; returns each one's saved arrays.

    Raises:
      AssertionError: a worker exited non-zero or ran past `timeout` seconds (every worker is
        killed), with the tail of each worker's log.
    """
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"
    env["JAX_PLATFORMS"] = "cpu"
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
        if code != 0:
            failed.append((i, code))
    if failed:
        for proc in procs:
            proc.kill()
        tails = "\n".join(
            f"--- worker {i} ({code}) ---\n" + "\n".join(logs[i].read_text().splitlines()[-25:])
            for i, code in failed
        )
        raise AssertionError(f"scenario {scenario!r} on {processes} processes failed:\n{tails}")
    return [dict(np.load(out / f"result{i}.npz")) for i in range(processes)]
