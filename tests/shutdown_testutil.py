"""A request that keeps a server busy for a few seconds on any CPU, for the SIGTERM tests
(tests/app/test_server_shutdown.py, tests/image/test_api_image.py).

Sized by measurement, not by a fixed count: the same long texts through ``landmark`` took ~0.6 s
each on an AMX Xeon and ~9 s on an AVX2 EPYC (both 2 cores), so no fixed size is both still in
flight a second after it was sent on the one and done within a shutdown timeout on the other."""

from __future__ import annotations

import time
from collections.abc import Callable

TEXT_CHARS = 90_000  # ~20k tokens of SciFact abstracts; `landmark` windows them whole
PROBE_CHARS = 9_000


def rotations(docs: list[str], n: int, chars: int = TEXT_CHARS) -> list[str]:
    """``n`` texts of ``chars`` characters, each a different rotation of the joined ``docs``."""
    joined = " ".join(docs)
    return [(joined[i * 7919:] + " " + joined)[:chars] for i in range(n)]


def busy_texts(docs: list[str], post: Callable[[list[str]], None], seconds: float,
               most: int = 8) -> list[str]:
    """Texts whose ``landmark`` request takes about ``seconds`` on this server, measured by
    ``post``-ing a short probe (best of two); at most ``most`` texts of ``TEXT_CHARS`` (8: under
    the default request limit of 262,144 tokens), at least one."""
    probe = rotations(docs, 1, PROBE_CHARS)
    took = []
    for _ in range(2):
        t0 = time.monotonic()
        post(probe)
        took.append(time.monotonic() - t0)
    per_char = min(took) / PROBE_CHARS
    chars = int(seconds / per_char)
    n = max(1, min(most, round(chars / TEXT_CHARS)))
    return rotations(docs, n, min(TEXT_CHARS, max(PROBE_CHARS, chars // n)))
