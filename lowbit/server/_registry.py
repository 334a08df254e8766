"""Which programs a scheduler runs, and which of them are compiled: one home for both.

A server is ready once the programs its first requests need are compiled (`at_start`); the
others (wider prefill passes, the log-probability variants, the prefix cache's copies, ...)
are compiled afterwards, one at a time, by a background thread. A program that is asked for
before the background thread reached it is compiled at once in the asking thread (or, when
the background thread is compiling it, waited for), so a request never fails for it: it only
waits. A caller that has something else to do meanwhile asks `ready` first (the prefix cache
skips its lookups and saves until its copies are compiled).

Each program is compiled once: `get` and the background thread share one future per program,
guarded by a lock, so the scheduler's thread and the background one never compile the same
program twice nor see a half-filled table.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

import jax

from lowbit.api import StoredProgram

_log = logging.getLogger("lowbit.server")

# (name, width): the width tells apart the shapes one name is compiled for (an int, or a
# tuple of them such as a batched prefill's width and rows).
Width = int | tuple[int, ...]
Key = tuple[str, Width]
# (name, width, example arguments) -> the compiled program; the arguments' arrays may be
# shape-and-dtype stand-ins (`jax.ShapeDtypeStruct`).
Compile = Callable[[str, Width, tuple], StoredProgram]


def _stand_in(leaf: Any) -> Any:
    """A leaf's shape, dtype and weak type, without its buffer (which may be donated later)."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        weak = getattr(leaf, "weak_type", False)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, weak_type=weak)
    return leaf


@dataclasses.dataclass(frozen=True)
class Programs:
    """How the scheduler's parts use its programs.

    Attributes:
      run: ``(name, width, args) -> outputs``: calls a program (compiled now if it is not yet).
      ready: ``(name, width) -> bool``: whether it is compiled (`ProgramRegistry.ready`).
      soon: ``(name, width, example args) -> None``: compiles it in the background
        (`ProgramRegistry.compile_soon`).
    """

    run: Callable[[str, Width, tuple], Any]
    ready: Callable[[str, Width], bool]
    soon: Callable[[str, Width, tuple], None]


