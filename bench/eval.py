"""Acceptance evaluation runs (issue 5), each an ``embedpool eval`` invocation:

  scifact  SciFact test, full corpus: mean, cls, max, landmark, attention (untrained), tokens,
           cluster pool factor 2/3/4; multi-vector poolers exhaustive and two_stage (mean
           companion, 100 candidates). Two forward passes over the corpus (standard + landmark
           plans) serve all of them.
  stsb     STS-B test: Spearman of cosine (normalized MaxSim for multi-vector poolers).
  long     synthetic long documents from SciFact: 100 sampled test queries, K = 0, 4, 16; the
           multi-vector poolers also with window=true (every window's tokens, no truncation).

    .venv/bin/python bench/eval.py                    # all three, in this order (hours on 2 cores)
    .venv/bin/python bench/eval.py scifact            # one suite
    .venv/bin/python bench/eval.py --quick scifact    # a 100-document slice, minutes

Writes ``bench/results/eval_<suite>.json`` (+ ``.md``, ``.png``) and prints the tables. Each
suite keeps its collections under ``--work DIR/<suite>`` so an interrupted run resumes its
indexing when started again. Runs torch with one thread unless OMP_NUM_THREADS is set: on the
shared 2-core machines one thread was 1.5x faster for documents and 10x faster for single queries.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DATA = (ROOT / ".." / "shared" / "data").resolve()

POOLERS = ["mean", "cls", "max", "landmark", "attention", "tokens",
           "cluster:pool_factor=2", "cluster:pool_factor=3", "cluster:pool_factor=4"]
SUITES = {
    "scifact": ["--data", str(DATA / "scifact"), "--split", "test", "--mode", "exhaustive,two_stage",
                *sum((["--pooler", p] for p in POOLERS), [])],
    "stsb": ["--sts", str(DATA / "stsb"), "--split", "test",
             *sum((["--pooler", p] for p in POOLERS), [])],
    "long": ["--synthetic-long", str(DATA / "scifact"), "--split", "test", "--distractors", "0", "4", "16",
             "--max-queries", "100", "--mode", "exhaustive",
             *sum((["--pooler", p] for p in ["mean", "cls", "max", "landmark", "attention", "tokens",
                                            "cluster:pool_factor=2", "tokens:window=true",
                                            "cluster:pool_factor=2,window=true"]), [])],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suites", nargs="*", metavar="SUITE", help=f"any of {', '.join(SUITES)} (default all)")
    ap.add_argument("--quick", action="store_true", help="small slices (smoke test of the runs)")
    ap.add_argument("--work", default="/tmp/embedpool-bench-eval", help="kept collections (resumable)")
    args = ap.parse_args()
    bad = [s for s in args.suites if s not in SUITES]
    if bad:
        ap.error(f"unknown suite(s) {', '.join(bad)}; choose from {', '.join(SUITES)}")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    RESULTS.mkdir(parents=True, exist_ok=True)
    for suite in args.suites or list(SUITES):
        name = f"eval_{suite}" + ("_quick" if args.quick else "")
        cmd = [sys.executable, "-m", "embedpool.app.cli", "eval", *SUITES[suite],
               "--out", str(RESULTS / f"{name}.json"), "--markdown", str(RESULTS / f"{name}.md"),
               "--plot", str(RESULTS / f"{name}.png"), "--index-dir", f"{args.work}/{name}"]
        if args.quick:
            cmd += {"scifact": ["--max-docs", "100"], "stsb": ["--max-pairs", "200"],
                    "long": ["--max-queries", "10"]}[suite]
        print("$", " ".join(cmd), flush=True)
        t = time.time()
        rc = subprocess.call(cmd, cwd=ROOT, env=env)
        print(f"[{suite}] exit {rc} after {time.time() - t:.0f}s", flush=True)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
