"""Fuzzes a GGUF file's model description (`lowbit.models.load_decoder_gguf` without weights:
the ``{arch}.*`` metadata read into a `DecoderConfig`, checked against the tensor table, the
per-layer name map, and the model built on shapes alone, as serving a file's own blocks does).

Contract: a `ValueError` (`GGUFError` included) naming the file, or a model whose every mapped
tensor is in the file; at a cost in proportion to the file, whatever its metadata declares
(`fuzz._bounded`: a 5 MB file declaring 10**9 layers once took gigabytes).
"""

from __future__ import annotations

from fuzz._contract import documented, main, scratch_file, write
from fuzz._seeds import gguf_seeds

seeds = gguf_seeds  # what `python -m fuzz` starts the corpus from

_PATH = scratch_file("model.gguf")


def _load():
    global gguf_param_map, load_decoder_gguf, read_gguf
    from lowbit.gguf import read_gguf
    from lowbit.models import gguf_param_map, load_decoder_gguf


def test_one(data: bytes) -> None:
    path = write(_PATH, data)
    with documented((ValueError,), repr(path)):
        gguf_file = read_gguf(path)
        model, _ = load_decoder_gguf(gguf_file, weights=False)
        mapping = gguf_param_map(model.config)
        assert all(name in gguf_file.tensors for name in mapping), "a mapped tensor is absent"


if __name__ == "__main__":
    main(test_one, _load)