class ProgramRegistry:
    """The programs of one scheduler, by ``(name, width)``; `width` tells apart the shapes one
    name is compiled for (a prefill width, the slots, ...).

    Args:
      compile: builds one program from its name, width and example arguments; called from the
        scheduler's thread, the start pool's threads or the background thread.
      workers: programs compiled at a time by `compile_at_start` (reading a kept program and
        XLA's compile release the GIL).
    """

    def __init__(self, compile: Compile, workers: int = 4):
        self._compile = compile
        self._workers = workers
        self._lock = threading.Lock()
        self._args: dict[Key, tuple | Callable[[], tuple]] = {}
        self._at_start: list[Key] = []
        self._later: list[Key] = []
        self._futures: dict[Key, concurrent.futures.Future[StoredProgram]] = {}
        self._closed = False
        self._thread: threading.Thread | None = None
        self.done = threading.Event()  # set once every registered program is compiled

    def register(
        self, name: str, width: Width, args: tuple | Callable[[], tuple], *, at_start: bool
    ) -> None:
        """Declares program ``(name, width)`` with example arguments `args` (only their
        structure, shapes and dtypes count), or a function returning them, called by the
        thread that compiles it (for arguments shaped like another program's output).
        `at_start`: compiled before the server says it is ready; else in the background."""
        key = (name, width)
        if not callable(args):
            args = jax.tree.map(_stand_in, args)
        with self._lock:
            if key in self._args:
                return
            self._args[key] = args
            (self._at_start if at_start else self._later).append(key)
            self.done.clear()

    def ready(self, name: str, width: Width) -> bool:
        """Whether program ``(name, width)`` is compiled (`get` would not wait)."""
        with self._lock:
            future = self._futures.get((name, width))
        return future is not None and future.done() and future.exception() is None

    def get(self, name: str, width: Width, args: tuple | None = None) -> StoredProgram:
        """Program ``(name, width)``, compiled now if it is not yet (in this thread, or
        waiting for the thread compiling it). `args`: example arguments, for a program not
        registered (it is registered then).

        Raises:
          KeyError: for a program neither registered nor given `args`.
          Exception: what compiling it raised.
        """
        future, example = self._claim(name, width, args)
        if example is not None:
            self._build(name, width, future, example)
        return future.result()

    def compile_soon(self, name: str, width: Width, args: tuple) -> None:
        """Compiles program ``(name, width)`` in a thread of its own, unless it is compiled or
        being compiled: for a program only some requests use (one they can do without until it
        is ready), whose memory a server then pays only once a request asks. A failure is
        logged, and `ready` stays False for it."""
        if self._closed:
            return
        future, example = self._claim(name, width, args)
        if example is None:
            return

        def run() -> None:
            self._build(name, width, future, example)
            if future.exception() is not None:
                _log.error("compiling program %s-%s failed: %s", name, width, future.exception())

        threading.Thread(target=run, name="lowbit-compile-soon", daemon=True).start()

    def _claim(
        self, name: str, width: Width, args: tuple | None
    ) -> tuple[concurrent.futures.Future[StoredProgram], tuple | Callable[[], tuple] | None]:
        """The future of program ``(name, width)``, and its example arguments when the caller
        is to compile it (None: compiled, or being compiled by another thread). A program not
        registered is registered with `args`."""
        key = (name, width)
        with self._lock:
            future = self._futures.get(key)
            if future is not None:
                return future, None
            if key not in self._args:
                if args is None:
                    raise KeyError(f"program {name}-{width} is not registered")
                self._args[key] = jax.tree.map(_stand_in, args)
                self._later.append(key)
                self.done.clear()
            future = self._futures[key] = concurrent.futures.Future()
            return future, self._args[key]

    def _build(
        self,
        name: str,
        width: Width,
        future: concurrent.futures.Future[StoredProgram],
        example: tuple | Callable[[], tuple],
    ) -> None:
        """Compiles the claimed program into `future`: its result, or what compiling raised."""
        try:
            args = example() if callable(example) else example
            future.set_result(self._compile(name, width, args))
        except BaseException as err:
            future.set_exception(err)
        self._check_done()

    def compile_at_start(self) -> None:
        """Compiles every `at_start` program, `workers` at a time; returns when all are."""
        with self._lock:
            keys = list(self._at_start)
        with concurrent.futures.ThreadPoolExecutor(max(1, self._workers)) as pool:
            list(pool.map(lambda key: self.get(*key), keys))

    def start_background(self, on_error: Callable[[BaseException], None]) -> None:
        """Compiles the other programs one at a time in a background thread, in the order
        they were registered; `on_error` gets what one raised (the thread then stops)."""

        def run() -> None:
            with self._lock:
                keys = list(self._at_start + self._later)
            for key in keys:
                if self._closed:
                    return
                try:
                    self.get(*key)
                except BaseException as err:  # surfaced by the scheduler's /health
                    _log.error("compiling program %s-%s failed: %s", *key, err)
                    on_error(err)
                    return

        self._thread = threading.Thread(target=run, name="lowbit-compile", daemon=True)
        self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        """Stops the background thread after the program it is compiling (a compile cannot be
        interrupted), waiting at most `timeout` seconds for it."""
        self._closed = True
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def pending(self) -> int:
        """Registered programs not compiled yet."""
        with self._lock:
            return sum(
                1 for key in self._args if key not in self._futures or not self._futures[key].done()
            )

    def compiled(self) -> dict[Key, StoredProgram]:
        """The programs compiled so far."""
        with self._lock:
            futures = dict(self._futures)
        return {key: f.result() for key, f in futures.items() if f.done() and f.exception() is None}

    def _check_done(self) -> None:
        if self.pending == 0:
            self.done.set()
