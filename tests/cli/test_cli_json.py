"""The `--json` contract (every outcome is one JSON object on stdout) and `--text` checks."""

import json

import pytest

from lowbit.cli import main


def _only_json_line(out: str) -> dict:
    lines = out.splitlines()
    assert len(lines) == 1, out
    return json.loads(lines[0])


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["eval", "no-such-model", "--json"], "MODEL 'no-such-model' is not a known model"),
        (["eval", "--json"], "the following arguments are required: DIR|MODEL"),
        (["bench", "minilm", "--decode-steps", "0", "--json"], "--decode-steps=0"),
        (["eval", "minilm", "--context", "1", "--json"], "--context=1"),
    ],
)
def test_errors_are_one_json_object_on_stdout(argv, fragment, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    result = _only_json_line(captured.out)
    assert fragment in result["error"] and result["exit_code"] == 2 and result["type"]
    assert "lowbit: error: " in captured.err  # the human-readable line stays


def test_text_binary_or_too_short_names_the_file(tmp_path, capsys):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"plain words\x00and a NUL" * 20)
    short = tmp_path / "short.txt"
    short.write_text("Too short to score.")
    cases = [
        (binary, "is not UTF-8 text"),
        (nul, "looks binary"),
        (short, "is too short: 19 bytes, and perplexity with --context 512 needs at least 513"),
    ]
    for path, fragment in cases:
        # The files are checked before any model loads, so these return at once.
        assert main(["eval", "smollm2", "--text", str(path), "--json"]) == 2
        error = _only_json_line(capsys.readouterr().out)["error"]
        assert repr(str(path)) in error and fragment in error, error


def test_json_is_the_only_stdout_line(tmp_path, capfd):
    """`lowbit eval ... --json | jq` works: nothing else reaches stdout, even at the fd level."""
    models = pytest.importorskip("lowbit.models")
    if not models.has_minilm():
        pytest.skip("all-MiniLM-L6-v2 is not installed")
    sentences = tmp_path / "s.txt"
    sentences.write_text("A short sentence.\nAnother one, a little longer.\n")
    argv = ["eval", "minilm", "--recipe", "int8w", "--sentences", str(sentences), "--json"]
    assert main(argv) == 0
    captured = capfd.readouterr()
    result = _only_json_line(captured.out)
    assert result["model"] == "minilm" and result["recipe"] == "int8w"
    assert 0.99 <= result["value"] <= 1.0 + 1e-6
    assert "lowbit eval: minilm" in captured.err  # the table went to stderr


def test_generate_runs_several_prompts_as_one_batch_and_reports_json(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("One, two,\n\n", encoding="utf-8")
    argv = ["generate", "smollm2", "--prompt", "The capital of France is"]
    assert main([*argv, "--prompts-file", str(prompts), "--max-new-tokens", "3", "--json"]) == 0
    result = _only_json_line(capsys.readouterr().out)
    rows = result["completions"]
    assert [r["prompt"] for r in rows] == ["The capital of France is", "One, two,"]
    assert rows[0]["text"].startswith(" Paris")  # greedy, float: the README's answer
    assert all(r["new_tokens"] <= 3 and r["text"] for r in rows)
    assert len(result["prompt_tokens"]) == 2 and result["kv_cache"] == "float"


def test_generate_with_int8_activations_keeps_the_answer(capsys):
    # The GGUF's own Q4_1 / Q8_0 blocks times int8 activations on the 2-row batch.
    argv = ["generate", "smollm2", "--recipe", "gguf", "--int8-activations", "--json"]
    argv += ["--prompt", "The capital of France is", "--prompt", "One, two,"]
    assert main([*argv, "--max-new-tokens", "3"]) == 0
    result = _only_json_line(capsys.readouterr().out)
    assert result["int8_activations"] is True
    assert result["kv_cache"] == "float16"  # the gguf recipe's default, as llama.cpp's
    assert result["completions"][0]["text"].startswith(" Paris")


def test_generate_needs_a_prompt_before_loading_anything(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n", encoding="utf-8")
    for argv, fragment in [
        (["generate", "smollm2", "--json"], "give a prompt"),
        (["generate", "smollm2", "--prompts-file", str(empty), "--json"], "holds no prompt"),
        (["generate", "smollm2", "--prompt", "", "--json"], "prompt 1 is empty"),
    ]:
        assert main(argv) == 2
        assert fragment in _only_json_line(capsys.readouterr().out)["error"]
