"""Suite-wide settings: eight simulated CPU devices for sharding tests, XLA flags that compile
faster, a compilation cache for the run, and hypothesis profiles."""

import os
import shutil
import tempfile

# Must be set before JAX initialises its backends. The suite's programs are tiny and each runs
# a few times, so the time goes to compiling them: LLVM's cheap pipeline for the machine code
# instead of its full one cut tests/models/test_decoder.py and tests/server/test_scheduler.py
# from 183-214 s to 134 s (one process, on a 2-core machine). Subprocesses that tests start
# inherit these flags (tests/distributed/harness.py keeps them beside its own device count).
COMPILE_FAST = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {COMPILE_FAST}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The CLI turns on JAX's persistent compilation cache in the user's cache directory; tests
# never touch it.
os.environ.setdefault("LOWBIT_COMPILATION_CACHE", "0")
# Instead the run has a persistent cache of its own, fresh each run, which the xdist workers and
# the processes tests start (tests/distributed) share: a program another worker or process
# compiled, or one dropped by `_release_compiled_programs`, is loaded instead of compiled again
# (tests/models + tests/distributed on 2 workers: 396 s without it, 345 s with it; the suite is
# XLA-compile-bound). The process that starts the run (the xdist controller, or pytest alone)
# makes it; workers and subprocesses inherit the variables.
_RUN_CACHE = None
if "PYTEST_XDIST_WORKER" not in os.environ:
    _RUN_CACHE = tempfile.mkdtemp(prefix="lowbit-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _RUN_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def gpu_kernel_on_small_weights(monkeypatch):
    """CUDA lowerings run the Pallas weight-only kernel on every weight, not only on those of
    `GPU_MIN_WEIGHT_ELEMENTS` or more (a speed choice for real layer sizes, below which XLA's
    own product is kept): for tests that check the kernel's branch on small weights."""
    from lowbit.ops import _accelerated

    monkeypatch.setattr(_accelerated, "GPU_MIN_WEIGHT_ELEMENTS", 0)


# Compiled programs are dropped past this many memory mappings (Linux's default limit is 65,530).
MAX_MAPPINGS = 20_000


def _mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's compiled programs after a test file once the process holds `MAX_MAPPINGS`
    memory mappings. XLA:CPU executables keep mappings of their own (tests/models and
    tests/ops alone left 47,000 in one process), and a worker compiling for the whole suite
    passed the limit: XLA's next compile failed, and the C++ exception it raised crashed the
    worker while unwinding (a segfault in _Unwind_Find_FDE). Dropping them after every file
    instead made the suite 60% slower (programs shared between files compiled again)."""
    yield
    if _mappings() > MAX_MAPPINGS:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


def pytest_unconfigure(config):
    if _RUN_CACHE is not None:
        shutil.rmtree(_RUN_CACHE, ignore_errors=True)
