"""bench/milvus_server.py stopped by SIGTERM (``timeout``, ``kill``) stops the Milvus server it
started: the server runs in a process group of its own, which a signal to the script never
reaches, so only the script's own cleanup can stop it (slow: a real server starts, ~10 s)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from milvus_testutil import SERVER

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not SERVER.exists(), reason="no Milvus server: `make milvus-server`")]


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_sigterm_stops_the_milvus_server_it_started(tmp_path):
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "milvus_server.py"), "--docs", "8", "--queries", "2",
                             "--out", str(tmp_path / "out.json")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=ROOT)
    pgid, lines = None, []
    try:
        for line in proc.stdout:  # "milvus server: pid N, URI" once it serves
            lines.append(line)
            if line.startswith("milvus server: pid "):
                pgid = int(line.split()[3].rstrip(","))
                break
        assert pgid is not None, "".join(lines)
        assert _alive(pgid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while _alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pgid), "the Milvus server outlived the benchmark stopped by SIGTERM"
        assert not (tmp_path / "out.json").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        if pgid is not None and _alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
