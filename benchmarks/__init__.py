"""Benchmarks. Each module `benchmarks/<name>.py` exposes `run() -> str` (a markdown section);
`python -m benchmarks [name ...]` runs them and updates their sections in BENCHMARKS.md."""
