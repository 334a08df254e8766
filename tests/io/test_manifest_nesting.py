"""A manifest nested too deeply is a `CheckpointError`, never a `RecursionError`."""

import json

import jax.numpy as jnp
import pytest

import lowbit
from lowbit.io import CheckpointError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("nesting") / "ck"
    lowbit.save_checkpoint(path, {"w": jnp.ones((2, 2))})
    return path, json.loads((path / "manifest.json").read_text())


def _nest(checkpoint, depth: int):
    """Rewrites the manifest with its tree inside `depth` one-element lists."""
    path, manifest = checkpoint
    inner = json.dumps(manifest["tree"])
    tree = '{"kind": "list", "items": [' * depth + inner + "]}" * depth
    (path / "manifest.json").write_text(json.dumps({**manifest, "tree": "@"}).replace('"@"', tree))
    return path


@pytest.mark.parametrize("depth", [150, 5000, 200_000])
def test_deeply_nested_manifest_is_a_checkpoint_error(checkpoint, depth):
    path = _nest(checkpoint, depth)
    with pytest.raises(CheckpointError, match="nest"):
        lowbit.load_checkpoint(path)


def test_moderate_nesting_still_loads(checkpoint):
    params = lowbit.load_checkpoint(_nest(checkpoint, 20))
    for _ in range(20):
        (params,) = params
    assert params["w"].shape == (2, 2)
