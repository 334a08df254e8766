"""What every harness asserts, and the plumbing each one shares."""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
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


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def _bound_memory(test_one: Callable[[bytes], Any]) -> None:
    """Caps the process's data segment (heap and private writable mappings) at what it holds
    after start-up plus ``LOWBIT_FUZZ_ABOVE_MB``, the contract's bound for the largest input
    (`fuzz._bounded`): any execution that allocates past it gets `MemoryError`, which the harness
    reports as a finding. libFuzzer's ``-rss_limit_mb`` only samples RSS and is absolute, so it
    would charge JAX's start-up to the input and miss a large short-lived buffer.

    Start-up is measured after one call on an empty input, so lazy imports and the first
    compiles are not charged to the first input.
    """
    megabytes = os.environ.get("LOWBIT_FUZZ_ABOVE_MB")
    if not megabytes:
        return
    with contextlib.suppress(Exception):
        test_one(b"")
    data = _status_kib("VmData") * 1024
    limit = data + int(megabytes) * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    # The runner reads this line from the log: peak RSS is reported above it.
    print(
        f"lowbit-fuzz start-up: rss_mb={_status_kib('VmRSS') >> 10} "
        f"data_mb={data >> 20} cap_above_mb={megabytes}",
        file=sys.stderr,
        flush=True,
    )


def main(test_one: Callable[[bytes], Any], instrumented: Callable[[], Any]) -> None:
    """Runs libFuzzer (through atheris) on `test_one`, with lowbit's modules instrumented.

    `instrumented` imports what the harness needs; it runs under `atheris.instrument_imports`,
    so coverage is measured on lowbit's own code (not JAX's or NumPy's).
    """
    import atheris

    with atheris.instrument_imports(include=["lowbit"]):
        instrumented()
    _bound_memory(test_one)
    atheris.Setup(sys.argv, _keeping_findings(test_one))
    atheris.Fuzz()


def _keeping_findings(test_one: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """`test_one` that first saves an input breaking the contract to ``LOWBIT_FUZZ_FINDINGS``,
    named as libFuzzer names its artifacts (``crash-<sha1>``). libFuzzer writes one too, but
    only if its crash handler gets to run: a timer signal arriving while the process unwinds
    has ended runs before it did."""
    directory = os.environ.get("LOWBIT_FUZZ_FINDINGS")
    if not directory:
        return test_one

    def guarded(data: bytes) -> Any:
        try:
            return test_one(data)
        except BaseException:
            path = os.path.join(directory, "crash-" + hashlib.sha1(data).hexdigest())
            with open(path + ".tmp", "wb") as f:
                f.write(data)
            os.replace(path + ".tmp", path)
            raise

    return guarded
