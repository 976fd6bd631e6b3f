"""BM25, every pooler, and hybrid with each (issue 33), in one ``embedpool eval`` run per set:
nDCG@10, paired p-values (vs ``mean``; a hybrid row also vs its own vector row and vs BM25)
and the p50 latency of one query's search (and of its encoding).

  scifact  SciFact test (5,183 documents, 300 queries): mean, cls, max, tokens,
           cluster:pool_factor=4 (one forward pass serves them all); multi-vector poolers
           exhaustive and two_stage (100 candidates from the mean companion); BM25; hybrid of
           each row with BM25 (RRF, weight 0.5).
  long     synthetic long documents from SciFact test (K = 16 distractors per needle, ~5,700
           tokens per document, 100 queries): mean, tokens:window=true,
           cluster:pool_factor=2,window=true; exhaustive; BM25; hybrid of each.

    flock /work/locks/cpu.lock .venv/bin/python bench/hybrid.py [scifact|long] [--fusion score --weight 0.3]

Writes ``bench/results/hybrid_<suite>.json`` (+ ``.md``) and prints the table that
docs/evaluation.md carries. Collections are kept under ``--work`` (a rerun resumes indexing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DATA = (ROOT / ".." / "shared" / "data").resolve()

SUITES = {
    "scifact": ["--data", str(DATA / "scifact"), "--split", "test", "--mode", "exhaustive,two_stage,bm25,hybrid",
                *sum((["--pooler", p] for p in ["mean", "cls", "max", "tokens", "cluster:pool_factor=4"]), [])],
    "long": ["--synthetic-long", str(DATA / "scifact"), "--split", "test", "--distractors", "16",
             "--max-queries", "100", "--mode", "exhaustive,bm25,hybrid",
             *sum((["--pooler", p] for p in ["mean", "tokens:window=true", "cluster:pool_factor=2,window=true"]), [])],
}


def table(report: dict) -> str:
    f = lambda x, d=4: "" if x is None else f"{x:.{d}f}"  # noqa: E731
    fp = lambda x: "" if x is None else (f"{x:.2g}" if x < 0.001 else f"{x:.3f}")  # noqa: E731
    lines = [f"| row | nDCG@10 | p vs {report['baseline']} | p vs its vector row | p vs bm25 | search p50 ms | "
             "query encode ms |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        lines.append(f"| `{r['label']}` | {f(r['ndcg@10'])} | {fp(r.get('p_value'))} | {fp(r.get('p_vs_vector'))} | "
                     f"{fp(r.get('p_vs_bm25'))} | {f(r.get('search_p50_ms'), 1)} | {f(r.get('query_encode_single_ms'), 1)} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suites", nargs="*", metavar="SUITE", help=f"any of {', '.join(SUITES)} (default all)")
    ap.add_argument("--work", default="/tmp/embedpool-bench-hybrid", help="kept collections (resumable)")
    ap.add_argument("--fusion", default="rrf")
    ap.add_argument("--weight", default="0.5")
    ap.add_argument("--latency-queries", default="32")
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    sys.path.insert(0, str(ROOT / "bench"))
    from scale import machine

    for suite in args.suites or list(SUITES):
        name = f"hybrid_{suite}" + ("" if args.fusion == "rrf" and args.weight == "0.5" else f"_{args.fusion}_{args.weight}")
        out = RESULTS / f"{name}.json"
        cmd = [sys.executable, "-m", "embedpool.app.cli", "eval", *SUITES[suite], "--fusion", args.fusion,
               "--weight", args.weight, "--latency-queries", args.latency_queries, "--out", str(out),
               "--markdown", str(RESULTS / f"{name}.md"), "--index-dir", f"{args.work}/{suite}", "--no-progress"]
        print("$", " ".join(cmd), flush=True)
        t = time.time()
        info = machine()
        rc = subprocess.call(cmd, cwd=ROOT, env=env)
        print(f"[{suite}] exit {rc} after {time.time() - t:.0f}s", flush=True)
        if rc:
            return rc
        report = json.loads(out.read_text())
        report["machine"] = info
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
