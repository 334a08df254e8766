"""The program registry: programs compiled at start, the others in the background; a program
asked for before the background thread reached it is compiled at once, one being compiled is
waited for, none is compiled twice; closing never waits on a stuck compile for long."""

import threading
import time

import numpy as np
import pytest

from lowbit.models._generate import generate_tokens
from lowbit.server import Job, Scheduler, SchedulerConfig
from lowbit.server._registry import ProgramRegistry


class _Fake:
    """A compile function that records its calls; `block` names programs it holds until
    `release` is set."""

    def __init__(self, block=(), fail=()):
        self.calls = []
        self.block, self.fail = set(block), set(fail)
        self.release = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, name, width, args):
        with self.lock:
            self.calls.append((name, width, threading.current_thread().name))
        if (name, width) in self.block:
            self.release.wait()
        if (name, width) in self.fail:
            raise RuntimeError(f"{name} does not compile")
        return (name, width, args)


def _registry(fake):
    registry = ProgramRegistry(fake, workers=2)
    registry.register("decode", 4, (np.zeros(3),), at_start=True)
    registry.register("prefill", 16, (np.zeros(16),), at_start=False)
    registry.register("prefill", 32, (np.zeros(32),), at_start=False)
    return registry


def test_start_compiles_only_the_start_programs_and_the_background_the_rest():
    fake = _Fake()
    registry = _registry(fake)
    registry.compile_at_start()
    assert registry.ready("decode", 4) and not registry.ready("prefill", 16)
    assert registry.pending == 2 and not registry.done.is_set()
    registry.start_background(on_error=pytest.fail)
    assert registry.done.wait(10)
    assert sorted(registry.compiled()) == [("decode", 4), ("prefill", 16), ("prefill", 32)]
    assert len(fake.calls) == 3  # each once
    # Example arrays are kept as shapes only (their buffers may be donated later).
    name, width, (example,) = registry.get("prefill", 32)
    assert example.shape == (32,) and not isinstance(example, np.ndarray)


def test_compile_soon_compiles_once_in_the_background_and_a_failure_is_never_ready():
    fake = _Fake(block={("rows", 1)}, fail={("rows", 2)})
    registry = _registry(fake)
    for _ in range(5):  # asked every step until ready: one compile
        registry.compile_soon("rows", 1, (np.zeros(1),))
    assert not registry.ready("rows", 1) and registry.pending == 4
    fake.release.set()
    deadline = time.monotonic() + 10
    while not registry.ready("rows", 1):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert [c for c in fake.calls if c[0] == "rows"] == [("rows", 1, "lowbit-compile-soon")]
    registry.compile_soon("rows", 2, (np.zeros(2),))
    while registry.pending > 3:  # decode and the two prefills are not compiled
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not registry.ready("rows", 2)


def test_a_program_not_reached_is_compiled_by_the_asker_and_one_in_flight_waited_for():
    fake = _Fake(block={("prefill", 16)})
    registry = _registry(fake)
    registry.compile_at_start()
    registry.start_background(on_error=pytest.fail)
    while not any(call[:2] == ("prefill", 16) for call in fake.calls):
        time.sleep(0.01)
    # The background thread is stuck on prefill-16: prefill-32 is compiled here, at once.
    assert registry.get("prefill", 32)[:2] == ("prefill", 32)
    assert ("prefill", 32, threading.current_thread().name) in fake.calls
    got = []
    waiter = threading.Thread(target=lambda: got.append(registry.get("prefill", 16)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not registry.ready("prefill", 16)  # waits, does not compile
    fake.release.set()
    waiter.join(10)
    assert got and got[0][:2] == ("prefill", 16)
    assert [c[:2] for c in fake.calls].count(("prefill", 16)) == 1
    assert registry.done.wait(10)


def test_close_gives_up_on_a_stuck_compile_after_its_timeout():
    fake = _Fake(block={("prefill", 16)})
    registry = _registry(fake)
    registry.compile_at_start()
    registry.start_background(on_error=pytest.fail)
    begin = time.monotonic()
    registry.close(timeout=0.2)
    assert time.monotonic() - begin < 5
    fake.release.set()  # the thread then stops before prefill-32
    registry.close(timeout=10)
    assert not registry.ready("prefill", 32)


def test_a_failed_background_compile_is_reported_and_raised_to_its_asker():
    fake = _Fake(fail={("prefill", 16)})
    registry = _registry(fake)
    registry.compile_at_start()
    errors = []
    registry.start_background(on_error=errors.append)
    registry.close(timeout=10)
    assert [str(e) for e in errors] == ["prefill does not compile"]
    with pytest.raises(RuntimeError, match="prefill does not compile"):
        registry.get("prefill", 16)
    with pytest.raises(KeyError, match="embed-8 is not registered"):
        registry.get("embed", 8)


def _job(prompt, logprobs=None):
    done = threading.Event()
    tokens = []

    def emit(new, finish):
        tokens.extend(new)
        if finish is not None:
            done.set()

    job = Job(prompt, 6, 0.0, 0, 1.0, 0, frozenset(), time.monotonic() + 300, emit, logprobs)
    return job, tokens, done


def test_requests_needing_programs_the_background_has_not_compiled_are_answered(loaded):
    """The background thread is held on its first program (the narrowest prefill): a request
    of another width with log-probabilities compiles its programs at once; one of the held
    width waits for it, and both get what `generate_tokens` gives."""
    config = SchedulerConfig(slots=2, max_len=64, single_pass=32, chunk=16, kv_memory=0)
    scheduler = Scheduler(loaded.model, None, None, config)
    release = threading.Event()
    compile = scheduler.programs._compile

    def held(name, width, args):
        if threading.current_thread().name == "lowbit-compile":
            release.wait()
        return compile(name, width, args)

    scheduler.programs._compile = held
    scheduler.start()
    rng = np.random.default_rng(3)
    wide, narrow = ([int(t) for t in rng.integers(3, 250, n)] for n in (20, 5))
    try:
        deadline = time.monotonic() + 300
        while not scheduler.ready:
            assert time.monotonic() < deadline and scheduler.error is None
            time.sleep(0.05)
        assert not scheduler.programs.ready("prefill", 24)
        job, tokens, done = _job(wide, logprobs=2)
        scheduler.submit(job)
        assert done.wait(300) and job.finished == "length"
        expected = generate_tokens(loaded.model, [wide], max_new_tokens=6)
        assert tokens == expected.tokens[0]
        assert len(job.token_logprobs) == len(tokens)
        assert not scheduler.programs.ready("prefill", 16)  # still held

        job, tokens, done = _job(narrow)
        scheduler.submit(job)
        assert not done.wait(0.5)  # waits for the held program, does not fail
        release.set()
        assert done.wait(300) and job.finished == "length"
        assert tokens == generate_tokens(loaded.model, [narrow], max_new_tokens=6).tokens[0]
    finally:
        release.set()
        scheduler.close()
    assert scheduler.error is None
