"""`lowbit finetune --qat gguf:MIX` on a tiny Llama, then `lowbit export`: the GGUF file holds
exactly the trained blocks."""

import json
import re

import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer, models, pre_tokenizers

from lowbit import serving
from lowbit.cli import main
from lowbit.eval import QatGGUFSettings
from lowbit.gguf import read_gguf
from lowbit.io import load_checkpoint
from lowbit.models import Decoder, DecoderConfig

WORDS = [f"w{i}" for i in range(63)]


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    # Rows of 64: every type falls back to a 32-block type, as on SmolLM2's 576-wide rows.
    config = DecoderConfig(
        vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128
    )
    tokenizer = Tokenizer(
        models.WordLevel({w: i for i, w in enumerate(["<unk>", *WORDS])}, "<unk>")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    loaded = serving.LoadedModel(
        name="tiny",
        spec="tiny",
        kind="lm",
        model=Decoder(config, rngs=nnx.Rngs(0)),
        tokenizer=tokenizer,
    )
    real = serving.load_model
    monkeypatch.setattr(
        serving, "load_model", lambda spec: loaded if spec == "tiny" else real(spec)
    )
    text = tmp_path / "train.txt"
    text.write_text(" ".join(WORDS[(i * 7 + i // 5) % 63] for i in range(200)))
    return text, loaded


def _argv(text, out, *extra):
    return [
        "finetune",
        "tiny",
        "--qat",
        "gguf:Q2_K",
        "--text",
        str(text),
        "--windows",
        "8",
        "--seq-len",
        "16",
        "--batch",
        "4",
        "--block-steps",
        "8",
        "--e2e-steps",
        "8",
        "--lr",
        "1e-2",
        "--out",
        str(out),
        *extra,
    ]


def test_qat_then_export_writes_the_trained_blocks(tiny, tmp_path, capsys):
    text, loaded = tiny
    out = tmp_path / "run"
    assert main(_argv(text, out)) == 0, capsys.readouterr().err
    summary = json.loads((out / "finetune.json").read_text())
    assert summary["kl_after"] < summary["kl_before"]
    assert f"first {summary['kl_tokens']} calibration tokens" in capsys.readouterr().out
    assert summary["types"]["layers/0/mlp/down_proj/kernel"] == "Q4_0"  # Q3_K falls back
    assert summary["types"]["embed/embedding"] == "Q8_0"  # Q6_K falls back
    params = load_checkpoint(out)
    gguf_path = tmp_path / "m.gguf"
    assert main(["export", str(out), "--gguf", str(gguf_path)]) == 0
    printed = capsys.readouterr().out
    assert "written directly without requantizing" in printed
    written = read_gguf(gguf_path)
    for name, path in [
        ("blk.0.ffn_down.weight", ("layers", 0, "mlp", "down_proj", "kernel")),
        ("blk.0.attn_output.weight", ("layers", 0, "attn", "o_proj", "kernel")),
    ]:
        q = params
        for key in path:
            q = q[str(key)] if str(key) in q else q[key]
        tensor = written.tensors[name]
        assert tensor.type_name == "Q4_0"
        # The file decodes to the trained fake-quantized weight the QAT forward ran.
        np.testing.assert_array_equal(tensor.dequantize(), np.asarray(q.dequantize()).T)
    # The float model was the teacher, not changed.
    assert np.isfinite(np.asarray(nnx.split(loaded.model)[1].to_pure_dict()["norm"]["scale"])).all()


def test_bad_input_is_named_and_nothing_is_written(tiny, tmp_path, capsys):
    text, _ = tiny
    cases = [
        (["--qat", "gguf:Q3_K_XL"], "'Q3_K_XL' is not a llama.cpp mix.*Q3_K_M"),
        (["--qat", "q4_k"], "--qat 'q4_k'.*gguf:TYPE, gguf:MIX or gguf:PLAN.json"),
        (["--windows", "50", "--seq-len", "128"], "has 200 tokens; the calibration needs 6400"),
        # Training that diverges stops with the phase, the layer and the step.
        (["--lr", "1e30", "--e2e-steps", "0"], r"diverged in layers/0 at step \d+: .*layers/0/"),
    ]
    for i, (extra, message) in enumerate(cases):
        out = tmp_path / f"out{i}"
        assert main(_argv(text, out, *extra)) != 0
        assert re.search(message, capsys.readouterr().err), message
        assert not out.exists()


def test_flags_left_out_take_the_qat_settings_defaults(tiny, tmp_path, capsys):
    # --windows, --seq-len and --batch are not LoRA's defaults under --qat (LoRA's batch is 1).
    text, _ = tiny
    defaults = QatGGUFSettings()
    out = tmp_path / "out"
    argv = ["finetune", "tiny", "--qat", "gguf:Q2_K", "--text", str(text), "--out", str(out)]
    assert main(argv) != 0
    need = f"needs {defaults.tokens_needed} ({defaults.windows} windows of {defaults.seq_len}"
    assert need in capsys.readouterr().err and not out.exists()
