"""GGUF export: direct and requantized tensors, RoPE rows, metadata, fallbacks, atomic writes,
and the import of every block type; SmolLM2 byte for byte and llama.cpp (optional)."""

import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowbit.gguf import decode as gguf_decode
from lowbit.gguf import encode as gguf_encode
from lowbit.gguf import read_gguf
from lowbit.io import export_gguf, import_gguf
from lowbit.io._gguf_export import _permute_rope_rows
from lowbit.models import DecoderConfig, gguf_param_map, unpermute_rope_rows
from lowbit.qarray import PerGroup, QArray, quantize

CONFIG = DecoderConfig(
    vocab_size=64,
    dim=256,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=64,
    ffn_dim=512,
    rope_base=10000.0,
    norm_eps=1e-5,
    tie_embeddings=True,
)
MAPPING = gguf_param_map(CONFIG)


def _params(config=CONFIG, seed=0):
    """Float params of a tiny Llama, keyed like the NNX module's pure dict."""
    rng = np.random.default_rng(seed)
    d, f, hd = config.dim, config.ffn_dim, config.head_dim

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * 0.05)

    layers = {
        i: {
            "attn_norm": {"scale": jnp.ones((d,))},
            "attn": {
                "q_proj": {"kernel": w(d, config.n_heads * hd)},
                "k_proj": {"kernel": w(d, config.n_kv_heads * hd)},
                "v_proj": {"kernel": w(d, config.n_kv_heads * hd)},
                "o_proj": {"kernel": w(config.n_heads * hd, d)},
            },
            "mlp_norm": {"scale": jnp.ones((d,))},
            "mlp": {
                "gate_proj": {"kernel": w(d, f)},
                "up_proj": {"kernel": w(d, f)},
                "down_proj": {"kernel": w(f, d)},
            },
        }
        for i in range(config.n_layers)
    }
    return {
        "embed": {"embedding": w(config.vocab_size, d)},
        "norm": {"scale": jnp.ones((d,))},
        "layers": layers,
    }


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _as_float(x):
    return np.asarray(x.dequantize() if isinstance(x, QArray) else x, np.float32)


def test_rope_permutation_inverts_import():
    w = np.arange(24 * 3).reshape(24, 3)
    np.testing.assert_array_equal(unpermute_rope_rows(_permute_rope_rows(w, 3), 3), w)


def test_requantized_export_reads_back_through_import(tmp_path, capsys):
    params = _params()
    path = tmp_path / "m.gguf"
    report = export_gguf(params, path, config=CONFIG, type="Q4_K_M")
    assert report.nbytes == os.path.getsize(path) and os.listdir(tmp_path) == ["m.gguf"]
    reader = gguf.GGUFReader(path)  # validates
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    # llama.cpp's Q4_K_M choices: Q6_K for the tied embedding and the "more bits" layers.
    assert types["token_embd.weight"] == "Q6_K"
    assert types["blk.0.attn_q.weight"] == "Q4_K" and types["blk.0.attn_v.weight"] == "Q4_K"
    assert types["blk.1.attn_v.weight"] == "Q6_K" and types["blk.1.ffn_down.weight"] == "Q6_K"
    assert types["blk.0.ffn_norm.weight"] == "F32"
    assert capsys.readouterr().out == ""  # float weights, whole blocks: nothing to note
    back, metadata = import_gguf(path, name_map=MAPPING.get)
    assert metadata["llama.block_count"] == 2 and metadata["general.architecture"] == "llama"
    checked = (
        "token_embd.weight",
        "blk.1.attn_q.weight",
        "blk.1.attn_k.weight",
        "blk.1.ffn_down.weight",
        "blk.1.ffn_norm.weight",
    )
    for name in checked:
        where = MAPPING[name]
        original = np.asarray(_get(params, where.path), np.float32)
        got = _get(back, where.path)
        if original.ndim == 1:
            np.testing.assert_array_equal(np.asarray(got), original)
            continue
        assert got.format == types[name].lower()
        # What the exported blocks hold is exactly the encoder's output for the GGUF layout.
        gguf_layout = original.T if where.transpose else original
        expected = gguf_decode(types[name], gguf_encode(types[name], gguf_layout))
        expected = expected.T if where.transpose else expected
        # (q / k rows were re-interleaved on export and are undone on import: same values.)
        np.testing.assert_array_equal(_as_float(got), expected)
        assert np.abs(_as_float(got) - original).max() < 0.1 * np.abs(original).max()


