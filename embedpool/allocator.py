"""Give freed heap memory back to the system (glibc, Linux; a no-op elsewhere).

glibc serves a large allocation by ``mmap`` and returns it to the system when freed, but after
such a free it raises its mmap threshold (up to 32 MB), so later allocations of that size come
from the heap, which fragments and is only given back from its top: a long-running job's
resident memory then grows in steps with the corpus.

The remedy here is ``malloc_trim(0)`` after each commit of the indexing job and after a FAISS
collection is loaded (:func:`release_free_memory`): glibc hands every free page of the heap
back (``madvise``), not only the top, at a cost of milliseconds, and the allocation path is
untouched. Both layers use it (the indexing job in ``app/``, opening in ``index/``), so it lives
beside :mod:`embedpool.cpu`. Fixing the mmap threshold low
(``mallopt``) also keeps memory flat, but turns every activation tensor of a forward pass into
an ``mmap`` + page faults + ``munmap`` and slows encoding. glibc's allocator is not replaced
(jemalloc/tcmalloc would need a preloaded system library). The measurements behind this choice:
``bench/scale.py index``, results in docs/scale.md.
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
