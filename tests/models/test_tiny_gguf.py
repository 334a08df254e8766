"""The tiny GGUF decoders of `tiny_gguf.py` and their llama.cpp references.

The stored references (`references/decoders.npz`, made by `make_decoder_references.py`) are
what lowbit's decoders are checked against; these tests keep them honest: the writer still
writes the files they were made from (sha256), lowbit's reader reads those files, the
NumPy forward pass of `decoder_numpy_ref.py` reproduces them (so its stated semantics are
llama.cpp's), and, where llama-cpp-python is installed, llama.cpp still produces them.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
from decoder_numpy_ref import decoder_logits, read_gguf_numpy
from tiny_gguf import ARCHITECTURES, gguf_architecture, write_tiny_gguf

from lowbit.gguf import read_gguf

REFERENCES = Path(__file__).parent / "references"


@pytest.fixture(scope="module")
def reference():
    with np.load(REFERENCES / "decoders.npz") as data:
        return {key: data[key] for key in data.files}


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """arch -> path of its tiny GGUF, written once per module."""
    root = tmp_path_factory.mktemp("tiny_gguf")
    return {arch: write_tiny_gguf(arch, root / f"{arch}.gguf") for arch in ARCHITECTURES}


def test_every_architecture_has_a_reference(reference):
    stored = {key.split("/")[0] for key in reference}
    assert stored == set(ARCHITECTURES)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_file_bytes_match_the_reference(arch, tiny_files, reference, tmp_path):
    # A second write gives the same bytes, and they are those the references were made from:
    # a changed writer must remake references/decoders.npz.
    again = write_tiny_gguf(arch, tmp_path / "again.gguf")
    data = tiny_files[arch].read_bytes()
    assert again.read_bytes() == data
    assert hashlib.sha256(data).hexdigest() == str(reference[f"{arch}/sha256"]), (
        f"tiny_gguf writes a different {arch} file than the references were made from: "
        "rerun tests/models/references/make_decoder_references.py"
    )


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_lowbit_reader_reads_the_file(arch, tiny_files):
    f = read_gguf(tiny_files[arch])
    assert f.architecture == gguf_architecture(arch)
    reader = gguf.GGUFReader(str(tiny_files[arch]))
    expected = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    assert {name: tuple(t.shape) for name, t in f.tensors.items()} == expected
    assert all(t.ggml_type == gguf.GGMLQuantizationType.F32 for t in f.tensors.values())
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # the reader's own header pseudo-fields
        assert key in f.metadata, key
        if field.types[0] != gguf.GGUFValueType.ARRAY:
            # approx: float32 values such as the norm epsilon come back as Python floats.
            assert f.metadata[key] == pytest.approx(field.contents()), key


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_numpy_forward_matches_llama_cpp(arch, tiny_files, reference):
    meta, weights = read_gguf_numpy(tiny_files[arch])
    prompt = reference[f"{arch}/prompt"].tolist()
    greedy = reference[f"{arch}/greedy"].tolist()
    logits = decoder_logits(meta, weights, prompt + greedy)
    want = reference[f"{arch}/logits"].astype(np.float64)
    got = logits[len(prompt) - 1]
    cosine = got @ want / np.linalg.norm(got) / np.linalg.norm(want)
    assert cosine >= 0.9999
    # llama.cpp evaluates Gemma's GELU through a float16 table: up to ~1e-2 off in the logits.
    np.testing.assert_allclose(got, want, atol=2e-2 if arch.startswith("gemma") else 1e-4)
    # Teacher-forced on llama.cpp's greedy tokens, the NumPy argmax picks each of them.
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == greedy


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3"])
def test_gemma_difference_is_llama_cpps_float16_gelu(arch, tiny_files, reference):
    # With llama.cpp's float16-table GELU the NumPy pass is 20x closer than with the exact one.
    meta, weights = read_gguf_numpy(tiny_files[arch])
    prompt = reference[f"{arch}/prompt"].tolist()
    got = decoder_logits(meta, weights, prompt, float16_gelu=True)[-1]
    np.testing.assert_allclose(got, reference[f"{arch}/logits"], atol=1e-3)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_llama_cpp_still_produces_the_references(arch, tiny_files, reference):
    pytest.importorskip("llama_cpp")
    spec = importlib.util.spec_from_file_location(
        "make_decoder_references", REFERENCES / "make_decoder_references.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    prompt = reference[f"{arch}/prompt"].tolist()
    assert prompt == script.prompt_for(arch)
    logits, greedy = script.run_llama_cpp(tiny_files[arch], prompt)
    np.testing.assert_allclose(logits, reference[f"{arch}/logits"], rtol=1e-4, atol=1e-4)
    assert greedy.tolist() == reference[f"{arch}/greedy"].tolist()
