"""Streaming conversion: bit-identical to import + quantize_params + save_checkpoint, refuses
recipes that cannot stream, and leaves the destination as it was when it fails midway."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from lowbit.api import quantize_params
from lowbit.io import (
    CheckpointWriter,
    Placement,
    SourceParams,
    checkpoint_leaves,
    convert_checkpoint,
    export_gguf,
    import_gguf,
    import_safetensors,
    load_checkpoint,
    save_checkpoint,
)
from lowbit.io import _checkpoint_writer as writer_module
from lowbit.models import DecoderConfig, gguf_param_map
from lowbit.qarray import PerGroup, is_qarray, quantize

CONFIG = DecoderConfig(
    vocab_size=96,
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    ffn_dim=128,
    rope_base=10000.0,
    norm_eps=1e-5,
    tie_embeddings=False,
)
RECIPE = "int4w_g32_asym"


def _hf_map(name: str):
    """Hugging Face Llama names -> Decoder paths (linear weights transposed)."""
    parts = name.split(".")
    if name == "model.embed_tokens.weight":
        return "embed/embedding"
    if name == "model.norm.weight":
        return "norm/scale"
    if name == "lm_head.weight":
        return Placement(path=("lm_head", "kernel"), transpose=True)
    i, module, leaf = int(parts[2]), parts[3], parts[4]
    if module.endswith("layernorm"):
        norm = "attn_norm" if module == "input_layernorm" else "mlp_norm"
        return ("layers", i, norm, "scale")
    block = "attn" if module == "self_attn" else "mlp"
    return Placement(path=("layers", i, block, leaf, "kernel"), transpose=True)


def _hf_tensors(seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    c, hd = CONFIG, CONFIG.head_dim

    def w(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(ml_dtypes.bfloat16)

    out = {"model.embed_tokens.weight": w(c.vocab_size, c.dim)}
    for i in range(c.n_layers):
        p = f"model.layers.{i}"
        out |= {
            f"{p}.input_layernorm.weight": np.ones(c.dim, ml_dtypes.bfloat16),
            f"{p}.self_attn.q_proj.weight": w(c.n_heads * hd, c.dim),
            f"{p}.self_attn.k_proj.weight": w(c.n_kv_heads * hd, c.dim),
            f"{p}.self_attn.v_proj.weight": w(c.n_kv_heads * hd, c.dim),
            f"{p}.self_attn.o_proj.weight": w(c.dim, c.n_heads * hd),
            f"{p}.post_attention_layernorm.weight": np.ones(c.dim, ml_dtypes.bfloat16),
            f"{p}.mlp.gate_proj.weight": w(c.ffn_dim, c.dim),
            f"{p}.mlp.up_proj.weight": w(c.ffn_dim, c.dim),
            f"{p}.mlp.down_proj.weight": w(c.dim, c.ffn_dim),
        }
    out |= {"model.norm.weight": np.ones(c.dim, ml_dtypes.bfloat16), "lm_head.weight": w(96, 64)}
    return out


@pytest.fixture
def hf_shards(tmp_path):
    """A two-shard Hugging Face checkpoint with its index."""
    tensors = _hf_tensors()
    names = sorted(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    directory = tmp_path / "hf"
    directory.mkdir()
    for file, members in shards.items():
        safetensors.numpy.save_file({n: tensors[n] for n in members}, directory / file)
    weight_map = {n: f for f, members in shards.items() for n in members}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory, list(shards)


def _merge(a, b):
    for key, value in b.items():
        a[key] = _merge(a[key], value) if key in a else value
    return a


def _files(path):
    return {name: (path / name).read_bytes() for name in sorted(os.listdir(path))}


def test_hf_shards_convert_bit_identical(hf_shards, tmp_path):
    directory, shards = hf_shards
    params = {}
    for file in shards:
        params = _merge(params, import_safetensors(directory / file, _hf_map))
    meta = {"model": "tiny"}
    save_checkpoint(
        tmp_path / "ref", quantize_params(params, RECIPE), recipe=_preset(), metadata=meta
    )
    report = convert_checkpoint(
        directory, tmp_path / "out", RECIPE, name_map=_hf_map, metadata=meta
    )
    assert _files(tmp_path / "out") == _files(tmp_path / "ref")
    assert report.tensors == 3 + 9 * CONFIG.n_layers and report.quantized == 2 + 7 * 2
    loaded = load_checkpoint(tmp_path / "out", recipe=_preset())
    assert is_qarray(loaded["layers"][1]["mlp"]["down_proj"]["kernel"])


def _preset():
    from lowbit.recipes import preset

    return preset(RECIPE)


@pytest.fixture
def gguf_file(tmp_path):
    """A tiny Llama GGUF: attention weights Q8_0 (kept as blocks), the rest F32."""
    rng = np.random.default_rng(1)
    config = CONFIG

    def w(*shape):
        return jnp.asarray((rng.standard_normal(shape) * 0.05).astype(np.float32))

    tensors = {}
    for name, where in gguf_param_map(config).items():
        shape = _hf_shape(name)
        value = w(*shape) if len(shape) == 2 else jnp.ones(shape)
        if "attn_" in name and len(shape) == 2:
            value = quantize(
                value, "int8", granularity=PerGroup(32, axis=0), scale_dtype=jnp.float16
            )
        tensors[where.path] = value
    params = {}
    for path, value in tensors.items():
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    path = tmp_path / "m.gguf"
    export_gguf(params, path, config=config, log=None)
    return path


def _hf_shape(name):
    c = CONFIG
    if name == "token_embd.weight":
        return (c.vocab_size, c.dim)
    if name == "output.weight":
        return (c.dim, c.vocab_size)
    if name.endswith("norm.weight"):
        return (c.dim,)
    kind = name.split(".")[2]
    return {
        "attn_q": (c.dim, c.n_heads * c.head_dim),
        "attn_k": (c.dim, c.n_kv_heads * c.head_dim),
        "attn_v": (c.dim, c.n_kv_heads * c.head_dim),
        "attn_output": (c.n_heads * c.head_dim, c.dim),
        "ffn_gate": (c.dim, c.ffn_dim),
        "ffn_up": (c.dim, c.ffn_dim),
        "ffn_down": (c.ffn_dim, c.dim),
    }[kind]


@pytest.mark.parametrize("recipe", [RECIPE, None])
def test_gguf_convert_bit_identical(gguf_file, tmp_path, recipe):
    mapping = gguf_param_map(CONFIG)
    params, _ = import_gguf(gguf_file, name_map=mapping.get)
    if recipe is None:  # kept as stored: the tree in pytree order
        reference = jax.tree.map(lambda x: x, params, is_leaf=is_qarray)
    else:
        reference = quantize_params(params, recipe)
    save_checkpoint(tmp_path / "ref", reference, recipe=None if recipe is None else _preset())
    report = convert_checkpoint(gguf_file, tmp_path / "out", recipe, name_map=mapping)
    assert _files(tmp_path / "out") == _files(tmp_path / "ref")
    assert report.kept == 4 * CONFIG.n_layers
    loaded = load_checkpoint(tmp_path / "out")
    assert loaded["layers"][0]["attn"]["q_proj"]["kernel"].format == "int8"


def test_recipes_that_cannot_stream_are_refused_naming_the_rule(hf_shards, tmp_path):
    directory, _ = hf_shards
    with pytest.raises(ValueError, match=r"rule 1 \(path=.*gptq.*one tensor at a time"):
        convert_checkpoint(directory, tmp_path / "out", "int4w_g64_gptq", name_map=_hf_map)
    assert not os.path.exists(tmp_path / "out")
    assert os.listdir(tmp_path) == ["hf"]


def test_failure_midway_leaves_the_old_checkpoint(hf_shards, tmp_path, monkeypatch):
    directory, _ = hf_shards
    old = {"kept": jnp.arange(3.0)}
    save_checkpoint(tmp_path / "out", old)
    before = _files(tmp_path / "out")
    real_add, calls = writer_module.TensorFileWriter.add, []

    def add_then_fail(self, name, array):
        calls.append(name)
        if len(calls) == 5:
            raise OSError("disk full")
        return real_add(self, name, array)

    monkeypatch.setattr(writer_module.TensorFileWriter, "add", add_then_fail)
    with pytest.raises(OSError, match="disk full"):
        convert_checkpoint(directory, tmp_path / "out", RECIPE, name_map=_hf_map)
    assert _files(tmp_path / "out") == before
    assert sorted(os.listdir(tmp_path)) == ["hf", "out"]  # no temporary left behind
    with pytest.raises(OSError, match="disk full"):
        calls.clear()
        convert_checkpoint(directory, tmp_path / "new", RECIPE, name_map=_hf_map)
    assert not os.path.exists(tmp_path / "new")


def test_writer_leaf_by_leaf_equals_save_checkpoint(tmp_path):
    tree = {
        "b": {"kernel": quantize(jnp.ones((64, 8)), "int4", granularity=PerGroup(32, axis=0))},
        "a": [jnp.arange(4, dtype=jnp.int32), None, 1.5],
        "c": np.ones(3, ml_dtypes.bfloat16),
    }
    save_checkpoint(tmp_path / "whole", tree, metadata={"x": 1})
    with CheckpointWriter(tmp_path / "leaves", metadata={"x": 1}) as writer:
        writer.add(("b", "kernel"), tree["b"]["kernel"])
        writer.add("a", tree["a"])
        writer.add("c", tree["c"])
        with pytest.raises(ValueError, match="added already"):
            writer.add("c", tree["c"])
        with pytest.raises(ValueError, match="passes through the leaf 'c'"):
            writer.add("c/d", tree["c"])
    assert _files(tmp_path / "leaves") == _files(tmp_path / "whole")
    # Another reader of safetensors files reads the same tensors.
    stored = safetensors.numpy.load_file(tmp_path / "whole" / "model.safetensors")
    assert np.array_equal(stored["a/0"], np.arange(4, dtype=np.int32))


def test_gguf_export_streams_from_a_source_or_a_checkpoint(hf_shards, tmp_path):
    directory, shards = hf_shards
    params = {}
    for file in shards:
        params = _merge(params, import_safetensors(directory / file, _hf_map))
    export_gguf(params, tmp_path / "tree.gguf", config=CONFIG, type="Q4_0", log=None)
    with SourceParams(directory, _hf_map) as lazy:
        export_gguf(lazy, tmp_path / "lazy.gguf", config=CONFIG, type="Q4_0", log=None)
    assert (tmp_path / "lazy.gguf").read_bytes() == (tmp_path / "tree.gguf").read_bytes()
    convert_checkpoint(directory, tmp_path / "ck", RECIPE, name_map=_hf_map)
    loaded = export_gguf(load_checkpoint(tmp_path / "ck"), tmp_path / "a.gguf", config=CONFIG)
    with checkpoint_leaves(tmp_path / "ck") as leaves:
        streamed = export_gguf(leaves, tmp_path / "b.gguf", config=CONFIG)
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()
    assert streamed.tensors == loaded.tensors
    assert {n.how for n in streamed.tensors} == {"direct", "requantized", "float"}


def test_sources_refuse_paths_that_collide(hf_shards, tmp_path):
    directory, _ = hf_shards

    def nested(name):
        return "embed" if name == "model.norm.weight" else _hf_map(name)

    with pytest.raises(ValueError, match="'embed' of 'model.norm.weight'.*nest into each other"):
        SourceParams(directory, nested)
    with pytest.raises(ValueError, match="holds neither"):
        SourceParams(tmp_path, _hf_map)
