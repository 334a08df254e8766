"""What a save may replace, symlinks, manifest integrity, concurrent readers, stale temporaries."""

import fcntl
import hashlib
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from lowbit import _atomic as atomic_module
from lowbit import cli
from lowbit.io import CheckpointError, load_checkpoint, read_manifest, save_checkpoint
from lowbit.io import _checkpoint as checkpoint_module
from lowbit.io import _checkpoint_dir as dir_module
from lowbit.qarray import quantize

OLD = {"w": jnp.arange(6, dtype=jnp.float32), "b": jnp.ones(2)}
NEW = {"other": jnp.zeros((3, 3), jnp.bfloat16)}


def _assert_tree(loaded, expected):
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert np.asarray(loaded[key]).tobytes() == np.asarray(value).tobytes()


def _snapshot(directory):
    """Every file under `directory` (relative path -> bytes, or the link target)."""
    out = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, directory)
            if os.path.islink(full):
                out[rel] = "-> " + os.readlink(full)
            elif os.path.isfile(full):
                with open(full, "rb") as f:
                    out[rel] = f.read()
    return out


# --- 1. only an empty directory or one of our checkpoints is replaced ------------------------


def _make(kind, path):
    path.mkdir()
    if kind == "empty_manifest_and_notes":
        (path / "manifest.json").write_text("{}")
        (path / "notes.txt").write_text("my notes")
    elif kind == "empty_manifest_only":
        (path / "manifest.json").write_text("{}")
    elif kind == "other_format":
        (path / "manifest.json").write_text(json.dumps({"format": "x", "format_version": 2}))
        (path / "model.safetensors").write_bytes(b"data")
    elif kind == "future_version":
        manifest = {"format": "lowbit.checkpoint", "format_version": 99}
        (path / "manifest.json").write_text(json.dumps(manifest))
    elif kind == "manifest_not_json":
        (path / "manifest.json").write_text("not json")
    elif kind == "checkpoint_plus_file":
        path.rmdir()
        save_checkpoint(path, OLD)
        (path / "README").write_text("about this run")
    elif kind == "checkpoint_plus_subdirectory":
        path.rmdir()
        save_checkpoint(path, OLD)
        (path / "logs").mkdir()
        (path / "logs" / "train.log").write_text("step 1")
    elif kind == "tensor_file_is_a_directory":
        (path / "manifest.json").write_text(json.dumps({"format": "lowbit.checkpoint"}))
        (path / "model.safetensors").mkdir()
    elif kind == "manifest_is_a_symlink":
        (path.parent / "elsewhere.json").write_text("{}")
        os.symlink(path.parent / "elsewhere.json", path / "manifest.json")
    elif kind == "tensor_file_is_a_symlink":
        path.rmdir()
        save_checkpoint(path, OLD)
        (path.parent / "elsewhere.safetensors").write_bytes(b"keep")
        os.unlink(path / "model.safetensors")
        os.symlink(path.parent / "elsewhere.safetensors", path / "model.safetensors")


NOT_OURS = [
    "empty_manifest_and_notes",
    "empty_manifest_only",
    "other_format",
    "future_version",
    "manifest_not_json",
    "checkpoint_plus_file",
    "checkpoint_plus_subdirectory",
    "tensor_file_is_a_directory",
    "manifest_is_a_symlink",
    "tensor_file_is_a_symlink",
]


@pytest.mark.parametrize("kind", NOT_OURS)
def test_save_refuses_a_directory_that_is_not_provably_ours(tmp_path, kind):
    path = tmp_path / "out"
    _make(kind, path)
    before = _snapshot(tmp_path)
    with pytest.raises(ValueError, match=rf"'{path}'.*not a lowbit checkpoint; refusing"):
        save_checkpoint(path, NEW)
    assert _snapshot(tmp_path) == before


def test_save_refuses_a_file(tmp_path):
    (tmp_path / "out").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        save_checkpoint(tmp_path / "out", NEW)
    assert (tmp_path / "out").read_text() == "x"


