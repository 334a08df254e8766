#!/usr/bin/env bash
# GPU check, 8 minutes at most: the GPU benchmark section (`python -m benchmarks gpu`), then
# the Pallas kernel tests compiled for the GPU (not interpreted) and the quantized products
# against their references there. Run from anywhere on a machine with a CUDA
# GPU and JAX's CUDA plugin; lowbit runs from this source tree (its C++ CPU extension need
# not be built). Logs and markdown go to "$OUT" if set, else ./out.
#
# `import lowbit` needs the `gguf` and `tokenizers` packages (lowbit.io and lowbit.models
# import them at module level). On a machine without them and without network, put their
# wheels in build/gpu-wheels (or $LOWBIT_GPU_WHEELS): they are installed into a temporary
# folder for this run only.
#
# LOWBIT_GPU_CHECK_TESTS=0 skips the tests (a short lease: the benchmark alone);
# LOWBIT_GPU_TEST_TIMEOUT bounds the tests (seconds, default 140), LOWBIT_GPU_BENCH_TIMEOUT
# the benchmark (default 330).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"  # tests/conftest.py would default to cpu
export LOWBIT_DISABLE_KERNELS=1                 # CPU-only extension: not needed here
export PYTHONUNBUFFERED=1

wheels="${LOWBIT_GPU_WHEELS:-build/gpu-wheels}"
missing=()
for module in gguf tokenizers; do
  "$PY" -c "import $module" 2>/dev/null || missing+=("$module")
done
if [ "${#missing[@]}" -gt 0 ]; then
  site="$(mktemp -d)"
  for module in "${missing[@]}"; do
    wheel="$(ls "$wheels"/"$module"-*.whl 2>/dev/null | head -n 1)"
    if [ -z "$wheel" ]; then
      echo "gpu_check: $module is not installed and no wheel is in $wheels" | tee -a "$OUT/env.txt"
      continue
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel"
  done
  export PYTHONPATH="$PYTHONPATH:$site"
fi

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1
  "$PY" -c "import lowbit; print('lowbit imports')" 2>&1 | tail -n 3
} | tee -a "$OUT/env.txt"

status=0
set -o pipefail
# The benchmark first: a lease that ends during the tests still returns its numbers.
timeout "${LOWBIT_GPU_BENCH_TIMEOUT:-330}" "$PY" -m benchmarks gpu --output "$OUT/BENCHMARKS-gpu.md" 2>&1 |
  tee "$OUT/bench-gpu.log" || status=1
if [ "${LOWBIT_GPU_CHECK_TESTS:-1}" != 0 ]; then
  timeout "${LOWBIT_GPU_TEST_TIMEOUT:-140}" "$PY" -m pytest -q -p no:cacheprovider \
    tests/kernels/test_pallas.py tests/ops/test_platform_dispatch.py tests/ops/test_dot_general.py 2>&1 |
    tee "$OUT/pytest-gpu.log" || status=1
fi
exit "$status"
