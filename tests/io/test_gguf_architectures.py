"""GGUF files of every decoder architecture: export -> read gives the same model, quantized
import keeps blocks (stacked experts too), and bad files are refused naming file and field."""

from __future__ import annotations

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lowbit
from lowbit.gguf import read_gguf
from lowbit.io import export_gguf, import_gguf
from lowbit.models import (
    ARCHITECTURES,
    Decoder,
    DecoderConfig,
    assign_params,
    decoder_config_from_gguf,
    gguf_metadata,
    gguf_param_map,
    load_decoder_gguf,
)
from lowbit.qarray import is_qarray

BASE = dict(
    vocab_size=64,
    dim=32,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    ffn_dim=64,
    norm_eps=2.0**-20,  # exact in float32, so configs compare equal after a round trip
)
CONFIGS = {
    "llama": dict(architecture="llama", tie_embeddings=False),
    "llama3": dict(architecture="llama", rope_freq_factors=(1.0, 2.0, 4.0, 8.0)),
    "mixtral": dict(architecture="llama", n_experts=4, n_experts_used=2, expert_ffn_dim=32),
    "qwen2": dict(architecture="qwen2", qkv_bias=True),
    "qwen3": dict(architecture="qwen3", qk_norm=True),
    "gemma": dict(architecture="gemma", activation="gelu_tanh", embed_scale=True),
    "gemma2": dict(
        architecture="gemma2",
        activation="gelu_tanh",
        embed_scale=True,
        post_norms=True,
        attn_softcap=50.0,
        final_softcap=30.0,
        sliding_window=4,
        global_every=2,
    ),
    "gemma3": dict(
        architecture="gemma3",
        activation="gelu_tanh",
        embed_scale=True,
        post_norms=True,
        qk_norm=True,
        sliding_window=4,
        global_every=6,
        rope_base_local=10000.0,
        rope_scale=8.0,
    ),
    "phi3": dict(architecture="phi3", fused_qkv=True, fused_gate_up=True),
    "qwen2moe": dict(
        architecture="qwen2moe",
        qkv_bias=True,
        n_experts=4,
        n_experts_used=2,
        expert_ffn_dim=32,
        shared_ffn_dim=32,
        norm_topk=False,
    ),
    "qwen3moe": dict(
        architecture="qwen3moe", qk_norm=True, n_experts=4, n_experts_used=2, expert_ffn_dim=32
    ),
}
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)), jnp.int32)


def _model(name: str) -> tuple[DecoderConfig, Decoder, dict]:
    config = DecoderConfig(**BASE, **CONFIGS[name])
    model = Decoder(config, rngs=nnx.Rngs(0))
    return config, model, nnx.to_pure_dict(nnx.split(model)[1])


def test_every_gguf_architecture_has_a_config_here():
    assert {c["architecture"] for c in CONFIGS.values()} == set(ARCHITECTURES)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_export_then_load_gives_the_same_model(name, tmp_path):
    config, model, params = _model(name)
    path = tmp_path / f"{name}.gguf"
    export_gguf(params, path, config=config, log=None)
    gguf_file = read_gguf(path)
    assert gguf_file.architecture == config.architecture
    assert decoder_config_from_gguf(gguf_file) == config
    mapping = gguf_param_map(config)
    assert set(mapping) == set(gguf_file.tensors) - {"rope_freqs.weight"}
    arrays = {name: tensor.dequantize() for name, tensor in gguf_file.tensors.items()}
    again = assign_params(Decoder.abstract(config), arrays, mapping, jnp.float32)
    np.testing.assert_array_equal(again(TOKENS), model(TOKENS))


@pytest.mark.parametrize("name", ["mixtral", "qwen2moe", "phi3"])
def test_quantized_export_imports_as_blocks_and_runs(name, tmp_path):
    # Q8_0 everywhere: the import keeps every block (stacked [E, out, in] experts become
    # [E, in, out] QArrays), routers stay float, and the engine runs it with no fallback.
    config, model, params = _model(name)
    path = tmp_path / f"{name}.gguf"
    export_gguf(params, path, config=config, type="Q8_0", log=None)
    qparams, _ = import_gguf(path, name_map=gguf_param_map(config).get)
    layer = qparams["layers"][0]
    if config.n_experts:
        kernel = layer["moe"]["down_proj"]["kernel"]
        assert is_qarray(kernel) and kernel.shape == (4, 32, 32) and kernel.format == "int8"
        assert not is_qarray(layer["moe"]["router"])
    graphdef = nnx.graphdef(model)
    fn = lambda p, t: nnx.merge(graphdef, p)(t)
    report = lowbit.EngineReport()
    out = jax.jit(lowbit.run(fn, report=report, strict=True))(qparams, TOKENS)
    dequantized = jax.tree.map(
        lambda v: v.dequantize(jnp.float32) if is_qarray(v) else v, qparams, is_leaf=is_qarray
    )
    np.testing.assert_allclose(out, fn(dequantized, TOKENS), atol=1e-4)
    for (where, got), want in zip(
        jax.tree_util.tree_leaves_with_path(dequantized),
        jax.tree_util.tree_leaves(params),
        strict=True,
    ):
        bound = 1e-6 + np.abs(want).max() / 127  # Q8_0's rounding, or exact for floats
        assert np.abs(np.asarray(got) - want).max() <= bound, where
    # Exporting the imported blocks writes them back unchanged.
    again = tmp_path / "again.gguf"
    export_gguf(qparams, again, config=config, log=None)
    first, second = read_gguf(path), read_gguf(again)
    for tensor_name, tensor in first.tensors.items():
        np.testing.assert_array_equal(second.tensors[tensor_name].raw, tensor.raw)


