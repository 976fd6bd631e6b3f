"""Acceptance evaluation runs (issue 5), each an ``embedpool eval`` invocation:

  scifact  SciFact test, full corpus: mean, cls, max, landmark, attention (untrained), tokens,
           cluster pool factor 2/3/4; multi-vector poolers exhaustive and two_stage (mean
           companion, 100 candidates). Two forward passes over the corpus (standard + landmark
           plans) serve all of them.
  stsb     STS-B test: Spearman of cosine (normalized MaxSim for multi-vector poolers).
  long     synthetic long documents from SciFact: 100 sampled test queries, K = 0, 4, 16; the
           multi-vector poolers also with window=true (every window's tokens, no truncation).
  precision  SciFact test nDCG@10 of `mean` per encoder path (--paths; default: every path this
           CPU runs natively), one corpus pass each, and the difference to fp32 against the
           quality bar (within 0.3 points). Not part of the default run.

    .venv/bin/python bench/eval.py                    # all three, in this order (hours on 2 cores)
    .venv/bin/python bench/eval.py scifact            # one suite
    .venv/bin/python bench/eval.py --quick scifact    # a 100-document slice, minutes
    .venv/bin/python bench/eval.py --model models/all-mpnet-base-v2 scifact stsb   # another model (make models)
    flock /tmp/embedpool-bench.lock .venv/bin/python bench/eval.py precision --paths fp32 openvino-bf16

Writes ``bench/results/eval_<suite>.json`` (``eval_<suite>_<model folder name>.json`` with ``--model``) (+ ``.md``, ``.png``) and prints the tables. Each
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
    ap.add_argument("--model", help="model folder or cached id (default: the packaged all-MiniLM-L6-v2); "
                    "results are named after its last path component")
    ap.add_argument("--paths", nargs="+", help="precision suite: encoder paths (default: all this CPU runs)")
    ap.add_argument("--reuse", action="store_true",
                    help="precision suite: keep a path's result from an earlier run (its JSON) instead of running it again")
    args = ap.parse_args()
    if args.suites == ["precision"]:
        return precision_suite(args)
    bad = [s for s in args.suites if s not in SUITES]
    if bad:
        ap.error(f"unknown suite(s) {', '.join(bad)}; choose from {', '.join(SUITES)}")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    RESULTS.mkdir(parents=True, exist_ok=True)
    for suite in args.suites or list(SUITES):
        name = f"eval_{suite}" + model_suffix(args.model) + ("_quick" if args.quick else "")
        cmd = [sys.executable, "-m", "embedpool.app.cli", "eval", *SUITES[suite], *model_args(args.model),
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


def model_suffix(model: str | None) -> str:
    """``""`` for the packaged default (the results' historical names), else ``_<last component>``."""
    return "" if not model else "_" + Path(model.rstrip("/")).name


def model_args(model: str | None) -> list[str]:
    return ["--model", model] if model else []


def precision_suite(args) -> int:
    """SciFact nDCG@10 of ``mean`` per encoder path; table vs fp32 and the 0.3-point bar."""
    import json

    from embedpool.cpu import cpu_features
    from embedpool.precisions import ENCODER_PATHS

    isa = cpu_features().isa
    paths = args.paths or [p for p in ENCODER_PATHS if "bf16" not in p or isa in ("amx", "avx512_bf16")]
    paths = ["fp32", *[p for p in paths if p != "fp32"]]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    rows = {}
    for path in paths:
        out = RESULTS / f"eval_precision_{path}{model_suffix(args.model)}.json"
        cmd = [sys.executable, "-m", "embedpool.app.cli", "eval", *model_args(args.model), "--data", str(DATA / "scifact"), "--split",
               "test", "--pooler", "mean", "--precision", path, "--out", str(out), "--no-progress",
               "--latency-queries", "1"]
        if args.quick:
            cmd += ["--max-docs", "100"]
        print("$", " ".join(cmd), f"  (load average {os.getloadavg()[0]:.1f})", flush=True)
        t = time.time()
        if not (args.reuse and out.exists()) and subprocess.call(cmd, cwd=ROOT, env=env):
            return 1
        rep = json.loads(out.read_text())
        row = next(r for r in rep["results"] if r["pooler"] == "mean")
        rows[path] = {"ndcg@10": row["ndcg@10"], "encode_s": row.get("encode_s"),
                      "seconds": time.time() - t, "encoder_precision": rep.get("encoder_precision")}
    base = rows["fp32"]["ndcg@10"]
    lines = [f"ISA: {cpu_features().summary()}", "",
             "| path | SciFact nDCG@10 (mean) | vs fp32 (points) | bar (within 0.3) |", "|---|---:|---:|---|"]
    for path, r in rows.items():
        d = 100 * (r["ndcg@10"] - base)
        r["delta_points"] = d
        lines.append(f"| {path} | {r['ndcg@10']:.4f} | {d:+.2f} | {'met' if abs(d) <= 0.3 else '**missed**'} |")
    name = "eval_precision" + model_suffix(args.model) + ("_quick" if args.quick else "")
    (RESULTS / f"{name}.json").write_text(json.dumps({"isa": isa, "rows": rows}, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
