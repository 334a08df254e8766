"""QArray declares its fields once; checkpoints carry every one of them (none can be left out)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.io import load_checkpoint, read_manifest, save_checkpoint
from lowbit.qarray import DATA_FIELDS, META_FIELDS, Fixed, PerToken, QArray, QuantConfig
from lowbit.qarray._qarray import _meta, field_roles


def _every_field_set() -> QArray:
    # Every field away from its default, so a field the checkpoint dropped would show.
    return QArray(
        codes=jnp.arange(64, dtype=jnp.uint8).reshape(4, 16),
        scale=jnp.full((4, 1), 0.5, jnp.bfloat16),
        zero_point=jnp.full((4, 1), 3.0, jnp.bfloat16),
        tensor_scale=jnp.full((1, 1), 2.0, jnp.float32),
        format="uint4",
        shape=(4, 32),
        dtype=jnp.bfloat16,
        packed_axis=1,
        scale_encoding="float",
        activation=QuantConfig(format="int8", granularity=PerToken(), calibration=Fixed(-1, 1)),
        activation_bounds=jnp.asarray([-1.0, 1.0], jnp.float32),
        input_scale=jnp.linspace(0.5, 2.0, 4, dtype=jnp.float32)[:, None],
    ).check()


def test_fields_are_declared_once_and_cover_the_dataclass():
    names = {f.name for f in dataclasses.fields(QArray)}
    assert set(DATA_FIELDS) | set(META_FIELDS) == names
    assert not set(DATA_FIELDS) & set(META_FIELDS)


def test_manifest_holds_every_field_and_round_trips(tmp_path):
    q = _every_field_set()
    save_checkpoint(tmp_path / "ck", {"w": q})
    node = read_manifest(tmp_path / "ck")["tree"]["items"][0][1]
    assert set(node) == {"kind", "tensors", *META_FIELDS}
    assert set(node["tensors"]) == set(DATA_FIELDS)
    back = load_checkpoint(tmp_path / "ck")["w"]
    for f in dataclasses.fields(QArray):
        a, b = getattr(q, f.name), getattr(back, f.name)
        if f.name in DATA_FIELDS:
            assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
        else:
            assert a == b, f.name


def test_a_field_without_a_role_is_refused():
    @dataclasses.dataclass(frozen=True, eq=False)
    class Undeclared(QArray):
        extra: int = 0

    with pytest.raises(TypeError, match="extra"):
        field_roles(Undeclared)

    @dataclasses.dataclass(frozen=True, eq=False)
    class Declared(QArray):
        extra: int = _meta(default=7)

    # A declared field goes into the manifest with no change elsewhere.
    meta = Declared(
        **{f.name: getattr(_every_field_set(), f.name) for f in dataclasses.fields(QArray)}
    ).manifest_metadata(lambda c: "cfg")
    assert meta["extra"] == 7