def test_save_fills_an_empty_directory_and_replaces_its_own_checkpoints(tmp_path):
    (tmp_path / "out").mkdir()
    save_checkpoint(tmp_path / "out", OLD)
    _assert_tree(load_checkpoint(tmp_path / "out"), OLD)
    save_checkpoint(tmp_path / "out", NEW)
    _assert_tree(load_checkpoint(tmp_path / "out"), NEW)
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_save_checks_again_before_the_swap(tmp_path, monkeypatch):
    path = tmp_path / "out"
    save_checkpoint(path, OLD)
    real_write = dir_module.write_file  # the publish step writes the manifest

    def write_while_a_user_adds_a_file(*args):
        (path / "notes.txt").write_text("added meanwhile")
        real_write(*args)

    monkeypatch.setattr(dir_module, "write_file", write_while_a_user_adds_a_file)
    with pytest.raises(ValueError, match="holds 'notes.txt'"):
        save_checkpoint(path, NEW)
    assert (path / "notes.txt").read_text() == "added meanwhile"
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_cli_quantize_refuses_out_before_loading_the_model(tmp_path, capsys):
    out = tmp_path / "results"
    _make("empty_manifest_and_notes", out)
    before = _snapshot(tmp_path)
    argv = ["quantize", str(tmp_path / "model.gguf"), "--recipe", "int8_weight_only"]
    assert cli.main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"'{out}'" in err and "not a lowbit checkpoint" in err
    assert _snapshot(tmp_path) == before


# --- 4. the manifest is covered by the integrity check --------------------------------------


@pytest.fixture
def int4_checkpoint(tmp_path):
    x = jnp.linspace(-1.0, 1.0, 8 * 64, dtype=jnp.float32).reshape(8, 64)
    save_checkpoint(tmp_path / "ck", {"w": quantize(x, "int4")}, metadata={"step": 1})
    return tmp_path / "ck"


def _edit(path, edit):
    file = path / "manifest.json"
    manifest = json.loads(file.read_text())
    edit(manifest)
    file.write_text(json.dumps(manifest, indent=2))


def _set_format(manifest, name):
    for _, node in manifest["tree"]["items"]:
        node["format"] = name


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: _set_format(m, "uint4"),
        lambda m: m["tree"]["items"][0][1].update(dtype="bfloat16"),
        lambda m: m.update(metadata={"step": 2}),
        lambda m: m.update(recipe='{"rules": []}'),
        lambda m: None,  # reformatted only: the bytes differ
    ],
    ids=["int4_to_uint4", "logical_dtype", "metadata", "recipe", "whitespace"],
)
def test_an_edited_manifest_is_refused(int4_checkpoint, edit):
    _edit(int4_checkpoint, edit)
    with pytest.raises(CheckpointError, match=r"manifest\.json: not the manifest"):
        load_checkpoint(int4_checkpoint)
    with pytest.raises(CheckpointError, match=r"manifest\.json: not the manifest"):
        read_manifest(int4_checkpoint)


def test_a_manifest_from_another_checkpoint_is_refused(int4_checkpoint, tmp_path):
    save_checkpoint(tmp_path / "other", {"w": quantize(jnp.ones((8, 64)), "int4")})
    shutil.copy(tmp_path / "other" / "manifest.json", int4_checkpoint / "manifest.json")
    with pytest.raises(CheckpointError, match="not the manifest"):
        load_checkpoint(int4_checkpoint)


def test_the_digest_is_of_the_manifest_bytes(int4_checkpoint):
    from lowbit.io._safetensors_file import read_file_header

    with open(int4_checkpoint / "model.safetensors", "rb") as f:
        _, header = read_file_header(f)
    manifest = (int4_checkpoint / "manifest.json").read_bytes()
    assert header[checkpoint_module.MANIFEST_DIGEST_KEY] == hashlib.sha256(manifest).hexdigest()


# --- 5. saving through a symlink ------------------------------------------------------------


def test_save_through_a_symlink_replaces_the_target_and_keeps_the_link(tmp_path):
    save_checkpoint(tmp_path / "run1", OLD)
    os.symlink("run1", tmp_path / "latest")
    save_checkpoint(tmp_path / "latest", NEW)
    assert os.readlink(tmp_path / "latest") == "run1"
    _assert_tree(load_checkpoint(tmp_path / "run1"), NEW)
    _assert_tree(load_checkpoint(tmp_path / "latest"), NEW)
    assert sorted(os.listdir(tmp_path)) == ["latest", "run1"]


def test_save_through_a_dangling_symlink_creates_its_target(tmp_path):
    (tmp_path / "runs").mkdir()
    os.symlink(tmp_path / "runs" / "run2", tmp_path / "latest")
    save_checkpoint(tmp_path / "latest", NEW)
    assert os.path.islink(tmp_path / "latest")
    _assert_tree(load_checkpoint(tmp_path / "runs" / "run2"), NEW)
    assert sorted(os.listdir(tmp_path)) == ["latest", "runs"]
    assert os.listdir(tmp_path / "runs") == ["run2"]


