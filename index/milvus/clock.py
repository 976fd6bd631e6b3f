"""The insertion clock: ``ids()`` returns documents in insertion order, which Milvus does not
keep, so every row carries an increasing stamp (``seq``)."""

from __future__ import annotations

import threading
import time


class InsertionClock:
    """Process-wide increasing insertion stamps (microseconds; ordered across processes too,
    as far as their clocks agree)."""

    _lock = threading.Lock()
    _last = 0

    @classmethod
    def take(cls, n: int) -> int:
        """The first of ``n`` consecutive fresh stamps."""
        with cls._lock:
            start = max(cls._last + 1, time.time_ns() // 1000)
            cls._last = start + n - 1
            return start
