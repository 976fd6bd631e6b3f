"""glibc's allocator tuned for long-running jobs and servers (Linux only, a no-op elsewhere).

glibc serves a large allocation by ``mmap`` and returns it to the system when freed, but after
such a free it raises its mmap threshold (up to 32 MB), so later allocations of that size come
from the heap, which fragments and rarely shrinks: the indexing job's resident memory then grew
in steps as the corpus grew (SciFact, ``mean`` + ``cluster:pool_factor=4``: peak RSS 1,084 →
1,439 MB from 1k to 5k documents, anonymous memory only). A fixed threshold of 64 KiB (which also
turns the dynamic adjustment off) and a trim threshold of 128 KiB keep it flat (933 → 1,118 MB,
``bench/scale.py index``). These are the ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``
settings, applied with ``mallopt`` at start-up so the user need not export them; an explicit
environment setting wins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc malloc.h
M_MMAP_THRESHOLD = -3
SETTINGS = {M_MMAP_THRESHOLD: ("MALLOC_MMAP_THRESHOLD_", 64 << 10),
            M_TRIM_THRESHOLD: ("MALLOC_TRIM_THRESHOLD_", 128 << 10)}


def tune_allocator() -> bool:
    """Apply the settings above through ``mallopt``; True if glibc took them."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
        return False
    ok = True
    for param, (env, value) in SETTINGS.items():
        if env not in os.environ:
            ok = bool(mallopt(ctypes.c_int(param), ctypes.c_int(value))) and ok
    return ok
