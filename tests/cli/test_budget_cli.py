"""`lowbit quantize MODEL --bits B`: a plan under a size budget, written as a GGUF file with the
chosen types, reused by `--recipe plan.json`, and refused for another model."""

import json
import sys
from pathlib import Path

import gguf
import pytest
from flax import nnx

from lowbit.cli._main import main


def _error(capsys) -> str:
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--recipe", "int8w", "--bits", "4"], "not both"),
        ([], "give --recipe"),
        (["--recipe", "int8w", "--plan-out", "p.json"], "--plan-out goes with a budget"),
        (["--recipe", "int8w", "--sensitivity", "output"], "--sensitivity goes with a budget"),
        (["--recipe", "int8w", "--max-ms-per-token", "5"], "--max-ms-per-token goes with a"),
        (["--bits", "4", "--max-ms-per-token", "0"], "--max-ms-per-token=0.0 must be > 0"),
        (["--bits", "4", "--target", "gguf"], "--target gguf writes a GGUF file"),
        (["--bits", "4", "--out-gguf", "--candidates", "nf4:g64"], "stores none of the"),
        (["--bits", "4", "--candidates", "int9"], "'int9' is not a format"),
    ],
)
def test_bad_arguments_fail_before_loading(argv, message, tmp_path, capsys):
    out = str(tmp_path / ("m.gguf" if "--out-gguf" in argv else "ckpt"))
    argv = [a for a in argv if a != "--out-gguf"]
    assert main(["quantize", "no-such-model", "--out", out, *argv]) == 2
    assert message in _error(capsys)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from tiny_gguf import write_tiny_gguf

    root = tmp_path_factory.mktemp("budget")
    (root / "calib.txt").write_text("The quick brown fox jumps over the lazy dog. " * 40)
    return write_tiny_gguf("llama", root / "tiny.gguf"), root


def _types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def test_plan_to_gguf_and_back_through_recipe(tiny, capsys):
    model, root = tiny
    calib = ["--calibration", str(root / "calib.txt"), "--calibration-sequences", "1"]
    out, plan = root / "plan.gguf", root / "plan.json"
    argv = ["quantize", str(model), "--bits", "6", "--candidates", "q8_0,q4_0", "--out", str(out)]
    assert main([*argv, "--plan-out", str(plan), *calib]) == 0, _error(capsys)
    printed = capsys.readouterr().out
    assert "bits per layer" in printed and "layers/1" in printed
    types = _types(out)
    chosen = {t for name, t in types.items() if name.endswith(".weight") and "norm" not in name}
    assert chosen == {"Q8_0", "Q4_0"}  # each weight as its planned GGML type, none requantized
    data = json.loads(plan.read_text())
    assert data["shapes"]["layers/0/attn/q_proj/kernel"] == [64, 64]

    again = root / "again.gguf"
    argv = ["quantize", str(model), "--recipe", str(plan), "--out", str(again)]
    assert main(argv) == 0, _error(capsys)
    assert _types(again) == types

    data["shapes"]["layers/0/attn/q_proj/kernel"] = [64, 128]
    other = root / "other.json"
    other.write_text(json.dumps(data))
    for out in ("x.gguf", "checkpoint"):  # in memory, and streamed to a checkpoint
        argv = ["quantize", str(model), "--recipe", str(other), "--out", str(root / out)]
        assert main(argv) == 2
        assert "'layers/0/attn/q_proj/kernel' has shape (64, 64) here, (64, 128)" in _error(capsys)


def test_budget_outside_the_candidates(tiny, capsys):
    model, root = tiny
    calib = ["--calibration", str(root / "calib.txt"), "--calibration-sequences", "1"]
    argv = ["quantize", str(model), "--bits", "9", "--candidates", "q8_0,q4_0"]
    assert main([*argv, "--out", str(root / "y.gguf"), *calib]) == 2
    assert "above the largest plan" in _error(capsys)


def test_plan_on_output_sensitivity_within_a_time_limit(tiny, capsys):
    """`--sensitivity output` runs backward passes and plans on the model's output change;
    `--max-ms-per-token` times the candidates and prints the plan's kernel time."""
    model, root = tiny
    calib = ["--calibration", str(root / "calib.txt"), "--calibration-sequences", "1"]
    argv = ["quantize", str(model), "--bits", "6", "--candidates", "q8_0,q4_0"]
    out = root / "sens.gguf"
    timed = ["--sensitivity", "output", "--max-ms-per-token", "1000"]
    assert main([*argv, *timed, "--out", str(out), *calib]) == 0, _error(capsys)
    printed = capsys.readouterr().out
    assert "bits per layer" in printed and "ms of kernels per token within 1000" in printed
    chosen = {t for n, t in _types(out).items() if n.endswith(".weight") and "norm" not in n}
    assert chosen and chosen <= {"Q8_0", "Q4_0"}


def test_max_bytes_holds_in_the_exported_file(tiny, capsys):
    """`--max-bytes N` to a checkpoint with lowbit formats, then `lowbit export`:
    the file is at most N and, with N binding, within 2% of it; below the smallest file, the
    error names its size (every weight Q4_1, the cheapest type the candidates export as)."""
    from lowbit.io import export_gguf
    from lowbit.serving import load_model

    model, root = tiny
    loaded = load_model(str(model))
    pure = nnx.to_pure_dict(nnx.split(loaded.model)[1])
    sizes = {}
    for type_ in ("Q4_1", "Q8_0"):
        out = root / f"all-{type_}.gguf"
        export_gguf(pure, out, config=loaded.model.config, type=type_, source=model, log=None)
        sizes[type_] = out.stat().st_size
    calib = ["--calibration", str(root / "calib.txt"), "--calibration-sequences", "1"]
    # Q4_1 written directly; per-channel int8 and NF4 requantized as Q8_0.
    candidates = ["--candidates", "int4:g32:asym,int8,nf4:g64"]
    argv = ["quantize", str(model), "--sensitivity", "gram", *candidates, *calib]
    budget = (sizes["Q4_1"] + sizes["Q8_0"]) // 2
    checkpoint, exported = root / "budget-ckpt", root / "budget.gguf"
    assert main([*argv, "--max-bytes", str(budget), "--out", str(checkpoint)]) == 0, _error(capsys)
    assert main(["export", str(checkpoint), "--gguf", str(exported)]) == 0, _error(capsys)
    assert 0.98 * budget <= exported.stat().st_size <= budget

    low = sizes["Q4_1"] - 1
    assert main([*argv, "--max-bytes", str(low), "--out", str(root / "none")]) == 2
    assert f"the GGUF file takes {sizes['Q4_1']} to" in _error(capsys)
