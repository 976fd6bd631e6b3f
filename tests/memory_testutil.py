"""Memory measurements shared by the memory tests and ``bench/scale.py``: the exact peak-RSS
growth of a block (:class:`PeakRSS`), a subprocess under an RSS watchdog (:func:`watched`), and,
run as a script, one long document's pooling and embedding step in a fresh interpreter:

    python tests/memory_testutil.py --pooler SPEC --document FILE   # prints one JSON line
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import subprocess
import time
from pathlib import Path

WATCHDOG_BYTES = 4 << 30


class PeakRSS:
    """Peak RSS growth of a block in process ``pid`` (default: this one): the kernel's
    high-water mark (``VmHWM``, reset on entry by writing 5 to ``/proc/PID/clear_refs``) minus
    ``VmRSS`` on entry, in MB. In this process, free heap memory is first returned to the
    system (``malloc_trim``) so that the block cannot hide its allocations in memory the
    process already held."""

    def __init__(self, pid: int | str = "self") -> None:
        self.proc = Path(f"/proc/{pid}")
        self.own = pid == "self"

    def kb(self, key: str) -> int:
        m = re.search(rf"^{key}:\s+(\d+) kB", (self.proc / "status").read_text(), re.M)
        return int(m.group(1)) if m else 0

    def __enter__(self) -> "PeakRSS":
        if self.own:
            try:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except OSError:
                pass
        (self.proc / "clear_refs").write_text("5")
        self.before_mb = self.kb("VmRSS") / 1024
        return self

    def __exit__(self, *exc) -> None:
        self.peak_mb = self.kb("VmHWM") / 1024
        self.growth_mb = self.peak_mb - self.before_mb

    def report(self) -> dict:
        return {"step_rss_before_mb": round(self.before_mb, 1), "step_peak_rss_mb": round(self.peak_mb, 1),
                "step_rss_growth_mb": round(self.growth_mb, 1)}


def measure_pool(embedder, doc: str, spec: str) -> dict:
    """Pool ``doc``'s token states (all its windows in one batch, forwarded beforehand) with
    ``spec`` alone, under :class:`PeakRSS`."""
    from embedpool.poolers import TokenStates

    p = embedder.pooler(spec)
    states = TokenStates.concat([s for _, s in embedder.encoder.encode([doc], p.plan)])
    with PeakRSS() as peak:
        pooled = p.pool(states)
    return {"vectors": int(pooled[0].shape[0]) if p.multi_vector else 1, "rows": int(states.hidden.shape[0]),
            **peak.report()}


def watched(cmd: list[str], env: dict | None = None, limit_bytes: int = WATCHDOG_BYTES,
            timeout: float = 900) -> tuple[object, str | None]:
    """Run ``cmd``, killed if its RSS passes ``limit_bytes`` or it outlives ``timeout`` s.
    Returns ``(json of its last stdout line, None)`` or ``(None, why it was killed)``."""
    import psutil

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    ps, deadline, killed = psutil.Process(proc.pid), time.monotonic() + timeout, None
    while proc.poll() is None:
        try:
            rss = ps.memory_info().rss
        except psutil.NoSuchProcess:
            break
        if rss > limit_bytes or time.monotonic() > deadline:
            killed = f"RSS {rss / 2**20:.0f} MB" if rss > limit_bytes else "timeout"
            proc.kill()
            break
        time.sleep(0.05)
    stdout, stderr = proc.communicate()
    if killed:
        return None, killed
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[1:])} failed:\n{stderr[-3000:]}")
    return json.loads(stdout.strip().splitlines()[-1]), None


def long_document_case(pooler: str, document: str) -> dict:
    """In this process: the model loaded and warmed up, then ``pooler``'s pooling step alone
    (:func:`measure_pool`) and its whole ``embed`` (forward included), each under
    :class:`PeakRSS`, on ``document``."""
    from embedpool.poolers import Embedder, FrozenEncoder

    encoder = FrozenEncoder()
    embedder = Embedder(encoder)
    embedder.embed([document[:1000]], [pooler])  # warm-up: kernels, thread pools
    work = embedder.measure([document], [pooler])
    pool = measure_pool(embedder, document, pooler)
    calls = encoder.stats.forward_calls
    with PeakRSS() as peak:
        vectors = embedder.embed([document], [pooler]).vectors[pooler][0]
    embed = {"vectors": int(vectors.shape[0]) if vectors.ndim == 2 else 1,
             "forward_calls": encoder.stats.forward_calls - calls, **peak.report()}
    return {"encoded_tokens": sum(work.tokens), "expected_vectors": work.vectors, "pool": pool, "embed": embed}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pooler", required=True)
    ap.add_argument("--document", type=Path, required=True)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    print(json.dumps(long_document_case(args.pooler, args.document.read_text(encoding="utf-8"))))
