"""LoRA adapters on disk: round trip, and refusal of adapters made for another base."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowbit
from lowbit.api import LoraConfig, LoraRule, lora_apply, lora_init
from lowbit.io import (
    CheckpointError,
    load_adapted_checkpoint,
    load_adapters,
    save_adapters,
    save_checkpoint,
)
from lowbit.ops import LoraWeight

CONFIG = LoraConfig(rules=(LoraRule(path=r".*kernel", rank=2),), train=r".*bias")


def _params(out=32, recipe="int8w"):
    key = jax.random.key(0)
    floats = {
        "dense": {"kernel": jax.random.normal(key, (64, out)), "bias": jnp.zeros(out)},
    }
    return lowbit.quantize_params(floats, recipe)


def _trained(params):
    adapters = lora_init(params, CONFIG, jax.random.key(1))
    entry = adapters["dense/kernel"]
    adapters["dense/kernel"] = {**entry, "b": jnp.full(entry["b"].shape, 0.5)}
    return adapters


def test_round_trip(tmp_path):
    params = _params()
    adapters = _trained(params)
    save_adapters(tmp_path / "ad", adapters, CONFIG, base=params, metadata={"model": "toy"})
    loaded, config = load_adapters(tmp_path / "ad", base=params)
    assert config == CONFIG
    for path in adapters:
        for name in adapters[path]:
            np.testing.assert_array_equal(loaded[path][name], adapters[path][name])


def test_finetune_directory_loads_with_adapters(tmp_path):
    params = _params()
    adapters = _trained(params)
    save_checkpoint(tmp_path / "run", params)
    save_adapters(tmp_path / "run" / "adapters", adapters, CONFIG, base=params)
    restored = load_adapted_checkpoint(tmp_path / "run")
    assert isinstance(restored["dense"]["kernel"], LoraWeight)
    x = jnp.ones((2, 64))
    fn = lowbit.run(lambda p, x: x @ p["dense"]["kernel"] + p["dense"]["bias"])
    np.testing.assert_allclose(
        fn(restored, x), fn(lora_apply(params, adapters, CONFIG), x), rtol=1e-6
    )


@pytest.mark.parametrize(
    "other, fragment",
    [
        (dict(out=24), "another model or recipe"),  # another shape
        (dict(recipe="int4w_g64"), "another model or recipe"),  # another base format
    ],
)
def test_adapters_for_another_base_are_refused(tmp_path, other, fragment):
    params = _params()
    save_adapters(tmp_path / "ad", _trained(params), CONFIG, base=params)
    with pytest.raises(CheckpointError, match=fragment):
        load_adapters(tmp_path / "ad", base=_params(**other))


def test_tampered_adapters_are_refused(tmp_path):
    params = _params()
    save_adapters(tmp_path / "ad", _trained(params), CONFIG, base=params)
    manifest = tmp_path / "ad" / "manifest.json"
    data = json.loads(manifest.read_text())
    rank3 = json.loads(data["metadata"]["lora"]["config"])
    rank3["rules"][0]["rank"] = 3
    data["metadata"]["lora"]["config"] = json.dumps(rank3)
    manifest.write_text(json.dumps(data))
    with pytest.raises(CheckpointError):  # the manifest is sealed: an edited one is refused
        load_adapters(tmp_path / "ad", base=params)
    with open(tmp_path / "ad" / "model.safetensors", "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(CheckpointError):
        load_adapters(tmp_path / "ad", base=params)


def test_a_plain_checkpoint_is_not_adapters(tmp_path):
    params = _params()
    save_checkpoint(tmp_path / "ckpt", params)
    with pytest.raises(CheckpointError, match="no LoRA adapters"):
        load_adapters(tmp_path / "ckpt", base=params)
