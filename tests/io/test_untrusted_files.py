"""Files from strangers: non-regular files, hostile JSON and safetensors headers are refused
at once with the reader's error type, naming the file (issue: untrusted input, fuzzed)."""

from __future__ import annotations

import json
import os
import signal
import struct

import numpy as np
import pytest

from lowbit._untrusted import load_json, open_regular, read_text
from lowbit.gguf import GGUFError, read_gguf
from lowbit.io import CheckpointError, load_checkpoint, save_checkpoint
from lowbit.io._safetensors_file import read_header


@pytest.fixture(autouse=True)
def _no_hang():
    """A reader that blocks on a FIFO would hang the suite: fail after 20 s instead."""

    def expired(*_):
        raise TimeoutError("a reader blocked on a non-regular file")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    save_checkpoint(path, {"w": np.arange(4, dtype=np.float32)})
    return path


@pytest.mark.parametrize("name", ["manifest.json", "model.safetensors"])
def test_load_checkpoint_refuses_a_fifo_at_once(tmp_path, name):
    path = _checkpoint(tmp_path)
    os.remove(path / name)
    os.mkfifo(path / name)
    with pytest.raises(CheckpointError, match=f"{name}: is a FIFO"):
        load_checkpoint(path)


def test_readers_refuse_fifos_and_directories(tmp_path):
    fifo = tmp_path / "x"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="is a FIFO"):
        read_header(fifo)
    with pytest.raises(GGUFError, match="is a FIFO"):
        read_gguf(fifo)
    with pytest.raises(ValueError, match="is a FIFO"):
        read_text(fifo)
    with pytest.raises(ValueError, match="is a directory"):
        open_regular(tmp_path)


def test_open_regular_names_the_file_as_given(tmp_path):
    (tmp_path / "f").write_bytes(b"abc")
    with open_regular(tmp_path / "f") as f:
        assert f.name == str(tmp_path / "f") and f.read() == b"abc"


def test_a_5000_digit_integer_in_a_manifest_is_a_checkpoint_error(tmp_path):
    path = _checkpoint(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["metadata"] = {"n": "HUGE"}
    text = json.dumps(manifest).replace('"HUGE"', "9" * 5000)
    (path / "manifest.json").write_text(text)
    with pytest.raises(CheckpointError, match="manifest.json is not JSON this reader accepts"):
        load_checkpoint(path)


@pytest.mark.parametrize(
    "raw, fragment",
    [
        (b"1" * 5000, "is not JSON this reader accepts"),
        (b'{"a": 1, "a": 2}', "key 'a' appears twice"),
        (b"[" * 100_000, "nested too deeply"),
    ],
)
def test_load_json_turns_every_parser_failure_into_the_callers_error(raw, fragment):
    with pytest.raises(CheckpointError, match=fragment):
        load_json(raw, "m.json", CheckpointError)


def _safetensors(tmp_path, header: str, data: bytes):
    raw = header.encode()
    path = tmp_path / "t.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_safetensors_header_naming_a_tensor_twice_is_refused(tmp_path):
    entry = '{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
    path = _safetensors(tmp_path, f'{{"a": {entry}, "a": {entry}}}', bytes(4))
    with pytest.raises(ValueError, match="t.safetensors: header .*key 'a' appears twice"):
        read_header(path)


def test_safetensors_overlapping_tensors_are_refused(tmp_path):
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
    }
    path = _safetensors(tmp_path, json.dumps(header), bytes(8))
    with pytest.raises(ValueError, match="tensor 'b' .*overlaps tensor 'a'"):
        read_header(path)


def test_safetensors_hole_between_tensors_is_refused(tmp_path):
    header = {
        "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
    }
    path = _safetensors(tmp_path, json.dumps(header), bytes(12))
    with pytest.raises(ValueError, match="4 bytes before tensor 'b' .*belong to no tensor"):
        read_header(path)


def test_safetensors_empty_tensors_may_share_an_offset(tmp_path):
    header = {
        "a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
        "b": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
        "c": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
    }
    path = _safetensors(tmp_path, json.dumps(header), bytes(4))
    assert list(read_header(path)) == ["a", "b", "c"]


def test_safetensors_huge_declared_tensor_is_refused_before_reading(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}}
    path = _safetensors(tmp_path, json.dumps(header), bytes(4))
    with pytest.raises(ValueError, match=r"tensor 'a' ends at byte \d{13}"):
        read_header(path)


def test_checkpoint_recipe_that_is_not_text_is_a_checkpoint_error(tmp_path):
    from lowbit.io import _checkpoint
    from lowbit.recipes import preset

    with pytest.raises(CheckpointError, match="'recipe' is int"):
        _checkpoint._check_recipe(5, preset("int8"), "m.json")
    with pytest.raises(CheckpointError, match="m.json: recipe is JSON nested too deeply"):
        _checkpoint._check_recipe("[" * 100_000, preset("int8"), "m.json")


def test_hugging_face_config_and_index_that_are_fifos_are_refused(tmp_path):
    from lowbit.models._decoder_hf import _read_index, read_hf_config

    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(ValueError, match="config.json: .*is a FIFO"):
        read_hf_config(tmp_path)
    os.mkfifo(tmp_path / "model.safetensors.index.json")
    with pytest.raises(ValueError, match="index.json: not a safetensors index .*is a FIFO"):
        _read_index(tmp_path / "model.safetensors.index.json")


def test_safetensors_dtype_that_is_not_a_string_is_refused(tmp_path):
    # Found by fuzz/safetensors_reader.py: a list as dtype raised TypeError (unhashable).
    header = '{"x": {"dtype": [2, 8], "shape": [4], "data_offsets": [0, 16]}}'
    path = _safetensors(tmp_path, header, bytes(16))
    with pytest.raises(ValueError, match=r"tensor 'x': dtype \[2, 8\]; accepted"):
        read_header(path)


def test_manifest_tensor_reference_that_is_not_a_name_is_refused():
    from lowbit.io._manifest import decode_tree

    with pytest.raises(CheckpointError, match=r"refers to tensor \['a'\]"):
        decode_tree({"kind": "array", "tensor": ["a"]}, {}, "m.json")


def test_a_corrupt_safetensors_header_names_the_file(tmp_path):
    # It reached the user as a bare "SafetensorError: ... header too large".
    from lowbit.models import has_minilm, load_hf_bert, minilm_dir

    if not has_minilm():
        pytest.skip("all-MiniLM-L6-v2 is not installed")
    (tmp_path / "config.json").write_bytes((minilm_dir() / "config.json").read_bytes())
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 7 + b"\x7f{}")
    with pytest.raises(ValueError, match=r"model.safetensors: not a readable safetensors file"):
        load_hf_bert(tmp_path)