def test_direct_export_keeps_codes(tmp_path):
    params = _params()
    # int8 in groups of 32 along the input axis with float16 scales: exactly Q8_0.
    quantized = jax.tree.map(
        lambda x: (
            quantize(x, "int8", granularity=PerGroup(32, axis=0), scale_dtype=jnp.float16)
            if x.ndim == 2 and x.shape[0] != CONFIG.vocab_size
            else x
        ),
        params,
    )
    report = export_gguf(quantized, tmp_path / "m.gguf", config=CONFIG, log=None)
    how = {n.name: (n.how, n.ggml_type) for n in report.tensors}
    assert how["blk.1.attn_k.weight"] == ("direct", "Q8_0")
    assert how["token_embd.weight"] == ("float", "F32")
    back, _ = import_gguf(tmp_path / "m.gguf", name_map=MAPPING.get)
    for name in ("blk.1.attn_q.weight", "blk.1.attn_k.weight", "blk.0.ffn_down.weight"):
        where = MAPPING[name]
        np.testing.assert_array_equal(
            _as_float(_get(back, where.path)), _as_float(_get(quantized, where.path))
        )


def test_kernel_laid_out_weights_export_as_their_logical_form(tmp_path):
    """`lowbit.quantize` lays weights out for the CPU kernels; export writes the same file."""
    import lowbit

    params = _params()
    prepared = lowbit.quantize(params, "int8w")
    logical = lowbit.quantize(params, "int8w", kernel_layouts=False)
    assert any(isinstance(x, lowbit.ops.PreparedQArray) for x in _leaves(prepared))
    export_gguf(prepared, tmp_path / "a.gguf", config=CONFIG, log=None)
    export_gguf(logical, tmp_path / "b.gguf", config=CONFIG, log=None)
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()


def _leaves(tree):
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, QArray) or hasattr(x, "logical"))


def test_k_quant_qarrays_export_directly_and_import_as_stored(tmp_path):
    params = _params()
    quantized = jax.tree.map(
        lambda x: quantize(x, "q6_k") if x.ndim == 2 and x.shape[0] == 256 else x, params
    )
    report = export_gguf(quantized, tmp_path / "m.gguf", config=CONFIG, type="Q8_0", log=None)
    how = {n.name: (n.how, n.ggml_type) for n in report.tensors}
    assert how["blk.0.attn_q.weight"] == ("direct", "Q6_K")
    assert how["blk.0.ffn_down.weight"] == ("quantized", "Q8_0")  # float [512, 256]
    back, _ = import_gguf(tmp_path / "m.gguf", name_map=MAPPING.get)
    q = _get(back, ("layers", 0, "attn", "q_proj", "kernel"))
    original = _get(quantized, ("layers", 0, "attn", "q_proj", "kernel"))
    assert q.format == "q6_k" and q.nbytes == original.nbytes
    np.testing.assert_array_equal(_as_float(q), _as_float(original))


def test_rows_that_are_not_whole_blocks_fall_back_or_fail(tmp_path):
    config = DecoderConfig(
        vocab_size=64,
        dim=96,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        head_dim=48,
        ffn_dim=256,
        rope_base=10000.0,
        norm_eps=1e-5,
        tie_embeddings=True,
    )
    lines = []
    report = export_gguf(
        _params(config), tmp_path / "m.gguf", config=config, type="Q4_K", log=lines.append
    )
    types = {n.name: n.ggml_type for n in report.tensors}
    assert types["blk.0.attn_q.weight"] == "Q5_0"  # 96 is not whole 256 blocks
    assert types["blk.0.ffn_down.weight"] == "Q4_K"  # rows of 256
    assert any("blk.0.attn_q.weight" in line and "Q5_0" in line for line in lines)
    with pytest.raises(
        ValueError, match="rows of 96 elements are not a multiple of the Q4_K block size 256"
    ):
        export_gguf(_params(config), tmp_path / "s.gguf", config=config, type="Q4_K", strict=True)
    assert not (tmp_path / "s.gguf").exists()


def test_bad_type_and_unwritable_place(tmp_path):
    with pytest.raises(ValueError, match="'Q7_K' is not supported; accepted: F32"):
        export_gguf(_params(), tmp_path / "m.gguf", config=CONFIG, type="Q7_K")
    with pytest.raises(OSError, match="does not exist"):
        export_gguf(_params(), tmp_path / "nope" / "m.gguf", config=CONFIG, log=None)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user who can write anywhere")
        with pytest.raises(OSError):
            export_gguf(_params(), locked / "m.gguf", config=CONFIG, log=None)
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    from lowbit.gguf import _writer

    def broken(*args, **kwargs):
        raise ValueError("written GGUF file does not read back")

    monkeypatch.setattr(_writer, "_validate", broken)
    (tmp_path / "m.gguf").write_bytes(b"old")
    with pytest.raises(ValueError, match="does not read back"):
        export_gguf(_params(), tmp_path / "m.gguf", config=CONFIG, log=None)
    assert (tmp_path / "m.gguf").read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_export_never_writes_through_a_planted_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    (tmp_path / "out").mkdir()
    os.symlink(victim, tmp_path / "out" / "m.gguf")
    with pytest.raises(ValueError, match="m.gguf'.*symbolic link.*Remove the link"):
        export_gguf(_params(), tmp_path / "out" / "m.gguf", config=CONFIG, log=None)
    assert victim.read_bytes() == b"keep"
    assert os.listdir(tmp_path / "out") == ["m.gguf"]  # the link, and no temporary


