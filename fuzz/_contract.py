"""What every harness asserts, and the plumbing each one shares."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any


class ContractViolation(AssertionError):
    """An input broke a parser's contract: the error type or message is not the documented one."""


@contextlib.contextmanager
def documented(
    errors: tuple[type[BaseException], ...], names: str | tuple[str, ...]
) -> Iterator[None]:
    """Lets a documented error through if its message names `names` (the file or a field);
    any other exception propagates and is a finding.

    Raises:
      ContractViolation: for a documented type whose message names none of `names`.
    """
    wanted = (names,) if isinstance(names, str) else names
    try:
        yield
    except errors as err:
        message = str(err)
        if not any(name in message for name in wanted):
            raise ContractViolation(
                f"{type(err).__name__} names none of {wanted}: {message[:500]!r}"
            ) from err


def scratch_file(name: str) -> str:
    """A per-process path for the input under test, in memory where the system has a tmpfs."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    directory = os.path.join(root, f"lowbit-fuzz-{os.getpid()}")
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, name)


def write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


def _bound_memory() -> None:
    """Caps the process's data segment (heap and private mappings) at ``LOWBIT_FUZZ_DATA_MB``:
    a parser that allocates past it gets `MemoryError`, which the harness reports as a finding
    (libFuzzer's ``-rss_limit_mb`` only samples RSS, and misses a large short-lived buffer)."""
    megabytes = os.environ.get("LOWBIT_FUZZ_DATA_MB")
    if megabytes:
        import resource

        limit = int(megabytes) * 2**20
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def main(test_one: Callable[[bytes], Any], instrumented: Callable[[], Any]) -> None:
    """Runs libFuzzer (through atheris) on `test_one`, with lowbit's modules instrumented.

    `instrumented` imports what the harness needs; it runs under `atheris.instrument_imports`,
    so coverage is measured on lowbit's own code (not JAX's or NumPy's).
    """
    import atheris

    with atheris.instrument_imports(include=["lowbit"]):
        instrumented()
    _bound_memory()
    atheris.Setup(sys.argv, test_one)
    atheris.Fuzz()
