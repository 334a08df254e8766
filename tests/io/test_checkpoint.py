"""Checkpoint round trips, refusal of every malformed file, atomic writes, no pickle."""

import ast
import dataclasses
import doctest
import hashlib
import json
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import lowbit.io
from lowbit import _atomic as atomic_module
from lowbit.formats import FORMATS, GGUFBlockFormat
from lowbit.io import CheckpointError, load_checkpoint, read_manifest, save_checkpoint
from lowbit.io import _checkpoint as checkpoint_module
from lowbit.io import _checkpoint_dir as dir_module
from lowbit.io import _checkpoint_writer as writer_module
from lowbit.io._manifest import build_tree, decode_tree
from lowbit.io._safetensors_file import (
    read_file_header,
    read_header,
    read_tensor,
    write_safetensors,
)
from lowbit.qarray import Fixed, PerGroup, PerToken, QArray, QuantConfig, quantize

X = np.asarray(jax.random.normal(jax.random.key(0), (32, 64), jnp.float32))


def _assert_same(a, b):
    """Same treedef (QArray metadata included) and bit-identical leaves (NaN patterns too)."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if isinstance(y, bool | int | float):
            assert type(x) is type(y) and x == y
            continue
        x, y = np.asarray(x), np.asarray(y)
        assert (x.dtype, x.shape) == (y.dtype, y.shape)
        assert x.tobytes() == y.tobytes()


def _synthetic(name: str, seed: int = 0) -> QArray:
    """A QArray of format `name` with random stored bits in every leaf, shape [8, 64]."""
    rng = np.random.default_rng(seed)
    fmt = FORMATS[name]
    shape = (8, 64)
    grid = (8, 64 // (fmt.block_size or 32))
    packed = fmt.bits < 8
    if isinstance(fmt, GGUFBlockFormat):  # GGUF blocks along the last axis, unit scale
        shape = (8, 256)
        codes = rng.integers(0, 256, (8, fmt.packed_length(256)), dtype=np.uint8)
        return QArray(
            codes=jnp.asarray(codes),
            scale=jnp.ones((1, 1), jnp.uint8),
            zero_point=None,
            tensor_scale=None,
            format=name,
            shape=shape,
            dtype=jnp.float32,
            packed_axis=1,
        ).check()
    code_shape = (8, fmt.packed_length(64)) if packed else shape
    codes = rng.integers(0, 256, code_shape, dtype=np.uint8)
    if not packed:
        codes = codes.view(fmt.code_dtype)
    tensor_scale = None
    if fmt.scale_encoding == "e8m0":
        scale = rng.integers(100, 150, grid, dtype=np.uint8)
    elif fmt.scale_encoding == "e4m3":
        scale = rng.integers(0, 256, grid, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
        tensor_scale = np.full((1, 1), 0.125, np.float32)
    else:
        scale = rng.random(grid, dtype=np.float32)
    zero_point = rng.random(grid, dtype=np.float32) if name.startswith("uint") else None
    return QArray(
        codes=jnp.asarray(codes),
        scale=jnp.asarray(scale),
        zero_point=None if zero_point is None else jnp.asarray(zero_point),
        tensor_scale=None if tensor_scale is None else jnp.asarray(tensor_scale),
        format=name,
        shape=shape,
        dtype=jnp.bfloat16 if seed % 2 else jnp.float32,
        packed_axis=1 if packed else None,
        scale_encoding=fmt.scale_encoding,
    ).check()


def _params(q: QArray) -> dict:
    return {
        "layers": [{"kernel": q, "bias": jnp.arange(4, dtype=jnp.float32)}, {"kernel": None}],
        "norm": {"scale": jnp.ones((3,), jnp.bfloat16)},
        "stack": (jnp.zeros((2, 2), jnp.float16), 7, 0.5, True),
        "by_index": {0: jnp.float32(1.5), 1: jnp.int32(3)},
    }


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_round_trip_every_registered_format(tmp_path, name):
    q = _synthetic(name, seed=len(name))
    params = _params(q)
    save_checkpoint(tmp_path / "ck", params)
    loaded = load_checkpoint(tmp_path / "ck", like=params)
    _assert_same(loaded, params)
    got = loaded["layers"][0]["kernel"]
    for field in ("format", "shape", "dtype", "packed_axis", "scale_encoding", "activation"):
        assert getattr(got, field) == getattr(q, field)


ACTIVATION = QuantConfig(
    format="int8", granularity=PerToken(), calibration=Fixed(-6.0, 6.0), symmetric=False
)


@pytest.mark.parametrize(
    "make",
    [
        lambda x: quantize(x, "int4", granularity=PerGroup(32, axis=0)),
        lambda x: quantize(x, "uint4", granularity=PerGroup(32, axis=1), symmetric=False),
        lambda x: quantize(x, "nvfp4"),
    ],
    ids=["int4", "uint4_asym", "nvfp4"],
)
def test_round_trip_quantized_with_activation_config(tmp_path, make):
    # jit: one compile per config instead of one per eager op.
    q = dataclasses.replace(
        jax.jit(make)(X),
        activation=ACTIVATION,
        activation_bounds=jnp.asarray([-6.0, 6.0], jnp.float32),
    )
    save_checkpoint(tmp_path / "ck", {"w": q})
    got = load_checkpoint(tmp_path / "ck")["w"]
    _assert_same({"w": got}, {"w": q})
    assert got.activation == ACTIVATION
    dequantize = jax.jit(lambda q: q.dequantize())
    assert np.array_equal(np.asarray(dequantize(got)), np.asarray(dequantize(q)))


def test_round_trip_input_scale(tmp_path):
    # SmoothQuant's in-op scale is a data field like the others: stored, checked, restored.
    q = quantize(X, "int8", granularity=PerToken())
    q = dataclasses.replace(q, input_scale=jnp.linspace(0.5, 2.0, X.shape[0])[:, None])
    save_checkpoint(tmp_path / "ck", {"w": q})
    got = load_checkpoint(tmp_path / "ck")["w"]
    _assert_same({"w": got}, {"w": q})
    assert np.array_equal(np.asarray(got.input_scale), np.asarray(q.input_scale))


def test_stored_dtypes_and_manifest(tmp_path):
    q = _synthetic("nvfp4")
    save_checkpoint(tmp_path / "ck", {"w": q}, metadata={"note": "x"}, recipe='{"rules": []}')
    manifest = read_manifest(tmp_path / "ck")
    assert manifest["library_version"] == lowbit.__version__
    assert manifest["metadata"] == {"note": "x"}
    assert json.loads(manifest["recipe"]) == {"rules": []}
    tensors = manifest["tensors"]
    assert tensors["w:scale"]["dtype"] == "float8_e4m3fn"
    assert tensors["w:codes"] == {**tensors["w:codes"], "role": "codes", "shape": [8, 32]}
    header = read_header(str(tmp_path / "ck" / "model.safetensors"))
    assert header["w:scale"].dtype == np.dtype(ml_dtypes.float8_e4m3fn)


def test_nnx_state_saves_as_dict(tmp_path):
    from flax import nnx

    class Layer(nnx.Module):
        def __init__(self):
            self.kernel = nnx.Param(jnp.arange(12.0).reshape(4, 3))
            self.blocks = nnx.List([nnx.Param(jnp.ones(2)), nnx.Param(jnp.zeros(2))])

    state = nnx.state(Layer(), nnx.Param)
    save_checkpoint(tmp_path / "ck", state)
    loaded = load_checkpoint(tmp_path / "ck", like=state)
    _assert_same(loaded, nnx.to_pure_dict(state))


# --- refusals -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "ck"
    params = {"w": _synthetic("int4"), "b": jnp.ones((4,))}
    save_checkpoint(path, params, recipe='{"rules": [1]}')
    return path, params


def _copy(good, tmp_path) -> pathlib.Path:
    dst = tmp_path / "bad"
    shutil.copytree(good[0], dst)
    return dst


def _edit_manifest(path, edit, *, reseal=True):
    """Edits the manifest; `reseal` also updates the digest of it in the tensor file (a
    deliberate, consistent edit, to reach the checks behind the integrity check)."""
    file = path / "manifest.json"
    manifest = json.loads(file.read_text())
    edit(manifest)
    file.write_text(json.dumps(manifest))
    if reseal:
        _rewrite_tensors(path, lambda t: None, manifest=file.read_bytes())


def _rewrite_tensors(path, edit, manifest=None, seal=True):
    """Rewrites the tensor file after `edit` of its tensors, keeping the manifest digest valid
    for `manifest` (bytes; default: the manifest file as it is); `seal=False` writes no digest
    (a version 1 file)."""
    file = str(path / "model.safetensors")
    with open(file, "rb") as f:
        entries, _ = read_file_header(f)
        tensors = {name: read_tensor(f, entry) for name, entry in entries.items()}
    edit(tensors)
    manifest = (path / "manifest.json").read_bytes() if manifest is None else manifest
    digest = {checkpoint_module.MANIFEST_DIGEST_KEY: hashlib.sha256(manifest).hexdigest()}
    write_safetensors(file, tensors, metadata=digest if seal else None)


def _expect(path, match, **kwargs):
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path, **kwargs)


def test_truncated_file(good, tmp_path):
    path = _copy(good, tmp_path)
    data = path / "model.safetensors"
    data.write_bytes(data.read_bytes()[:-10])
    _expect(path, r"model\.safetensors: truncated.*'w:scale'|truncated")


def test_truncated_header(good, tmp_path):
    path = _copy(good, tmp_path)
    data = path / "model.safetensors"
    data.write_bytes(data.read_bytes()[:20])
    _expect(path, "truncated")


def test_flipped_byte(good, tmp_path):
    path = _copy(good, tmp_path)
    data = path / "model.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01  # the last byte of the last tensor's data
    data.write_bytes(bytes(raw))
    _expect(path, r"tensor '.*' is corrupt \(sha256")


def test_missing_tensor(good, tmp_path):
    path = _copy(good, tmp_path)
    _rewrite_tensors(path, lambda t: t.pop("b"))
    _expect(path, "missing tensor 'b'")


def test_extra_tensor(good, tmp_path):
    path = _copy(good, tmp_path)
    _rewrite_tensors(path, lambda t: t.update(extra=np.zeros(3, np.float32)))
    _expect(path, "extra tensor 'extra'")


def test_other_format_version(good, tmp_path):
    path = _copy(good, tmp_path)
    _edit_manifest(path, lambda m: m.update(format_version=4))
    _expect(path, "format version 4.*reads versions 1, 2, 3")


def test_version_1_loads_with_a_warning(good, tmp_path):
    """Checkpoints written before manifests were sealed (no digest in the tensor header) still
    load, with a warning; a sealed file whose manifest claims version 1 is still checked."""
    path = _copy(good, tmp_path)
    _edit_manifest(path, lambda m: m.update(format_version=1), reseal=False)
    _expect(path, "not the manifest")  # the seal still covers the edited version field
    _rewrite_tensors(path, lambda t: None, manifest=None, seal=False)
    with pytest.warns(UserWarning, match="format version 1.*save the checkpoint again"):
        loaded = load_checkpoint(path)
    reference = load_checkpoint(good[0])
    assert jax.tree.structure(loaded) == jax.tree.structure(reference)


def test_recipe_mismatch_and_match(good, tmp_path):
    _expect(good[0], "recipe mismatch", recipe='{"rules": [2]}')
    loaded = load_checkpoint(good[0], recipe='{ "rules" : [1] }')
    _assert_same(loaded, good[1])


def test_recipe_objects(tmp_path):
    from lowbit.recipes import preset

    int8, int4 = preset("int8_weight_only"), preset("int4_weight_only")
    save_checkpoint(tmp_path / "ck", {"b": jnp.ones(2)}, recipe=int8)
    assert json.loads(read_manifest(tmp_path / "ck")["recipe"]) == json.loads(int8.to_json())
    load_checkpoint(tmp_path / "ck", recipe=preset("int8_weight_only"))
    _expect(tmp_path / "ck", "recipe mismatch", recipe=int4)
    save_checkpoint(tmp_path / "plain", {"b": jnp.ones(2)})
    _expect(tmp_path / "plain", "written with recipe none", recipe=int8)


def test_shape_not_matching_like(good):
    like = {"w": jax.ShapeDtypeStruct((8, 63), jnp.float32), "b": jnp.ones((4,))}
    _expect(good[0], r"leaf 'w' has shape \(8, 64\), but like= expects \(8, 63\)", like=like)
    _expect(good[0], "like= has leaf 'c'", like={**good[1], "c": jnp.ones(1)})
    _expect(good[0], "leaf 'b' is not in like=", like={"w": good[1]["w"]})


def test_unknown_format_name(good, tmp_path):
    path = _copy(good, tmp_path)

    def edit(manifest):
        for _, node in manifest["tree"]["items"]:
            if node["kind"] == "qarray":
                node["format"] = "int42"

    _edit_manifest(path, edit)
    _expect(path, "unknown format 'int42'")


def test_codes_that_do_not_fit_the_shape(good, tmp_path):
    path = _copy(good, tmp_path)

    def edit(manifest):
        for _, node in manifest["tree"]["items"]:
            if node["kind"] == "qarray":
                node["shape"] = [8, 62]

    _edit_manifest(path, edit)
    _expect(path, "qarray 'w'")


def test_manifest_not_json_and_missing(good, tmp_path):
    path = _copy(good, tmp_path)
    (path / "manifest.json").write_text("{not json")
    _expect(path, "not valid JSON")
    _expect(tmp_path / "nowhere", "no checkpoint manifest")


def test_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not a lowbit checkpoint"):
        save_checkpoint(tmp_path / "data", {"b": jnp.ones(2)})
    assert (tmp_path / "data" / "keep.txt").read_text() == "x"


def test_unstorable_leaves_name_their_path(tmp_path):
    with pytest.raises(TypeError, match="'a/b'.*ShapeDtypeStruct"):
        save_checkpoint(tmp_path / "ck", {"a": {"b": jax.ShapeDtypeStruct((2,), jnp.float32)}})
    assert not os.path.exists(tmp_path / "ck")


# --- atomic writes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stage", ["TensorFileWriter.add", "TensorFileWriter.finish", "write_file", "replace_directory"]
)
def test_failed_write_leaves_old_checkpoint(good, tmp_path, monkeypatch, stage):
    path = _copy(good, tmp_path)
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    def crash(*args, **kwargs):
        raise OSError("disk full")

    owner, _, name = stage.rpartition(".")
    # The manifest write and the swap are the publish step, `_checkpoint_dir`'s.
    module = writer_module if owner else dir_module
    monkeypatch.setattr(getattr(module, owner) if owner else module, name, crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, {"other": jnp.zeros(3)})
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["bad"]  # no temporary directory left behind
    _assert_same(load_checkpoint(path), good[1])


def test_overwrite_replaces_whole_checkpoint(good, tmp_path):
    path = _copy(good, tmp_path)
    save_checkpoint(path, {"other": jnp.zeros(3)})
    _assert_same(load_checkpoint(path), {"other": jnp.zeros(3)})
    assert sorted(os.listdir(tmp_path)) == ["bad"]


def test_overwrite_without_atomic_exchange(good, tmp_path, monkeypatch):
    path = _copy(good, tmp_path)
    monkeypatch.setattr(atomic_module, "exchange", lambda a, b: False)
    save_checkpoint(path, {"other": jnp.zeros(3)})
    _assert_same(load_checkpoint(path), {"other": jnp.zeros(3)})
    assert sorted(os.listdir(tmp_path)) == ["bad"]


def test_fallback_swap_restores_old_checkpoint_on_failure(good, tmp_path, monkeypatch):
    path = _copy(good, tmp_path)
    monkeypatch.setattr(atomic_module, "exchange", lambda a, b: False)
    real_rename, calls = os.rename, []

    def flaky_rename(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # moving the new checkpoint into place
            raise OSError("rename failed")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", flaky_rename)
    with pytest.raises(OSError, match="rename failed"):
        save_checkpoint(path, {"other": jnp.zeros(3)})
    monkeypatch.undo()
    _assert_same(load_checkpoint(path), good[1])
    assert sorted(os.listdir(tmp_path)) == ["bad"]


def test_docstring_example_runs():
    result = doctest.testmod(checkpoint_module)
    assert result.attempted >= 5 and result.failed == 0


# --- no pickle, no code ---------------------------------------------------------------------


def test_io_never_imports_pickle_or_runs_code():
    package = pathlib.Path(lowbit.io.__file__).parent
    banned_modules = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
    banned_calls = {"eval", "exec", "compile", "__import__", "import_module"}
    for file in package.glob("*.py"):
        tree = ast.parse(file.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            elif isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                assert name not in banned_calls, f"{file.name} calls {name}"
                assert not any(k.arg == "allow_pickle" for k in node.keywords), file.name
                continue
            else:
                continue
            assert not names & banned_modules, f"{file.name} imports {names & banned_modules}"


def test_flipped_data_bytes_are_refused(good, tmp_path):
    path = _copy(good, tmp_path)
    data = path / "model.safetensors"
    raw = bytes(data.read_bytes())
    header_end = 8 + int.from_bytes(raw[:8], "little")
    for i in range(header_end, len(raw), 3):
        flipped = bytearray(raw)
        flipped[i] ^= 0x10
        data.write_bytes(bytes(flipped))
        with pytest.raises(CheckpointError, match="corrupt"):
            load_checkpoint(path)


# --- sharded loading ------------------------------------------------------------------------


def test_sharded_load_puts_codes_and_scales_on_a_mesh(good):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    seen = []

    def shard(path, role, shape):
        seen.append((path, role, shape))
        return NamedSharding(mesh, PartitionSpec("x") if path == ("w",) else PartitionSpec())

    loaded = load_checkpoint(good[0], sharding=shard)
    assert sorted(seen) == [
        (("b",), "value", (4,)),
        (("w",), "codes", (8, 32)),
        (("w",), "scale", (8, 2)),
    ]
    codes = loaded["w"].codes
    assert codes.sharding.spec == PartitionSpec("x") and len(codes.sharding.device_set) == 4
    _assert_same(loaded, good[1])
    replicated = load_checkpoint(good[0], sharding=NamedSharding(mesh, PartitionSpec()))
    assert len(replicated["b"].sharding.device_set) == 4


def test_kernel_layouts_are_rebuilt_on_load_never_stored(tmp_path):
    from lowbit import kernels
    from lowbit.ops import PreparedQArray, prepare_weight

    w = jax.random.normal(jax.random.key(0), (256, 288))
    q = quantize(w, QuantConfig(format="int4", granularity=PerGroup(32, 0)))
    stored = prepare_weight(q, 0)
    save_checkpoint(tmp_path / "ck", {"dense": {"kernel": stored}})
    manifest = read_manifest(tmp_path / "ck")
    roles = {name.rsplit(":", 1)[-1] for name in manifest["tensors"]}
    assert roles == {"codes", "scale"}
    prepared_here = kernels.available() and jax.default_backend() == "cpu"
    node = manifest["tree"]["items"][0][1]["items"][0][1]
    assert node.get("kernel_axis") == (0 if prepared_here else None)
    plain = load_checkpoint(tmp_path / "ck", kernel_axes=False)["dense"]["kernel"]
    assert isinstance(plain, QArray)
    np.testing.assert_array_equal(np.asarray(plain.codes), np.asarray(q.codes))
    key = (jax.tree_util.DictKey("dense"), jax.tree_util.DictKey("kernel"))
    given = load_checkpoint(tmp_path / "ck", kernel_axes={key: 0})["dense"]["kernel"]
    # By default a weight saved laid out is laid out again, for the axis it was saved for.
    default = load_checkpoint(tmp_path / "ck")["dense"]["kernel"]
    if prepared_here:
        for loaded in (given, default):
            assert isinstance(loaded, PreparedQArray) and loaded.axis == 0
            for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(stored), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            np.testing.assert_array_equal(np.asarray(loaded.logical().codes), np.asarray(q.codes))
    # A logical QArray saved stays logical.
    save_checkpoint(tmp_path / "plain", {"w": q})
    assert isinstance(load_checkpoint(tmp_path / "plain")["w"], QArray)


@pytest.mark.parametrize("axis", [2, -1, True, "0", 0.0])
def test_a_saved_kernel_axis_out_of_range_is_refused(tmp_path, axis):
    q = quantize(jnp.ones((64, 32)), QuantConfig(format="int8", granularity=PerGroup(32, 0)))
    save_checkpoint(tmp_path / "ck", {"w": q})
    manifest = read_manifest(tmp_path / "ck")
    manifest["tree"]["items"][0][1]["kernel_axis"] = axis
    with pytest.raises(CheckpointError, match="kernel_axis"):
        decode_tree(manifest["tree"], manifest["tensors"], "manifest.json")


@pytest.mark.skipif(os.name != "posix", reason="POSIX file modes")
@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_checkpoint_files_follow_the_umask(tmp_path, mask):
    # The temporary directory is created 0700 and the tensor writer makes its file 0600;
    # a published checkpoint gets the modes a plain mkdir / open would give it.
    old = os.umask(mask)
    try:
        save_checkpoint(tmp_path / "ck", {"w": jnp.ones(3)})
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "ck").iterdir()}
    assert (tmp_path / "ck").stat().st_mode & 0o777 == 0o777 & ~mask
    assert modes == {"manifest.json": 0o666 & ~mask, "model.safetensors": 0o666 & ~mask}


def test_a_qarray_with_an_empty_packed_axis_and_codes_is_refused(tmp_path):
    # Found by fuzzing the manifest: a logical size of 0 along the packed axis, with codes
    # stored there, once divided by zero while the QArray was built.
    q = quantize(jnp.ones((64, 32)), QuantConfig(format="int4", granularity=PerGroup(32, 0)))
    save_checkpoint(tmp_path / "ck", {"w": q})
    manifest = read_manifest(tmp_path / "ck")
    node = manifest["tree"]["items"][0][1]
    node["shape"][node["packed_axis"]] = 0
    plan = decode_tree(manifest["tree"], manifest["tensors"], "manifest.json")
    abstract = {n: jax.ShapeDtypeStruct(s, d) for n, (d, s) in plan.tensors.items()}
    with pytest.raises(CheckpointError, match="qarray 'w': codes shape"):
        build_tree(plan, abstract)