@pytest.mark.parametrize(
    "ggml_type",
    ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "Q5_0", "Q5_1", "IQ4_NL", "TQ1_0", "TQ2_0"],
)
def test_import_every_block_type_decodes_like_gguf(tmp_path, ggml_type):
    x = np.random.default_rng(2).standard_normal((4, 512)).astype(np.float32)
    raw = gguf_encode(ggml_type, x)
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("w", raw, raw_dtype=gguf.GGMLQuantizationType[ggml_type])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    params, _ = import_gguf(path)
    q = params["w"]
    assert q.format == ggml_type.lower() and q.nbytes == raw.nbytes  # exactly the GGUF bytes
    if ggml_type != "Q8_K":  # gguf has no Q8_K decoder
        ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[ggml_type])
        np.testing.assert_array_equal(np.asarray(q.dequantize()), ref)
    floats, _ = import_gguf(path, quantized=False)
    np.testing.assert_array_equal(np.asarray(floats["w"]), np.asarray(q.dequantize()))


@pytest.fixture(scope="module")
def smollm2_export(tmp_path_factory):
    from lowbit.models import decoder_config_from_gguf, has_smollm2, smollm2_gguf_path

    if not has_smollm2():
        pytest.skip("SmolLM2 GGUF asset not installed")
    source = str(smollm2_gguf_path())
    config = decoder_config_from_gguf(read_gguf(source))
    mapping = gguf_param_map(config)
    params, _ = import_gguf(source, name_map=mapping.get)
    out = tmp_path_factory.mktemp("smol") / "smollm2.gguf"
    report = export_gguf(params, out, config=config, source=source, log=None)
    return source, out, report


def test_smollm2_q8_0_q4_1_export_reproduces_the_file_tensors(smollm2_export):
    source, out, report = smollm2_export
    assert all(n.how in ("direct", "float") for n in report.tensors)
    a, b = read_gguf(source), read_gguf(out)
    assert sorted(a.tensors) == sorted(b.tensors)
    for name, t in a.tensors.items():
        assert b.tensors[name].ggml_type == t.ggml_type, name
        assert np.array_equal(b.tensors[name].raw, t.raw), name
    for key in ("tokenizer.ggml.tokens", "tokenizer.chat_template", "llama.rope.freq_base"):
        assert b.metadata[key] == a.metadata[key]


def test_smollm2_export_runs_in_llama_cpp(smollm2_export):
    llama_cpp = pytest.importorskip("llama_cpp")
    _, out, _ = smollm2_export
    # One token per decode call (some native builds crash on multi-token CPU batches).
    llm = llama_cpp.Llama(
        model_path=str(out), n_ctx=64, n_batch=1, n_ubatch=1, logits_all=True, verbose=False
    )
    tokens = llm.tokenize(b"The State of the Union is")
    llm.eval(tokens)
    assert np.isfinite(np.asarray(llm.scores[: len(tokens)])).all()
    llm.close()


def test_rotated_model_exports_its_untied_head(tmp_path):
    # The residual rotation folds the final norm into the head: a tied model comes back
    # untied, and the export writes output.weight; the file computes the float model's logits.
    import dataclasses

    from lowbit.models import decoder_from_params, rotate_decoder
    from lowbit.recipes import RotationConfig

    config = dataclasses.replace(CONFIG, n_layers=1)
    params = _params(config)
    params["norm"]["scale"] = jnp.linspace(0.5, 1.5, config.dim)
    new_config, new_params, _ = rotate_decoder(config, params, RotationConfig(online=()))
    path = tmp_path / "rot.gguf"
    export_gguf(new_params, path, config=new_config, type="F32", log=None)
    assert "output.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    back, _ = import_gguf(path, name_map=gguf_param_map(new_config).get)
    tokens = jnp.array([[1, 5, 9, 3]])
    got = decoder_from_params(new_config, back)(tokens)
    reference = decoder_from_params(config, params)(tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(reference), atol=1e-4)
