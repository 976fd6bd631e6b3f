"""`embedpool bench NAME`: the benchmark scripts behind the one CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "embedpool.app.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_bench_runs_the_script_with_its_arguments():
    p = _cli("bench", "eval", "--help")
    assert p.returncode == 0, p.stderr
    assert "Acceptance evaluation runs" in p.stdout  # bench/eval.py's own help, not the CLI's
    p = _cli("bench", "eval", "no-such-suite")
    assert p.returncode == 2 and "unknown suite" in p.stderr


def test_bench_unknown_name_is_a_usage_error():
    p = _cli("bench", "nope")
    assert p.returncode == 2
    assert "invalid choice: 'nope'" in p.stderr and "encode" in p.stderr
