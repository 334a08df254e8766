"""Fault injection: saves killed by SIGKILL at chosen and random points while readers run.

Every reader must get the old checkpoint or the new one, whole (never a mix, never an error);
after every kill the checkpoint on disk is the last one saved or the one being saved; the
temporaries of killed saves are removed by the next save.

One helper process imports lowbit once and forks a saver per round (a fresh interpreter per
round would cost seconds of imports); the test kills the saver. The helper runs one thread (no
BLAS pool, no JAX backend) and checks so before every fork: a fork beside a running thread can
copy a lock that thread holds, and the saver then hangs on it.
"""

import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import lowbit
from lowbit.io import load_checkpoint, save_checkpoint
from lowbit.qarray import QArray

pytestmark = pytest.mark.skipif(
    not hasattr(os, "fork") or sys.platform != "linux", reason="needs fork, SIGKILL, Linux"
)

# Shared by the test and the saver: what save number `g` writes. Every stored value says which
# save wrote it, and odd and even saves differ in shapes and tensor names too, so any mix of two
# saves is visible.
_TREE = """
import numpy as np
from lowbit.qarray import QArray

def tree(g):
    rows = 64 + 16 * (g % 2)
    return {
        "gen": np.full((rows, 256), g, np.float32),
        "q": QArray(
            codes=np.full((rows, 128), g % 256, np.uint8),
            scale=np.full((rows, 8), g, np.float32),
            zero_point=None,
            tensor_scale=None,
            format="int4",
            shape=(rows, 256),
            dtype=np.float32,
            packed_axis=1,
        ),
        f"only_{g % 2}": np.arange(g % 5 + 1, dtype=np.int32) + g,
    }
"""

_SAVER = (
    _TREE
    + """
import os, signal, sys, warnings
from lowbit.io import _checkpoint_dir as _checkpoint, save_checkpoint  # the publish step swaps

# JAX warns about every fork because its runtime threads could hold locks; this process never
# starts JAX's runtime, and the forked saver runs only NumPy and file I/O.
warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)

def threads():
    return len(os.listdir("/proc/self/task"))

print("ready", threads(), flush=True)
for line in sys.stdin:
    mode, path, start = line.split()
    if threads() != 1:
        print("threads", threads(), flush=True)
        continue
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        try:
            swap = _checkpoint.replace_directory
            die = lambda: os.kill(os.getpid(), signal.SIGKILL)
            if mode == "before_swap":  # tensors and manifest written, not yet published
                _checkpoint.replace_directory = lambda new, target: die()
            elif mode == "after_swap":  # published, the previous checkpoint not yet removed
                _checkpoint.replace_directory = lambda new, target: (swap(new, target), die())
            g = int(start)
            while True:
                save_checkpoint(path, tree(g))
                print("saved", g, flush=True)
                g += 1
        finally:
            os._exit(1)
    print("pid", pid, flush=True)
    print("exit", os.waitpid(pid, 0)[1], flush=True)
"""
)

_ns: dict = {}
exec(_TREE, _ns)  # noqa: S102 - our own source, above
tree = _ns["tree"]


def _generation(loaded) -> int:
    """The save that wrote `loaded`, after checking every leaf came from that one save."""
    g = int(np.asarray(loaded["gen"]).flat[0])
    expected = tree(g)
    assert sorted(loaded) == sorted(expected), (g, sorted(loaded))
    for key, value in expected.items():
        got = loaded[key]
        if isinstance(value, QArray):
            assert isinstance(got, QArray) and got.shape == value.shape, g
            parts = [(got.codes, value.codes), (got.scale, value.scale)]
        else:
            parts = [(got, value)]
        for a, b in parts:
            a = np.asarray(a)
            assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), (g, key)
    return g


class _Readers:
    """Threads loading the checkpoint in a loop, recording generations seen and any error."""

    def __init__(self, path, count=2):
        self.path, self.seen, self.errors = path, [], []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(count)]

    def _run(self):
        while not self.stop.is_set():
            try:
                self.seen.append(_generation(load_checkpoint(self.path)))
            except BaseException as err:  # noqa: BLE001 - every failure is a finding
                self.errors.append(repr(err))

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for thread in self.threads:
            thread.join()


def _temporaries(parent):
    return sorted(name for name in os.listdir(parent) if name.startswith(".ck.tmp-"))


def test_killed_saves_leave_old_or_new_never_mixed(tmp_path):
    path = str(tmp_path / "ck")
    save_checkpoint(path, tree(0))
    root = os.path.dirname(os.path.dirname(os.path.abspath(lowbit.__file__)))
    # One thread in the helper: NumPy's BLAS would otherwise start a pool at import.
    one = {k: "1" for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env = {**os.environ, **one, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root}
    saver = subprocess.Popen(
        [sys.executable, "-c", _SAVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    watchdog = threading.Timer(120, saver.kill)
    watchdog.start()
    rng = random.Random(0)
    last, start = 0, 1
    try:
        assert saver.stdout.readline().split() == ["ready", "1"]  # see the module docstring
        with _Readers(path) as readers:
            for mode in ["before_swap", "after_swap"] + ["random"] * 5:
                saver.stdin.write(f"{mode} {path} {start}\n")
                saver.stdin.flush()
                saved, status = [], None
                while status is None:
                    line = saver.stdout.readline()
                    assert len(line.split()) == 2, repr(line)
                    word, number = line.split()
                    assert word != "threads", f"helper has {number} threads; it must fork alone"
                    if word == "pid" and mode == "random":
                        time.sleep(rng.uniform(0.0, 0.08))
                        os.kill(int(number), signal.SIGKILL)
                    elif word == "saved":
                        saved.append(int(number))
                    elif word == "exit":
                        status = int(number)
                assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
                done = max(saved, default=last)
                g = _generation(load_checkpoint(path))
                assert g in (done, done + 1), (mode, saved, g)
                if mode == "before_swap":
                    assert g == last
                    (stale,) = _temporaries(tmp_path)  # full-size, left by the killed save
                    assert os.path.getsize(tmp_path / stale / "model.safetensors") > 2**16
                elif mode == "after_swap":
                    assert g == start
                    assert stale not in _temporaries(tmp_path)  # removed by this round's save
                last, start = g, max(done, g) + 1
        assert readers.errors == []
        assert len(set(readers.seen)) >= 2  # the readers did overlap saves
    finally:
        watchdog.cancel()
        saver.stdin.close()
        saver.wait(timeout=60)
        saver.stdout.close()
    save_checkpoint(path, tree(start))
    left = {n: sorted(os.listdir(tmp_path / n)) for n in os.listdir(tmp_path) if n != "ck"}
    assert left == {}
    assert _generation(load_checkpoint(path)) == start
