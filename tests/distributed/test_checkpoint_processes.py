"""lowbit's own checkpoints across processes: each process writes only the pieces it owns into
its own file, and reads back only the stored pieces its devices need, onto another process
count or mesh shape, with the values of a one-process save bit for bit."""

import ast
import json
import os

import jax
import numpy as np
import pytest
import scenarios
from harness import LOCAL_DEVICES, run_processes

import lowbit.io
from lowbit.io._shard_index import slices

pytestmark = pytest.mark.skipif(
    not hasattr(jax, "set_mesh"), reason="jax.set_mesh needs a newer JAX"
)
TIMEOUT = 400.0


def _reference_tree(devices: int):
    """`checkpoint_tree` built in this one process on `devices` devices."""
    mesh = jax.make_mesh((devices,), ("x",), devices=jax.devices()[:devices])
    with jax.set_mesh(mesh):
        return scenarios.checkpoint_tree(mesh)


def _values(tree) -> dict[str, np.ndarray]:
    return {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        if isinstance(leaf, jax.Array)
    }


@pytest.fixture(scope="module")
def reference():
    """Every array of the tree, whole, as one process with 4 devices quantizes it."""
    return _values(_reference_tree(2 * LOCAL_DEVICES))


def _same_bits(a: np.ndarray, b: np.ndarray, what: str) -> None:
    assert (a.dtype, a.shape) == (b.dtype, b.shape), what
    assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), what


def _check_pieces(results: list[dict], prefix: str, reference: dict) -> None:
    """Each piece a process holds equals the reference there, and the pieces of all the
    processes together cover every array."""
    covered = {name: np.zeros(value.shape, bool) for name, value in reference.items()}
    for result in results:
        pieces = {k: v for k, v in result.items() if k.startswith(prefix + "|[")}
        assert {k.split("|")[1] for k in pieces} == set(reference), prefix
        for key, data in pieces.items():
            _, name, box = key.split("|")
            where = slices(ast.literal_eval(box))
            _same_bits(data, reference[name][where], key)
            covered[name][where] = True
    for name, mask in covered.items():
        assert mask.all(), (prefix, name)


def _load_here(path, reference):
    loaded = lowbit.io.load_checkpoint(path)
    for name, value in _values(loaded).items():
        _same_bits(value, reference[name], name)
    assert loaded["step"] == 3


def test_reference_is_the_unsplit_quantization(reference):
    """The one-process tree the checks compare against is the plain quantization."""
    host = scenarios.weights()
    q = lowbit.quantize({"up": {"kernel": host["up"]}}, scenarios.RECIPE, kernel_layouts=False)
    _same_bits(reference["['up']['kernel'].codes"], np.asarray(q["up"]["kernel"].codes), "up")


def test_save_on_2_restore_on_2_other_mesh_and_on_1(tmp_path, reference):
    one = tmp_path / "one"
    lowbit.io.save_checkpoint(one, _reference_tree(2 * LOCAL_DEVICES), metadata={"step": 3})
    two = tmp_path / "two"
    results = run_processes(
        "checkpoint_round_trip", 2, tmp_path / "run", args=(two, one), timeout=TIMEOUT
    )
    # On disk: one file per process, a manifest listing them and every piece's place.
    assert sorted(os.listdir(two)) == [
        "manifest.json",
        "process-00000.safetensors",
        "process-00001.safetensors",
    ]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".two")]  # no temporaries
    manifest = json.loads((two / "manifest.json").read_text())
    assert manifest["format_version"] == 3 and manifest["metadata"] == {"step": 3}
    codes = manifest["tensors"]["up/kernel:codes"]["shards"]
    assert [s["box"] for s in codes] == [[[0, 256], [64 * i, 64 * (i + 1)]] for i in range(4)]
    assert [s["file"] for s in codes] == ["process-00000.safetensors"] * 2 + [
        "process-00001.safetensors"
    ] * 2
    for prefix in ("grid", "explicit", "same", "one"):
        _check_pieces(results, prefix, reference)
    for pid, result in enumerate(results):
        # Loaded onto the mesh it was saved from, a process reads only its own file (the
        # replicated `bias` is stored once, by process 0).
        own = f"process-{pid:05d}.safetensors"
        for read in result["same|reads"]:
            file, key = str(read).split("|")
            assert file == own or key.startswith("bias@"), (pid, read)
    _load_here(two, reference)


def test_save_on_1_restore_on_2(tmp_path, reference):
    """A one-file checkpoint loads onto a mesh over 2 processes (covered by the round trip
    above, "one" pieces); here onto a 1 x 4 grid, the other split."""
    one = tmp_path / "one"
    lowbit.io.save_checkpoint(one, _reference_tree(2 * LOCAL_DEVICES))
    results = run_processes("checkpoint_load", 2, tmp_path / "run", args=(one, 1), timeout=TIMEOUT)
    _check_pieces(results, "grid", reference)


def test_save_on_4_restore_on_2_and_on_1(tmp_path):
    reference = _values(_reference_tree(4 * LOCAL_DEVICES))
    four = tmp_path / "four"
    # Saved from a mesh with explicit axes, loaded onto one with automatic axes.
    run_processes("checkpoint_save", 4, tmp_path / "save", args=(four, "Explicit"), timeout=TIMEOUT)
    assert sorted(os.listdir(four)) == ["manifest.json"] + [
        f"process-{p:05d}.safetensors" for p in range(4)
    ]
    results = run_processes(
        "checkpoint_load", 2, tmp_path / "load", args=(four, 2), timeout=TIMEOUT
    )
    _check_pieces(results, "grid", reference)
    _load_here(four, reference)


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_a_process_failing_mid_save_leaves_the_old_checkpoint(tmp_path, how):
    """Process 1 dies (exits without a word) or raises in the middle of a save: process 0
    raises an error naming it (after the timeout, or at once), the old checkpoint stays."""
    path = tmp_path / "ck"
    lowbit.io.save_checkpoint(path, {"old": np.arange(4, dtype=np.float32)})
    exits = {1: 17} if how == "exit" else {}
    results = run_processes(
        "checkpoint_dies", 2, tmp_path / "run", args=(path, how), exits=exits, timeout=TIMEOUT
    )
    error = str(results[0]["error"])
    if how == "exit":
        assert "process 1 did not finish" in error and str(path) in error, error
    else:
        assert "process 1 failed while saving" in error and "OSError: disk full" in error, error
        assert "OSError: disk full" in str(results[1]["error"])
    # The old checkpoint is whole, and process 0 removed the temporary directory.
    np.testing.assert_array_equal(lowbit.io.load_checkpoint(path)["old"], np.arange(4))
    assert sorted(os.listdir(tmp_path)) == ["ck", "run"]
