"""The resource half of the fuzz contract: each harness refuses the hostile seeds (counts and
sizes far beyond the file) within a memory and time bound that follow the input's size
(`fuzz._bounded`), in a subprocess, as ``python -m fuzz`` would see them."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the fuzz package sits beside lowbit, outside the install

from fuzz._bounded import run_bounded  # noqa: E402
from fuzz._seeds import hostile_gguf_seeds, hostile_safetensors_seeds  # noqa: E402

HOSTILE = {
    "gguf_reader": hostile_gguf_seeds,
    "gguf_model": hostile_gguf_seeds,
    "safetensors_reader": hostile_safetensors_seeds,
}


@pytest.mark.parametrize("harness", sorted(HOSTILE))
def test_hostile_seeds_stay_within_the_bounds(harness, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    files = []
    for name, data in HOSTILE[harness]():
        (tmp_path / name).write_bytes(data)
        files.append(str(tmp_path / name))
    outcomes = run_bounded(harness, files, timeout=120)
    assert [o.file for o in outcomes] == files
    failed = [o for o in outcomes if o.verdict != "ok"]
    assert not failed, failed


def test_the_bounds_catch_a_declaration_that_costs_more_than_the_file(tmp_path, monkeypatch):
    # The finding the bounds exist for, with the check that fixed it taken out again.
    monkeypatch.chdir(ROOT)
    seed = dict(hostile_gguf_seeds())["hostile_block_count.gguf"]
    (tmp_path / "seed.gguf").write_bytes(seed)
    script = (
        "import sys, lowbit.models._decoder_gguf as d; d._check_block_count = lambda f: None; "
        "from fuzz._bounded import main; main(sys.argv[1:])"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, "gguf_model", str(tmp_path / "seed.gguf")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    outcome = json.loads(done.stdout.splitlines()[-1])
    assert outcome["verdict"] in ("memory", "time"), outcome


def test_a_small_file_of_seven_block_types_imports_within_the_time_bound(monkeypatch):
    # A fuzz finding (2026-11-30): 7.7 KB, seven block types; decoding each leaf to check it
    # compiled every decoder op for its shape, 5 s, past the bound. The harness now traces it.
    monkeypatch.chdir(ROOT)
    file = str(ROOT / "fuzz" / "corpus" / "gguf_import" / "finding_seven_block_types.gguf")
    outcomes = run_bounded("gguf_import", [file], timeout=120)
    assert [o.verdict for o in outcomes] == ["ok"], outcomes
