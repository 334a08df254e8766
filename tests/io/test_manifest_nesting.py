"""A manifest nested too deeply is a `CheckpointError`, never a `RecursionError`."""

import json

import jax.numpy as jnp
import pytest

import lowbit
from lowbit.io import CheckpointError
from lowbit.io._manifest import MAX_TREE_DEPTH, decode_tree


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("nesting") / "ck"
    lowbit.save_checkpoint(path, {"w": jnp.ones((2, 2))})
    return path, json.loads((path / "manifest.json").read_text())


def _nested(tree: dict, depth: int) -> dict:
    for _ in range(depth):
        tree = {"kind": "list", "items": [tree]}
    return tree


@pytest.mark.parametrize("depth", [5000, 200_000])
def test_json_nested_too_deeply_is_a_checkpoint_error(checkpoint, depth):
    path, manifest = checkpoint
    inner = json.dumps(manifest["tree"])
    tree = '{"kind": "list", "items": [' * depth + inner + "]}" * depth
    (path / "manifest.json").write_text(json.dumps({**manifest, "tree": "@"}).replace('"@"', tree))
    with pytest.raises(CheckpointError, match="nested too deeply"):
        lowbit.load_checkpoint(path)


def test_tree_depth_is_limited(checkpoint):
    _, manifest = checkpoint
    tree = _nested(manifest["tree"], MAX_TREE_DEPTH + 1)
    with pytest.raises(CheckpointError, match=f"nests deeper than {MAX_TREE_DEPTH} levels"):
        decode_tree(tree, manifest["tensors"], "manifest.json")
    plan = decode_tree(_nested(manifest["tree"], 20), manifest["tensors"], "manifest.json")
    assert len(next(iter(plan.shapes))) == 21  # 20 list levels, then the "w" key


def test_moderately_nested_params_round_trip(tmp_path):
    params = {"w": jnp.ones((2, 2))}
    for _ in range(20):
        params = [params]
    lowbit.save_checkpoint(tmp_path / "ck", params)
    loaded = lowbit.load_checkpoint(tmp_path / "ck")
    for _ in range(20):
        (loaded,) = loaded
    assert loaded["w"].shape == (2, 2)
