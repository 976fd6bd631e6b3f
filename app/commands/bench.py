"""``embedpool bench NAME [ARGS...]``: run one of the benchmark scripts in ``bench/``.

The scripts live in the source tree (``bench/<name>.py``, next to ``app/``), print their tables
and write JSON to ``bench/results/``; this subcommand runs them with the same interpreter so a
user learns one tool. ``embedpool bench NAME --help`` shows a benchmark's own options.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from embedpool.errors import NotFoundError

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
BENCHMARKS = {
    "encode": "encoder throughput: sentence-transformers vs embedpool fp32 vs the int8 fast path",
    "index": "FAISS collections: flat latency, MaxSim exhaustive vs two_stage, SciFact, Milvus",
    "serve": "HTTP service vs in-process pipeline vs Infinity, and a 64-client load run",
    "eval": "the acceptance evaluations (SciFact, STS-B, synthetic long documents)",
    "scale": "one long document (1k-64k tokens): seconds per 1k tokens and peak RSS per pooler",
}


def register(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark script from bench/",
                       description="Run bench/NAME.py with the remaining arguments. Benchmarks: "
                                   + "; ".join(f"{k}: {v}" for k, v in BENCHMARKS.items()))
    p.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark script")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    script = BENCH_DIR / f"{args.name}.py"
    if not script.is_file():
        raise NotFoundError(f"{script} not found: the benchmarks run from a source checkout "
                                "(git clone, then `make setup`), not from an installed wheel")
    return subprocess.call([sys.executable, str(script), *args.args], cwd=BENCH_DIR.parent)
