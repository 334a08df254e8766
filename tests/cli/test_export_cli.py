"""`lowbit export`: SmolLM2's own blocks out to a GGUF file (skipped without the asset)."""

import gguf
import numpy as np
import pytest

from lowbit.cli._main import main
from lowbit.gguf import read_gguf
from lowbit.models import has_smollm2, smollm2_gguf_path


@pytest.mark.skipif(not has_smollm2(), reason="SmolLM2 GGUF asset not installed")
def test_export_gguf_recipe_writes_the_same_tensors(tmp_path, capsys):
    out = tmp_path / "smollm2.gguf"
    assert (
        main(["export", "smollm2", "--recipe", "gguf", "--gguf", str(out), "--type", "Q8_0"]) == 0
    )
    printed = capsys.readouterr().out
    assert "210 Q4_1" in printed and "211 written directly without requantizing" in printed
    gguf.GGUFReader(out)
    source, written = read_gguf(smollm2_gguf_path()), read_gguf(out)
    name = "blk.3.attn_q.weight"
    assert written.tensors[name].type_name == "Q4_1"
    assert np.array_equal(written.tensors[name].raw, source.tensors[name].raw)
