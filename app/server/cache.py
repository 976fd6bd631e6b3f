"""A bounded LRU cache of document embeddings for ``/rerank``.

Reranking sends the same candidate texts again and again (the top-k of successive queries over
one corpus overlap). An input's vector does not depend on what it is batched with (see
:mod:`app.batcher`), so a text embedded once with the same pooler and options can be answered
from memory. Keys are a 128-bit BLAKE2 digest of the text plus every option that changes the
vector; the cache holds at most ``max_bytes`` of vectors (``rerank_cache_mb``; 0 turns it off)
and forgets the least recently used first.

Written here rather than with ``functools.lru_cache`` / ``cachetools`` because the bound is in
bytes of numpy arrays, not in entries, and lookups are by batch (a few dict operations per
text; nothing to measure against).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence

import numpy as np


def text_key(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class VectorCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get_many(self, options: Hashable, texts: Sequence[str]) -> list[np.ndarray | None]:
        """The cached vector of each text under ``options`` (``None`` where there is none)."""
        if not self.max_bytes:
            self.misses += len(texts)
            return [None] * len(texts)
        out: list[np.ndarray | None] = []
        with self._lock:
            for t in texts:
                key = (options, text_key(t))
                v = self._items.get(key)
                if v is not None:
                    self._items.move_to_end(key)
                    self.hits += 1
                else:
                    self.misses += 1
                out.append(v)
        return out

    def put_many(self, options: Hashable, texts: Sequence[str], vectors: Sequence[np.ndarray]) -> None:
        if not self.max_bytes:
            return
        with self._lock:
            for t, v in zip(texts, vectors):
                if v.nbytes > self.max_bytes:
                    continue
                key = (options, text_key(t))
                old = self._items.pop(key, None)
                if old is not None:
                    self.bytes -= old.nbytes
                self._items[key] = v
                self.bytes += v.nbytes
            while self.bytes > self.max_bytes and self._items:
                _, gone = self._items.popitem(last=False)
                self.bytes -= gone.nbytes
