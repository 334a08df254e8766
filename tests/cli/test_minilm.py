"""`lowbit quantize` + `eval --json` + `report` + `bench` end to end on all-MiniLM-L6-v2."""

import json
import os
import shutil

import pytest

from lowbit.cli import main

models = pytest.importorskip("lowbit.models")
if not hasattr(models, "load_minilm") or not models.has_minilm():
    pytest.skip("all-MiniLM-L6-v2 is not installed", allow_module_level=True)

SENTENCES = [
    "The cat sat quietly on the warm windowsill.",
    "Stock markets fell sharply after the announcement.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "She finished the marathon in under four hours.",
]


def _last_json(out: str) -> dict:
    lines = out.strip().splitlines()
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("minilm")


@pytest.fixture(scope="module")
def sentences_file(workdir):
    path = workdir / "sentences.txt"
    path.write_text("\n".join(SENTENCES) + "\n")
    return path


@pytest.fixture(scope="module")
def int8_checkpoint(workdir):
    out = workdir / "int8w"
    assert main(["quantize", "minilm", "--recipe", "int8w", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def recipe_file_checkpoint(workdir):
    from lowbit.recipes import preset

    recipe = workdir / "my_int4.json"
    recipe.write_text(preset("int4w_g32_asym").to_json())
    out = workdir / "int4"
    assert main(["quantize", "minilm", "--recipe", str(recipe), "--out", str(out)]) == 0
    return out


def test_quantize_writes_a_checkpoint(int8_checkpoint, capsys):
    assert (int8_checkpoint / "manifest.json").is_file()
    manifest = json.loads((int8_checkpoint / "manifest.json").read_text())
    assert manifest["metadata"] == {"model": "minilm", "recipe": "int8w", "kind": "encoder"}


def test_eval_json_is_the_last_line(int8_checkpoint, sentences_file, capsys):
    capsys.readouterr()
    argv = ["eval", str(int8_checkpoint), "--sentences", str(sentences_file), "--json"]
    assert main(argv) == 0
    result = _last_json(capsys.readouterr().out)
    assert result["model"] == "minilm" and result["recipe"] == "int8w"
    assert result["metric"] == "cosine" and result["sentences"] == len(SENTENCES)
    # int8 per-channel weights: embeddings stay within 1e-3 of the float ones in cosine.
    assert 0.999 <= result["value"] <= 1.0 + 1e-6
    assert result["worst"] <= result["value"]
    # 8-bit linear weights plus float embeddings/norms: between 1/4 and 1/2 of float32.
    assert 0.25 < result["ratio"] < 0.5
    assert (int8_checkpoint / "eval.json").is_file()


def test_eval_with_a_recipe_json_file(recipe_file_checkpoint, sentences_file, capsys):
    capsys.readouterr()
    argv = ["eval", str(recipe_file_checkpoint), "--sentences", str(sentences_file), "--json"]
    assert main(argv) == 0
    result = _last_json(capsys.readouterr().out)
    assert result["recipe"] == "my_int4"
    assert 0.95 <= result["value"] < 1.0
    assert result["ratio"] < 0.25  # 4-bit codes plus group scales and zero points


def test_eval_float_model_with_recipe_in_memory(sentences_file, capsys):
    argv = ["eval", "minilm", "--recipe", "int8", "--sentences", str(sentences_file), "--json"]
    assert main(argv) == 0
    result = _last_json(capsys.readouterr().out)
    assert result["recipe"] == "int8" and result["value"] >= 0.99


def test_eval_rejects_recipe_with_checkpoint_and_text_for_encoder(int8_checkpoint, capsys):
    assert main(["eval", str(int8_checkpoint), "--recipe", "int8w"]) == 2
    assert "drop --recipe" in capsys.readouterr().err
    assert main(["eval", "minilm", "--text", str(int8_checkpoint / "manifest.json")]) == 2
    assert "--text is for language models" in capsys.readouterr().err


def test_report_writes_table_json_and_plots(recipe_file_checkpoint, capsys):
    assert main(["report", str(recipe_file_checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "lowest-SQNR layers" in out and "my_int4" in out
    report = json.loads((recipe_file_checkpoint / "report.json").read_text())
    sqnr = report["layer_sqnr"]["minilm/my_int4"]
    assert len(sqnr["weight"]) >= 36  # 6 layers x 6 linear kernels
    # 4-bit asymmetric groups of 32: about 20-30 dB per weight (6 dB per bit, minus clipping);
    # the recipe keeps embedding tables at int8 per row (higher, but tiny tables vary).
    for name, v in sqnr["weight"].items():
        if v is not None:
            assert (v > 15.0) if "embed" in name else (15.0 < v < 35.0), (name, v)
    for name in ("layer_sqnr.png", "size_vs_quality.png"):
        assert (recipe_file_checkpoint / name).read_bytes()[:4] == b"\x89PNG"


def _planted(checkpoint, tmp_path, names):
    """A copy of `checkpoint` with a link at each of `names` to its own file outside it."""
    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)
    victims = {}
    for name in names:
        victims[name] = tmp_path / f"victim-{name.strip('.')}"
        victims[name].write_bytes(b"keep")
        # The shared checkpoint may already hold the name, written by a test before this one.
        (copy / name).unlink(missing_ok=True)
        os.symlink(victims[name], copy / name)
    return copy, victims


# The names `eval` and `report` wrote through before their writes were made link-proof.
OLD_TEMPORARIES = ["eval.json.tmp", "report.json.tmp", ".layer_sqnr.png.tmp"]
OLD_TEMPORARIES += [".size_vs_quality.png.tmp"]


def test_eval_and_report_never_write_through_planted_links(
    int8_checkpoint, sentences_file, tmp_path, capsys
):
    copy, victims = _planted(int8_checkpoint, tmp_path, OLD_TEMPORARIES)
    assert main(["eval", str(copy), "--sentences", str(sentences_file)]) == 0
    assert main(["report", str(copy)]) == 0
    assert all(v.read_bytes() == b"keep" for v in victims.values())
    for name in ("eval.json", "report.json", "layer_sqnr.png", "size_vs_quality.png"):
        assert (copy / name).is_file() and not (copy / name).is_symlink()


@pytest.mark.parametrize("name", ["eval.json", "report.json", "layer_sqnr.png"])
def test_a_link_at_a_written_name_is_refused_in_one_line(
    int8_checkpoint, sentences_file, tmp_path, capsys, name
):
    copy, victims = _planted(int8_checkpoint, tmp_path, [name])
    command = ["eval", str(copy), "--sentences", str(sentences_file)]
    if name != "eval.json":
        command = ["report", str(copy), "--no-eval"]
    assert main(command) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress lines
    assert err.startswith("lowbit: error: refusing to write") and "symbolic link" in err
    assert name in err and "Remove the link" in err
    assert victims[name].read_bytes() == b"keep"
    assert (copy / name).is_symlink()


def test_bench_json_reports_encoder_throughput(int8_checkpoint, capsys):
    capsys.readouterr()
    assert main(["bench", str(int8_checkpoint), "--json"]) == 0
    result = _last_json(capsys.readouterr().out)
    assert result["recipe"] == "int8w" and result["prefill_tokens_per_s"] > 0
    assert result["decode_tokens_per_s"] is None  # encoders do not decode
    assert result["prefill_tokens"] > 32  # the 32 default sentences, several tokens each
    assert json.loads((int8_checkpoint / "bench.json").read_text())["size_bytes"] > 0
