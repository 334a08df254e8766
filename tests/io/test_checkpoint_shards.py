"""Checkpoints in the per-process layout (one shard file per process, every tensor a list of
boxes of its global index space), written here by one process, and loads onto shardings:
the shard index logic, the validation of the shard files, and the quantization groups."""

import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from lowbit.io import CheckpointError, check_save_path, load_checkpoint, save_checkpoint
from lowbit.io import _checkpoint_writer as writer_module
from lowbit.io._checkpoint_parts import WriterFiles
from lowbit.io._safetensors_file import read_file_header, read_tensor, write_safetensors
from lowbit.io._shard_index import (
    Shard,
    box_of,
    check_tiling,
    decode_shards,
    is_shard_file,
    key_of,
    overlaps,
)
from lowbit.qarray import PerGroup, QuantConfig, quantize

FILE = "process-00000.safetensors"


# --- the shard index ------------------------------------------------------------------------


def test_box_of_device_indices():
    assert box_of((slice(None), slice(4, 8)), (3, 16)) == ((0, 3), (4, 8))
    assert box_of((slice(2, 4),), (8, 5)) == ((2, 4), (0, 5))  # missing axes: whole
    assert box_of((), ()) == ()
    with pytest.raises(ValueError, match="step 2"):
        box_of((slice(0, 8, 2),), (8,))
    assert key_of("up/kernel:codes", ((0, 3), (4, 8))) == "up/kernel:codes@0:3,4:8"


def test_overlaps_say_what_each_stored_shard_gives_a_region():
    shards = [Shard(FILE, f"t@{i}", ((4 * i, 4 * i + 4), (0, 6)), "") for i in range(3)]
    found = overlaps(((2, 9), (1, 3)), shards)
    assert [(s.key, src, dst) for s, src, dst in found] == [
        ("t@0", (slice(2, 4), slice(1, 3)), (slice(0, 2), slice(0, 2))),
        ("t@1", (slice(0, 4), slice(1, 3)), (slice(2, 6), slice(0, 2))),
        ("t@2", (slice(0, 1), slice(1, 3)), (slice(6, 7), slice(0, 2))),
    ]
    assert overlaps(((12, 12), (0, 6)), shards) == []
    assert [s.key for s, _, _ in overlaps((), [Shard(FILE, "s", (), "")])] == ["s"]


def test_tiling_refuses_overlaps_and_holes():
    check_tiling([((0, 4), (0, 2)), ((4, 8), (0, 2))], (8, 2), "t")
    with pytest.raises(CheckpointError, match="t: shards .* overlap"):
        check_tiling([((0, 5), (0, 2)), ((4, 8), (0, 2))], (8, 2), "t")
    with pytest.raises(CheckpointError, match="hold 14 of the tensor's 16 elements"):
        check_tiling([((0, 4), (0, 2)), ((4, 7), (0, 2))], (8, 2), "t")
    with pytest.raises(CheckpointError, match="scalar stored as 2 shards"):
        check_tiling([(), ()], (), "t")


def _entry(box, file=FILE, key="k"):
    return {"file": file, "key": key, "box": box, "sha256": "0" * 64}


@pytest.mark.parametrize(
    ("shards", "match"),
    [
        ([], "not a non-empty list"),
        ([{"file": FILE, "box": [[0, 8]]}], "is not {file, key, box, sha256}"),
        ([_entry([[0, 9]])], r"box \[\[0, 9\]\] is not inside shape \[8\]"),
        ([_entry([[4, 2]])], "is not inside"),
        ([_entry([[0, 8], [0, 1]])], "is not inside"),
        ([_entry([[0, 8]], file="process-00001.safetensors")], "which the manifest lacks"),
        ([_entry([[0, 4]]), _entry([[4, 8]])], "two shards share one key"),
        ([_entry([[0, 4]], key="a"), _entry([[2, 8]], key="b")], "overlap"),
    ],
)
def test_malformed_shard_lists_are_refused(shards, match):
    with pytest.raises(CheckpointError, match=match):
        decode_shards(shards, (8,), {FILE}, "manifest.json: tensor 't'")


def test_shard_file_names():
    assert is_shard_file("process-00003.safetensors") and is_shard_file(
        "process-123456.safetensors"
    )
    for name in ("process-3.safetensors", "process-0000x.safetensors", "model.safetensors"):
        assert not is_shard_file(name)
    files = WriterFiles(frozenset({"manifest.json"}))
    assert "process-00001.safetensors.spool" in files and "manifest.json" in files
    assert "notes.txt" not in files


# --- the per-process layout written by one process --------------------------------------------


def _mesh(shape, names):
    return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


