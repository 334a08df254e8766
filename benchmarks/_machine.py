"""Machine description shared by the benchmark sections."""

from __future__ import annotations

import os
import platform
import subprocess


def cpu_model() -> str:
    """The CPU's model name from `lscpu` (else `platform.processor()`)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def xla_flags_note() -> str:
    """``"; XLA_FLAGS=..."`` when the run set XLA's flags (e.g. ``--xla_cpu_max_isa=AVX2`` for a
    run as on an AVX2-only CPU), else ``""``: for a section's machine line."""
    flags = os.environ.get("XLA_FLAGS")
    return f"; XLA_FLAGS={flags}" if flags else ""


def lowbit_kernels() -> str:
    """lowbit's CPU kernel path as this process runs it (`lowbit.kernels.status()`): a server
    the section starts as a process of the same environment runs the same path."""
    from lowbit import kernels

    return kernels.status()
