"""The size of a GGUF export before it is written: `gguf_nbytes` and a plan's charges
(`gguf_plan_bytes`) are the written file's bytes, header, tokenizer, norms and padding included,
for formats written directly and formats the export requantizes."""

import itertools
import os
import sys
from pathlib import Path

import pytest
from flax import nnx

from lowbit import quantize_params
from lowbit.api._budget import planned_weights
from lowbit.io import export_gguf, gguf_nbytes, gguf_plan_bytes
from lowbit.recipes import param_leaves, parse_candidates, plan_recipe
from lowbit.serving import load_model

# Direct (Q4_0, Q4_1, Q8_0 blocks) and requantized to Q8_0 (per-channel int8, NF4, int3 in
# groups of 64, asymmetric int4 in groups of 16: rows of 64 are whole Q8_0 blocks).
CANDIDATES = parse_candidates("q4_0,q4_1,q8_0,int8,nf4:g64,int3:g64,int4:g16:asym")


@pytest.fixture(scope="module", params=["llama", "qwen2"])  # an output matrix, and tied
def tiny(request, tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from tiny_gguf import write_tiny_gguf

    root = tmp_path_factory.mktemp("size")
    loaded = load_model(str(write_tiny_gguf(request.param, root / "tiny.gguf")))
    return loaded, nnx.to_pure_dict(nnx.split(loaded.model)[1]), root


def test_plan_charges_add_up_to_the_written_file(tiny):
    loaded, pure, root = tiny
    config = loaded.model.config
    shapes = planned_weights(pure, CANDIDATES)
    assert "embed/embedding" in shapes
    # Every candidate in turn, so each format lands on a few weights of each kind.
    choices = {
        path: (cand, shape)
        for (path, shape), cand in zip(shapes.items(), itertools.cycle(CANDIDATES))
    }
    params = quantize_params(pure, plan_recipe(choices))
    file = gguf_plan_bytes(pure, shapes, config=config, source=loaded.gguf_path)
    leaves = dict(param_leaves(params))
    charged = {p: file.nbytes(p, leaves[p]) for p in shapes}
    out = root / "plan.gguf"
    report = export_gguf(params, out, config=config, source=loaded.gguf_path, log=None)
    size = os.path.getsize(out)
    assert file.fixed + sum(charged.values()) == size == report.nbytes
    assert gguf_nbytes(params, config=config, source=loaded.gguf_path) == size
    written = {t.name: t.ggml_type for t in report.tensors}
    assert {"Q4_0", "Q4_1", "Q8_0"} <= set(written.values())  # direct and requantized
    # The fixed bytes hold the tokenizer's strings: more than the norms alone.
    norms = sum(4 * v.size for p, v in param_leaves(pure) if v.ndim == 1)
    assert file.fixed > norms + 1000


@pytest.mark.parametrize("type_", [None, "Q8_0", "F16"])
def test_predicted_size_is_the_file_size(tiny, type_):
    loaded, pure, root = tiny
    config = loaded.model.config
    out = root / f"float-{type_}.gguf"
    export_gguf(pure, out, config=config, type=type_, source=loaded.gguf_path, log=None)
    predicted = gguf_nbytes(pure, config=config, type=type_, source=loaded.gguf_path)
    assert predicted == os.path.getsize(out)
