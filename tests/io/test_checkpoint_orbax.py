"""QArray trees save and restore through plain Orbax (`StandardCheckpointer`), sharded too."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lowbit.formats import FORMATS
from lowbit.ops import prepare_weight
from lowbit.qarray import Fixed, PerGroup, PerToken, QArray, QuantConfig, quantize

ocp = pytest.importorskip("orbax.checkpoint")

ACTIVATION = QuantConfig(
    format="int8", granularity=PerToken(), calibration=Fixed(-4.0, 4.0), symmetric=False
)


def _synthetic(name: str, rng: np.random.Generator, **fields) -> QArray:
    """A [16, 64] QArray of format `name` with random stored bits (no compiles)."""
    fmt = FORMATS[name]
    grid = (16, 64 // (fmt.block_size or 32))
    packed = fmt.bits < 8
    codes = rng.integers(0, 256, (16, fmt.packed_length(64) if packed else 64), dtype=np.uint8)
    tensor_scale = None
    if fmt.scale_encoding == "e8m0":  # uint8 exponents
        scale = rng.integers(100, 150, grid, dtype=np.uint8)
    elif fmt.scale_encoding == "e4m3":  # float8 scales under a float32 tensor scale
        scale = rng.integers(0, 120, grid, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
        tensor_scale = np.full((1, 1), 0.125, np.float32)
    else:
        scale = rng.random(grid, dtype=np.float32)
    return QArray(
        codes=jnp.asarray(codes if packed else codes.view(fmt.code_dtype)),
        scale=jnp.asarray(scale),
        zero_point=jnp.asarray(rng.random(grid, np.float32)) if name.startswith("u") else None,
        tensor_scale=None if tensor_scale is None else jnp.asarray(tensor_scale),
        format=name,
        shape=(16, 64),
        dtype=jnp.bfloat16,
        packed_axis=1 if packed else None,
        scale_encoding=fmt.scale_encoding,
        **fields,
    ).check()


def _params():
    rng = np.random.default_rng(0)
    params = {name: _synthetic(name, rng) for name in ("int4", "uint4", "nvfp4", "mxfp4")}
    params["fp8"] = _synthetic("fp8_e4m3fn", rng)
    params["w8a8"] = _synthetic(
        "int8", rng, activation=ACTIVATION, activation_bounds=jnp.asarray([-4.0, 4.0])
    )
    # As served: laid out for the CPU kernels (a `PreparedQArray` where the kernels run).
    kernel = quantize(jnp.ones((256, 256)), "int4", granularity=PerGroup(32, axis=0))
    params["dense"] = {"kernel": prepare_weight(kernel, 0), "bias": jnp.ones(256)}
    params["nothing"] = None
    return params


def _assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert (x.dtype, x.shape) == (y.dtype, y.shape)
        assert x.tobytes() == y.tobytes()


def test_standard_checkpointer_round_trips_qarrays(tmp_path):
    params = _params()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ck", params)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "ck", jax.eval_shape(lambda: params))
    # Same treedef (every QArray's static metadata) and the same bits in every leaf.
    _assert_same(restored, params)
    assert isinstance(restored["nvfp4"], QArray) and restored["w8a8"].activation == ACTIVATION
    assert type(restored["dense"]["kernel"]) is type(params["dense"]["kernel"])


def test_standard_checkpointer_restores_sharded_qarrays(tmp_path):
    devices = np.array(jax.devices()[:2])
    if devices.size < 2:
        pytest.skip("needs two devices (the test suite simulates eight CPU devices)")
    rows = NamedSharding(Mesh(devices, ("x",)), PartitionSpec("x"))
    q = _synthetic("int4", np.random.default_rng(1))  # codes [16, 32], scale [16, 2]
    params = {"w": jax.device_put(q, rows)}
    assert params["w"].codes.sharding == rows
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ck", params)
        checkpointer.wait_until_finished()
        # Restore onto another layout than the one saved: four devices, replicated.
        wide = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("y",)), PartitionSpec())
        abstract = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            params,
            {"w": jax.tree.map(lambda _: rows, q)},
        )
        restored = checkpointer.restore(tmp_path / "ck", abstract)
        replicated = checkpointer.restore(
            tmp_path / "ck", jax.tree.map(lambda a: a.update(sharding=wide), abstract)
        )
    assert restored["w"].codes.sharding == rows and restored["w"].scale.sharding == rows
    assert len(replicated["w"].codes.sharding.device_set) == 4
    _assert_same(restored, {"w": q})
    _assert_same(replicated, {"w": q})
