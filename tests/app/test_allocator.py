"""The indexing job's ``malloc_trim``: freed heap memory goes back to the system, which glibc
does not do by itself for free chunks below the top of its heap."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = r"""
import numpy as np
from embedpool.allocator import release_free_memory

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

base = rss_mb()
# 2,000 buffers of 96 KiB (under glibc's mmap threshold: from the heap), each written
blocks = [np.ones(96 * 1024, np.uint8) for _ in range(2000)]
keep = blocks[-1]  # the last one stays: the heap's top is in use, so free() cannot shrink it
del blocks
freed = rss_mb()
print(base, freed, release_free_memory(), rss_mb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_release_free_memory_returns_freed_heap_to_the_system():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120)
    base, freed, released, after = out.stdout.split()
    base, freed, after = float(base), float(freed), float(after)
    assert freed - base > 150, "the freed buffers are still resident before the trim"
    assert released == "True" and after - base < 50
