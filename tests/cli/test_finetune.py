"""`lowbit finetune` on a tiny Llama, then `lowbit eval` of its output directory."""

import json

import pytest
from flax import nnx
from tokenizers import Tokenizer, models, pre_tokenizers

from lowbit import serving
from lowbit.cli import main

WORDS = [f"w{i}" for i in range(63)]


@pytest.fixture
def tiny_model(monkeypatch, tmp_path):
    from lowbit.models import Decoder, DecoderConfig

    config = DecoderConfig(
        vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128
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
    # A repeating pattern the adapters can learn.
    text.write_text(" ".join(WORDS[i % 7] for i in range(400)))
    return text


def test_finetune_then_eval(tiny_model, tmp_path, capsys):
    out = tmp_path / "run"
    argv = [
        "finetune",
        "tiny",
        "--recipe",
        "nf4_g64",
        "--lora-rank",
        "4",
        "--text",
        str(tiny_model),
        "--steps",
        "12",
        "--seq-len",
        "16",
        "--batch",
        "2",
        "--lr",
        "1e-2",
        "--out",
        str(out),
    ]
    assert main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "trainable" in printed and "loss.png" in printed
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "adapters" / "manifest.json").is_file()
    summary = json.loads((out / "finetune.json").read_text())
    assert len(summary["losses"]) == 12
    assert summary["losses"][-1] < summary["losses"][0]
    assert 0 < summary["trainable_fraction"] < 0.2
    argv = [
        "eval",
        str(out),
        "--text",
        str(tiny_model),
        "--max-tokens",
        "32",
        "--context",
        "16",
        "--json",
    ]
    assert main(argv) == 0, capsys.readouterr().err
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["recipe"] == "nf4_g64+lora"


def test_a_rule_matching_nothing_is_one_clear_error(tiny_model, tmp_path, capsys):
    argv = [
        "finetune",
        "tiny",
        "--lora-targets",
        "nothing/.*",
        "--text",
        str(tiny_model),
        "--steps",
        "1",
        "--out",
        str(tmp_path / "x"),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("lowbit: error: LoraRule(path='nothing/.*')") and "matches no" in err
