"""Give freed heap memory back to the system (glibc, Linux; a no-op elsewhere).

glibc serves a large allocation by ``mmap`` and returns it to the system when freed, but after
such a free it raises its mmap threshold (up to 32 MB), so later allocations of that size come
from the heap, which fragments and is only given back from its top: the indexing job's resident
memory grew in steps with the corpus (SciFact, ``mean`` + ``cluster:pool_factor=4``, one torch
thread: peak RSS 1,109 -> 1,450 MB from 1k to 5k documents, anonymous memory only).

Two remedies were measured (``bench/scale.py index``, same machine, same session):

- fixing the mmap threshold at 64 KiB and the trim threshold at 128 KiB (``mallopt``, what the
  CLI did before): flat memory (931 -> 1,118 MB, 1.20x) but the job took 223 s instead of 138 s,
  and a server's documents encoded ~1.4x slower -- every activation tensor of a forward pass
  became an ``mmap`` + page faults + ``munmap``; a 4 MiB threshold kept the speed (144 s) and
  most of the growth (1.28x);
- ``malloc_trim(0)`` after each commit (:func:`release_free_memory`): glibc hands every free
  page of the heap back (``madvise``), not only the top, at a cost of milliseconds per commit;
  the allocation path is untouched. This is what the indexing job does.

glibc's allocator is not replaced (jemalloc/tcmalloc would need a preloaded system library).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


@functools.cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim  # noqa: B018 - not glibc (e.g. musl): nothing to trim
    except (OSError, AttributeError):
        return None
    return libc


def release_free_memory() -> bool:
    """Return the heap's free pages to the system (``malloc_trim(0)``); True if any were."""
    libc = _libc()
    return bool(libc.malloc_trim(ctypes.c_size_t(0))) if libc is not None else False