def test_gguf_metadata_refuses_what_the_architecture_cannot_express():
    with pytest.raises(ValueError, match="DecoderConfig.qk_norm=True cannot be written"):
        gguf_metadata(DecoderConfig(**BASE, qk_norm=True))
    with pytest.raises(ValueError, match="DecoderConfig.architecture is 'bert'"):
        gguf_metadata(DecoderConfig(**BASE, architecture="bert"))


def _rewrite(src, dst, *, arch=None, metadata=None, drop=(), tensors=None):
    """A copy of GGUF file `src` with metadata values replaced / removed and tensors replaced."""
    reader = gguf.GGUFReader(src)
    arch = arch or str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name in drop:
            continue
        value = (metadata or {}).get(field.name, field.contents())
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    tensors = dict(tensors or {})
    for t in reader.tensors:
        data = tensors.pop(t.name, np.asarray(t.data))
        if data is not None:
            writer.add_tensor(t.name, np.ascontiguousarray(data))
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="module")
def qwen2_file(tmp_path_factory):
    config, _, params = _model("qwen2")
    path = tmp_path_factory.mktemp("gguf") / "qwen2.gguf"
    export_gguf(params, path, config=config, log=None)
    return path


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(arch="falcon"), r"general.architecture 'falcon'; supported: llama, qwen2"),
        (dict(drop=("qwen2.block_count",)), r"no metadata key 'qwen2.block_count'"),
        (dict(metadata={"qwen2.attention.head_count": 3}), "n_heads=3 is not a multiple"),
        (
            dict(tensors={"blk.1.attn_q.weight": np.zeros((32, 16), np.float32)}),
            r"tensor 'blk.1.attn_q.weight' has shape \(16, 32\)",
        ),
        (
            dict(tensors={"blk.0.ffn_gate_exps.weight": np.zeros((2, 2), np.float32)}),
            r"has tensor 'blk.0.ffn_gate_exps.weight', which this architecture does not use",
        ),
        (dict(tensors={"blk.2.attn_v.bias": None}), r"no tensor named 'blk.2.attn_v.bias'"),
        (
            dict(metadata={"qwen2.block_count": 10**9}),
            r"'qwen2.block_count' declares 1000000000 layers, but the file holds tensors for 3",
        ),
        (
            dict(metadata={"qwen2.embedding_length": 10**9}),
            r"'token_embd.weight' has shape \(64, 32\), but the metadata "
            r"\(qwen2.embedding_length\) declares \(64, 1000000000\)",
        ),
        (
            dict(metadata={"qwen2.feed_forward_length": 10**9}),
            r"'blk.0.ffn_up.weight' has shape .*qwen2.feed_forward_length",
        ),
        (
            dict(metadata={"qwen2.attention.key_length": 10**6}),
            r"'blk.0.attn_q.weight' has shape .*key_length\) declares \(4000000, 32\)",
        ),
    ],
)
def test_bad_files_are_refused_naming_the_file_and_field(qwen2_file, tmp_path, change, message):
    bad = _rewrite(qwen2_file, tmp_path / "bad.gguf", **change)
    with pytest.raises(ValueError, match=message) as err:
        load_decoder_gguf(bad)
    assert "bad.gguf" in str(err.value)


@pytest.mark.parametrize("key", ["block_count", "embedding_length", "feed_forward_length"])
def test_declared_sizes_are_checked_before_a_model_is_built_on_shapes(qwen2_file, tmp_path, key):
    # Serving a file's own blocks builds the model from metadata alone (no weights to check).
    bad = _rewrite(qwen2_file, tmp_path / "bad.gguf", metadata={f"qwen2.{key}": 10**9})
    with pytest.raises(ValueError, match=rf"bad.gguf.*qwen2.{key}"):
        load_decoder_gguf(bad, weights=False)


def test_a_file_without_a_tokenizer_is_named(qwen2_file):
    with pytest.raises(ValueError, match=r"qwen2.gguf.*tokenizer.ggml.model"):
        load_decoder_gguf(qwen2_file)


def test_a_config_round_trips_through_metadata_alone():
    for name, fields in CONFIGS.items():
        config = DecoderConfig(**BASE, **fields)
        md = gguf_metadata(config)
        assert md["general.architecture"] == config.architecture, name
        assert dataclasses.replace(config) == config


@pytest.mark.parametrize("arch", ["llama3", "gemma3", "phi3", "qwen2moe", "qwen3moe"])
def test_llama_cpp_runs_the_exported_file(arch, tmp_path):
    # A tiny reference file read by lowbit and written back by `export_gguf` (with the source's
    # tokenizer): llama.cpp gives its stored last-token logits again. Only with
    # llama-cpp-python (the benchmark environment).
    llama_cpp = pytest.importorskip("llama_cpp")
    import sys
    from pathlib import Path

    models_tests = Path(__file__).resolve().parents[1] / "models"
    sys.path.insert(0, str(models_tests))
    from tiny_gguf import write_tiny_gguf

    refs = np.load(models_tests / "references" / "decoders.npz")
    source = write_tiny_gguf(arch, tmp_path / "source.gguf")
    model, _ = load_decoder_gguf(source)
    out = tmp_path / "exported.gguf"
    params = nnx.to_pure_dict(nnx.split(model)[1])
    export_gguf(params, out, config=model.config, source=source, log=None)
    llm = llama_cpp.Llama(
        model_path=str(out), n_ctx=128, n_threads=2, logits_all=True, verbose=False
    )
    prompt = refs[f"{arch}/prompt"].tolist()
    llm.eval(prompt)
    got, want = np.asarray(llm.scores[len(prompt) - 1]), refs[f"{arch}/logits"]
    assert got @ want / np.linalg.norm(got) / np.linalg.norm(want) >= 0.9999
