"""Machine description shared by the benchmark sections."""

from __future__ import annotations

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
