"""Coverage-guided fuzz harnesses for lowbit's parsers of untrusted input (not part of the package).

One module per parser; each defines ``test_one(data: bytes)``, which asserts the contract (a
documented exception naming the file or field, or a valid result) and raises anything else,
and ``seeds()``, the starting corpus, generated from real files at run time. ``python -m fuzz``
runs them (see `fuzz.__main__`); ``python -m fuzz.gguf_reader [libFuzzer flags] DIR...`` runs
one by hand.
"""