def _sharded_tree():
    mesh = _mesh((4,), ("x",))
    x = jax.random.normal(jax.random.key(0), (64, 128), jnp.float32)
    q = quantize(x, QuantConfig(format="int4", granularity=PerGroup(16, 0)))
    cols = NamedSharding(mesh, P(None, "x"))
    q = jax.tree.map(lambda a: jax.device_put(a, cols), q)
    norm = jax.device_put(jnp.arange(8, dtype=jnp.bfloat16), NamedSharding(mesh, P("x")))
    return {"w": q, "norm": norm, "bias": jnp.ones(3), "step": 2}


@pytest.fixture
def per_process(monkeypatch):
    monkeypatch.setattr(writer_module, "PER_PROCESS_FILES", True)


def _same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert (x.dtype, x.shape, x.tobytes()) == (y.dtype, y.shape, y.tobytes())


@pytest.fixture
def saved(tmp_path, per_process):
    tree = _sharded_tree()
    path = tmp_path / "ck"
    save_checkpoint(path, tree, metadata={"m": 1})
    return path, tree


def test_per_process_layout_on_disk(saved):
    path, _ = saved
    assert sorted(os.listdir(path)) == ["manifest.json", FILE]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format_version"] == 3 and manifest["files"] == [FILE]
    codes = manifest["tensors"]["w:codes"]
    assert (codes["shape"], codes["dtype"]) == ([64, 64], "uint8")
    # One shard per device piece (16 packed columns each), named by its box.
    assert [s["box"] for s in codes["shards"]] == [
        [[0, 64], [16 * i, 16 * i + 16]] for i in range(4)
    ]
    assert codes["shards"][1]["key"] == "w:codes@0:64,16:32"
    assert [s["box"] for s in manifest["tensors"]["bias"]["shards"]] == [[[0, 3]]]
    with open(path / FILE, "rb") as f:
        entries, meta = read_file_header(f)
    assert meta["lowbit.process"] == "0" and "w:codes@0:64,16:32" in entries


def test_per_process_layout_round_trips_onto_other_meshes(saved):
    path, tree = saved
    _same(load_checkpoint(path), tree)
    grid = _mesh((2, 4), ("a", "b"))

    def sharding(leaf, role, shape):
        if len(shape) == 2 and shape[0] % 2 == 0 and shape[1] % 4 == 0:
            return NamedSharding(grid, P("a", "b"))
        return NamedSharding(grid, P())

    loaded = load_checkpoint(path, sharding=sharding)
    _same(loaded, tree)
    assert loaded["w"].codes.sharding.spec == P("a", "b")
    assert loaded["step"] == 2


def test_a_one_process_save_replaces_a_per_process_checkpoint(saved, monkeypatch):
    path, tree = saved
    check_save_path(path)
    monkeypatch.setattr(writer_module, "PER_PROCESS_FILES", None)
    save_checkpoint(path, {"x": jnp.ones(2)})
    assert sorted(os.listdir(path)) == ["manifest.json", "model.safetensors"]
    (path / "process-00001.safetensors").write_bytes(b"")
    (path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="notes.txt"):
        check_save_path(path)


def test_missing_and_extra_shard_files_are_refused(saved):
    path, _ = saved
    (path / "process-00001.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="process-00001.safetensors: a shard file the"):
        load_checkpoint(path)
    os.unlink(path / "process-00001.safetensors")
    os.unlink(path / FILE)
    with pytest.raises(CheckpointError, match="process-00000.safetensors: missing"):
        load_checkpoint(path)


def test_edited_manifest_and_flipped_bytes_are_refused(saved):
    path, _ = saved
    file = path / "manifest.json"
    original = file.read_bytes()
    manifest = json.loads(original)
    manifest["tensors"]["w:codes"]["shards"][0]["box"] = [[0, 64], [0, 15]]
    file.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="not written with this manifest.json"):
        load_checkpoint(path)
    file.write_bytes(original)
    data = bytearray((path / FILE).read_bytes())
    data[-1] ^= 1
    (path / FILE).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="is corrupt"):
        load_checkpoint(path)


def test_shards_the_manifest_does_not_list_are_refused(saved):
    """A shard file resealed with the manifest but holding another tensor is caught."""
    path, _ = saved
    digest_key = "lowbit.manifest_sha256"
    with open(path / FILE, "rb") as f:
        entries, meta = read_file_header(f)
        tensors = {name: read_tensor(f, entry) for name, entry in entries.items()}
    tensors["stray"] = np.zeros(2, np.float32)
    os.unlink(path / FILE)
    write_safetensors(str(path / FILE), tensors, {k: v for k, v in meta.items() if k != "format"})
    assert digest_key in meta
    with pytest.raises(CheckpointError, match="extra tensor 'stray'"):
        load_checkpoint(path)


