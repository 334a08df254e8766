"""Loading a SmolLM2-sized int4 checkpoint stays near the file size in memory (no floats)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from lowbit.io import save_checkpoint
from lowbit.qarray import QArray

# 8 x [4096, 4096] = 134M weights at int4, groups of 32 along the input axis: ~72 MiB of codes
# plus ~8 MiB of fp16 scales. As float32 the same weights would take 512 MiB.
N_TENSORS, DIM, GROUP = 8, 4096, 32

_LOADER = """
import json, sys
import jax
import numpy as np
from lowbit.io import load_checkpoint
from lowbit.qarray import QArray

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

# Warm up the runtime (host-to-device copies included) so its one-time costs count as before.
jax.device_put(np.ones(2**20, np.uint8)).block_until_ready()
before_peak, before_anon = status("VmHWM"), status("RssAnon")
params = load_checkpoint(sys.argv[1], kernel_layouts=sys.argv[2] == "1")
jax.block_until_ready(params)
leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QArray))
print(json.dumps({
    "peak_growth": status("VmHWM") - before_peak,
    "anon_growth": status("RssAnon") - before_anon,
    "qarrays": sum(isinstance(q, QArray) for q in leaves),
    "code_dtypes": sorted({str(q.codes.dtype) for q in leaves}),
    "kernel_bytes": sum(q.kernel_nbytes for q in leaves),
}))
"""


def _synthetic_params(rng: np.random.Generator) -> dict:
    params = {}
    for i in range(N_TENSORS):
        params[f"w{i}"] = QArray(
            codes=rng.integers(0, 256, (DIM, DIM // 2), dtype=np.uint8),
            scale=rng.random((DIM // GROUP, DIM), dtype=np.float32).astype(np.float16),
            zero_point=None,
            tensor_scale=None,
            format="int4",
            shape=(DIM, DIM),
            dtype=np.float32,
            packed_axis=1,
        ).check()
    return params


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")
@pytest.mark.parametrize("kernel_layouts", [False, True])
def test_peak_rss_while_loading_is_bounded_by_file_size(tmp_path, kernel_layouts):
    save_checkpoint(tmp_path / "ck", _synthetic_params(np.random.default_rng(0)))
    file_size = os.path.getsize(tmp_path / "ck" / "model.safetensors")
    # A fixed mmap threshold makes glibc hand every large freed buffer straight back to the OS.
    # Its default threshold grows with each large free, after which freed read buffers and
    # compiler scratch stay in the heap: RSS then measures the allocator's retention policy
    # (which differed by ~40 MiB between two machines), not the data the load keeps alive.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(
        [sys.executable, "-c", _LOADER, str(tmp_path / "ck"), str(int(kernel_layouts))],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    delta, kept = result["peak_growth"], result["anon_growth"]
    extra = result["kernel_bytes"]
    mib = 2**20
    print(
        f"file {file_size / mib:.1f} MiB, kernel layouts {extra / mib:.1f} MiB: "
        f"peak RSS +{delta / mib:.1f}, kept +{kept / mib:.1f} MiB"
    )
    assert result["qarrays"] == N_TENSORS and result["code_dtypes"] == ["uint8"]
    assert (extra > 0) == kernel_layouts or not kernel_layouts
    # Peak: the host read buffers plus the device copies, never a float32 materialization
    # (which alone would be ~512 MiB). The kernel layouts are a second, derived copy of the
    # weights, built one weight at a time. Kept: the codes, scales and layouts, plus a little
    # runtime state (compiled programs); a host copy of the file left alive would add 72 MiB.
    assert delta < 2 * file_size + extra + 64 * mib
    assert kept < file_size + extra + 48 * mib
