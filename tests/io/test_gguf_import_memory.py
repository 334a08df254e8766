"""Reading a GGUF file leaves its pages out of the resident set once they are copied."""

import mmap
import os

import numpy as np
import pytest

from lowbit.io._gguf_import import drop_mapped_pages


def _resident_pages(path: str) -> int:
    """Resident kB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                inside = fields[-1] == path
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc/self/smaps")
def test_copied_pages_leave_the_resident_set_and_read_back(tmp_path):
    path = str(tmp_path / "data.bin")
    payload = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8)
    payload.tofile(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    view = np.asarray(data[mmap.PAGESIZE : 3 << 20]).reshape(-1, 64)  # as read_gguf slices it
    copy = np.array(view)
    assert _resident_pages(path) >= 2 << 10  # kB: the copied range was read
    drop_mapped_pages(view)
    assert _resident_pages(path) < 64
    np.testing.assert_array_equal(view, copy)  # mapped back from the page cache on reading
    drop_mapped_pages(copy)  # not mapped: nothing to do
    np.testing.assert_array_equal(copy, payload[mmap.PAGESIZE : 3 << 20].reshape(-1, 64))