def test_a_target_that_splits_quantization_groups_is_refused(tmp_path):
    """Blocks of 128 rows cannot be split into pieces of 32: the error names the leaf, the
    sharding and the fix, before anything is read."""
    x = jax.random.normal(jax.random.key(1), (256, 64), jnp.float32)
    q = quantize(x, QuantConfig(format="int4", granularity=PerGroup(128, 0)))
    save_checkpoint(tmp_path / "ck", {"layer": {"kernel": q}})
    mesh = _mesh((8,), ("x",))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path / "ck", sharding=NamedSharding(mesh, P("x", None)))
    message = str(err.value)
    assert "process 0" in message and "qarray 'layer/kernel'" in message
    assert "blocks of (128, 1)" in message and "Choose a group size that divides 32" in message
    # Pieces of 128 rows hold whole groups.
    loaded = load_checkpoint(tmp_path / "ck", sharding=NamedSharding(_mesh((2,), ("x",)), P("x")))
    _same(loaded["layer"]["kernel"], q)


def test_checkpoint_leaves_reads_the_per_process_layout(saved):
    from lowbit.io import checkpoint_leaves

    path, tree = saved
    with checkpoint_leaves(path) as leaves:
        assert sorted(leaves) == [("bias",), ("norm",), ("step",), ("w",)]
        _same(leaves[("w",)], tree["w"])


# --- agreeing on the manifest ------------------------------------------------------------------


def test_processes_that_saved_different_trees_are_refused():
    """Process 0 merges the tables of pieces: a tensor whose pieces do not tile it, or one
    its own tree lacks, means the processes saved different things."""
    from lowbit.io._checkpoint_parts import _manifest

    tensors = {"w": {"path": ["w"], "role": "value", "dtype": "float32", "shape": [4, 2]}}

    def piece(process, rows):
        return {
            "file": f"process-{process:05d}.safetensors",
            "key": key_of("w", (rows, (0, 2))),
            "box": [list(rows), [0, 2]],
            "sha256": "0" * 64,
        }

    tables = [{"w": [piece(0, (0, 2))]}, {"w": [piece(1, (2, 4))]}]
    manifest = _manifest({"format_version": 3}, tensors, tables, 2)
    assert manifest["files"] == ["process-00000.safetensors", "process-00001.safetensors"]
    assert [s["box"] for s in manifest["tensors"]["w"]["shards"]] == [
        [[0, 2], [0, 2]],
        [[2, 4], [0, 2]],
    ]
    with pytest.raises(
        CheckpointError, match="tensor 'w' as saved by the processes: the shards hold 4"
    ):
        _manifest({}, tensors, [tables[0], {}], 2)
    with pytest.raises(CheckpointError, match="overlap"):
        _manifest({}, tensors, [tables[0], {"w": [piece(1, (1, 4))]}], 2)
    with pytest.raises(CheckpointError, match="process 1 saved tensor 'v', which process 0's"):
        _manifest({}, tensors, [tables[0], {**tables[1], "v": []}], 2)


def test_a_failed_process_is_named_to_the_others():
    from lowbit.io._processes import Exchange, ProcessError

    exchange = Exchange("'ck'", timeout=1)
    exchange.send("pieces", {"w": []})
    assert exchange.receive_all("pieces") == [{"w": []}]
    exchange.fail(("pieces", "sealed"), "process 0: OSError: disk full")
    with pytest.raises(
        ProcessError, match="process 0 failed while saving 'ck': process 0: OSError"
    ):
        exchange.receive("sealed", 0)


def test_one_stored_shard_for_two_tensors_is_refused(tmp_path, per_process):
    """A manifest (resealed) whose two tensors point at the same stored piece is refused:
    one stored piece never backs two tensors."""
    path = tmp_path / "ck"
    save_checkpoint(path, {"a": jnp.ones(4), "b": jnp.zeros(4)})
    file = path / "manifest.json"
    manifest = json.loads(file.read_text())
    tensors = manifest["tensors"]
    tensors["b"]["shards"] = [dict(s) for s in tensors["a"]["shards"]]
    raw = json.dumps(manifest).encode()
    file.write_bytes(raw)
    with open(path / FILE, "rb") as f:
        entries, meta = read_file_header(f)
        data = {name: read_tensor(f, entry) for name, entry in entries.items()}
    meta = {k: v for k, v in meta.items() if k != "format"}
    meta["lowbit.manifest_sha256"] = hashlib.sha256(raw).hexdigest()
    os.unlink(path / FILE)
    write_safetensors(str(path / FILE), data, meta)
    with pytest.raises(CheckpointError, match="is referenced twice"):
        load_checkpoint(path)


def test_the_temporary_of_a_save_whose_processes_died_is_removed_by_the_next(saved):
    """Process 0 died mid-save: its temporary (shard files, spools) holds no lock, so the
    next save removes it; a stranger's directory of the same shape is kept."""
    path, tree = saved
    dead = path.parent / ".ck.tmp-0123456789abcdef"
    dead.mkdir()
    for name in ("process-00000.safetensors", "process-00001.safetensors.spool"):
        (dead / name).write_bytes(b"partial")
    kept = path.parent / ".ck.tmp-fedcba9876543210"
    kept.mkdir()
    (kept / "notes.txt").write_text("not ours")
    save_checkpoint(path, tree)
    assert not dead.exists() and kept.exists()
