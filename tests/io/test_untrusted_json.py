"""`load_json`: every bad input is the caller's error naming the place, never a crash."""

import numpy as np
import pytest

from lowbit.io import CheckpointError, save_checkpoint
from lowbit.io._untrusted_json import load_json


def test_valid_json_is_returned():
    assert load_json(b'{"a": [1, 2]}', "f") == {"a": [1, 2]}


@pytest.mark.parametrize(
    "raw, fragment",
    [
        (b"{not json", "f: header is not valid JSON"),
        (b'"\xff\xfe"', "f: header is not valid JSON"),
        (b"[" * 200_000 + b"]" * 200_000, "f: header is JSON nested too deeply"),
    ],
)
def test_bad_json_names_the_place(raw, fragment):
    with pytest.raises(ValueError, match=fragment):
        load_json(raw, "f: header")


def test_the_error_type_is_the_callers():
    with pytest.raises(CheckpointError, match="m.json is not valid JSON"):
        load_json(b"", "m.json", CheckpointError)


def test_save_refuses_a_directory_whose_manifest_nests_too_deeply(tmp_path):
    # Before, the check of a directory to replace let the parser's RecursionError escape.
    path = tmp_path / "out"
    path.mkdir()
    (path / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ValueError, match="manifest.json that is not JSON"):
        save_checkpoint(path, {"w": np.ones((2, 2), np.float32)})