def test_a_symlink_to_a_directory_that_is_not_ours_is_refused_naming_both(tmp_path):
    _make("empty_manifest_and_notes", tmp_path / "data")
    os.symlink("data", tmp_path / "latest")
    with pytest.raises(ValueError, match=r"'.*latest' \(-> '.*data'\).*not a lowbit"):
        save_checkpoint(tmp_path / "latest", NEW)
    assert (tmp_path / "data" / "notes.txt").read_text() == "my notes"


# --- 6. a reader during a save sees the old checkpoint or the new one, never a mix ------------


@pytest.mark.parametrize("atomic_exchange", [True, False])
def test_a_save_between_reading_manifest_and_tensors_is_not_mixed_in(
    tmp_path, monkeypatch, atomic_exchange
):
    path = tmp_path / "ck"
    save_checkpoint(path, OLD)
    if not atomic_exchange:
        monkeypatch.setattr(atomic_module, "exchange", lambda a, b: False)
    real_decode, saves = checkpoint_module.decode_tree, []

    def decode_then_save(*args, **kwargs):
        # The loader has read the manifest; a concurrent save lands now.
        if not saves:
            saves.append(save_checkpoint(path, NEW))
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(checkpoint_module, "decode_tree", decode_then_save)
    _assert_tree(load_checkpoint(path), OLD)
    assert saves
    _assert_tree(load_checkpoint(path), NEW)


def test_a_directory_swapped_before_its_files_are_opened_is_read_again(tmp_path, monkeypatch):
    from lowbit.io import _checkpoint_dir

    path = tmp_path / "ck"
    save_checkpoint(path, OLD)
    real_read, calls = _checkpoint_dir._read_directory, []

    def save_first(*args):
        # The reader holds the old directory open; a save replaces (and deletes) it first.
        if not calls:
            save_checkpoint(path, NEW)
        calls.append(1)
        return real_read(*args)

    monkeypatch.setattr(_checkpoint_dir, "_read_directory", save_first)
    _assert_tree(load_checkpoint(path), NEW)
    assert len(calls) == 2


# --- 6. temporaries of killed saves ---------------------------------------------------------


def _temporary(tmp_path, token="0123456789abcdef", files=("model.safetensors",), base="ck"):
    tmp = tmp_path / f".{base}.tmp-{token}"
    tmp.mkdir()
    for name in files:
        (tmp / name).write_bytes(b"\0" * 4096)
    return tmp


def test_the_next_save_removes_temporaries_of_dead_saves(tmp_path):
    save_checkpoint(tmp_path / "ck", OLD)
    dead = [
        _temporary(tmp_path, "0123456789abcdef", ("model.safetensors",)),
        _temporary(tmp_path, "fedcba9876543210", ("model.safetensors", "manifest.json")),
        _temporary(tmp_path, "00000000000000aa.old", ("manifest.json",)),
        _temporary(tmp_path, "00000000000000bb", ()),
        # Killed inside the safetensors writer, which writes through its own ".tmpXXXXXX".
        _temporary(tmp_path, "00000000000000cc", ("manifest.json", ".tmpAb3xY9")),
    ]
    save_checkpoint(tmp_path / "ck", NEW)
    assert not any(t.exists() for t in dead)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    _assert_tree(load_checkpoint(tmp_path / "ck"), NEW)


def test_temporaries_not_provably_ours_and_stale_are_kept(tmp_path):
    save_checkpoint(tmp_path / "ck", OLD)
    live = _temporary(tmp_path, "1111111111111111")
    keep = [
        live,
        _temporary(tmp_path, "2222222222222222", ("model.safetensors", "user.txt")),
        _temporary(tmp_path, "6666666666666666", (".tmp-not-the-writers",)),
        _temporary(tmp_path, "not-hex-digits!!"),
        _temporary(tmp_path, "333333333333333"),  # 15 digits
        _temporary(tmp_path, "4444444444444444", base="other"),
    ]
    (tmp_path / "target").mkdir()
    os.symlink("target", tmp_path / ".ck.tmp-5555555555555555")
    # A save still running holds the lock on its temporary.
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        save_checkpoint(tmp_path / "ck", NEW)
    finally:
        os.close(fd)
    assert all(t.exists() for t in keep)
    assert os.path.islink(tmp_path / ".ck.tmp-5555555555555555")
    assert (tmp_path / "target").is_dir()


def test_loads_and_saves_leave_no_temporaries(tmp_path):
    q = quantize(jnp.ones((8, 64)), "int4")
    for params in (OLD, {"q": q}, NEW):
        save_checkpoint(tmp_path / "ck", params)
        load_checkpoint(tmp_path / "ck")
    assert sorted(os.listdir(tmp_path)) == ["ck"]
