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

  cached   SciFact test from the embedding cache of bench/scifact_data.py (what
           ``bench/million.py encode`` fills: ``mean`` and ``cluster:pool_factor=16`` documents,
           ``tokens`` and ``mean`` queries), so nothing is encoded: BM25, mean,
           cluster:pool_factor=16 exhaustive and two_stage, and hybrid of each with BM25 (RRF and
           score fusion), through the collections' own search (``open_collection``, ``add``,
           ``search``) and ranx; the query-encoding time is not part of these latencies.

    flock /work/locks/cpu.lock .venv/bin/python bench/hybrid.py [scifact|long|cached] [--fusion score --weight 0.3]

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
    # (query encode ms: empty where nothing was encoded -- BM25, and the cached suite)
    return "\n".join(lines)


def cached(args) -> int:
    """The ``cached`` suite (module docstring)."""
    import statistics
    import tempfile

    import numpy as np
    from scale import machine
    from scifact_data import EmbeddingCache, load_scifact, scifact_queries

    from embedpool.app.evaluation import score_runs
    from embedpool.index import CollectionSpec, open_collection

    sf = load_scifact(args.max_docs)
    cache = EmbeddingCache()
    pooler = "cluster:pool_factor=16"
    docs = cache.embed("scifact", sf.doc_ids, sf.doc_texts, (pooler, "mean"), "document")
    q = scifact_queries(sf, cache)
    qrels = sf.qrels
    qids, texts = sf.query_ids, sf.query_texts
    q_mean, q_tok = np.stack(q["mean"]).astype(np.float32), [np.asarray(t, np.float32) for t in q["tokens"]]
    runs, lat = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        single = open_collection(tmp, "mean", CollectionSpec(kind="single", model="m", pooler="mean", dim=384))
        single.add(sf.doc_ids, np.stack(docs["mean"]).astype(np.float32), texts=sf.doc_texts)
        single.commit()
        multi = open_collection(tmp, "c16", CollectionSpec(kind="multi", model="m", pooler=pooler, dim=384,
                                                          companion_pooler="mean", companion_dim=384))
        multi.add(sf.doc_ids, [np.asarray(d, np.float32) for d in docs[pooler]], texts=sf.doc_texts,
                  companion=np.stack(docs["mean"]).astype(np.float32))
        multi.commit()
        rows = {"bm25": (single, None, "bm25", {})}
        for label, coll, vq, mode in (("mean", single, q_mean, "exhaustive"),
                                      (f"{pooler} [exhaustive]", multi, q_tok, "exhaustive"),
                                      (f"{pooler} [two_stage]", multi, q_tok, "two_stage")):
            rows[label] = (coll, vq, mode, {})
            for fusion, w in (("rrf", 0.5), ("score", 0.5)):
                rows[f"{label.split(' [')[0]} [hybrid {mode} {fusion}]"] = (
                    coll, vq, "hybrid", {"vector_mode": mode, "fusion": fusion, "weight": w, "vector": label})

        def search(coll, vq, mode, opts, i):
            kw = {k: v for k, v in opts.items() if k != "vector"}
            qv = None if vq is None else (vq[i:i + 1] if coll.spec.kind == "single" else [vq[i]])
            return coll.search(qv, k=100, mode=mode, texts=[texts[i]], candidates=100,
                               companion_queries=q_mean[i:i + 1] if coll.spec.kind == "multi" else None, **kw)[0]

        for label, (coll, vq, mode, opts) in rows.items():
            times, run = [], {}
            for i, qid in enumerate(qids):
                t = time.perf_counter()
                hits = search(coll, vq, mode, opts, i)
                times.append(time.perf_counter() - t)
                run[qid] = {h.id: float(h.score) for h in hits}
            runs[label], lat[label] = run, 1000 * statistics.median(times)
            print(f"{label}: p50 {lat[label]:.1f} ms", flush=True)
        single.close()
        multi.close()
    scores = score_runs(qrels, runs, baseline="mean")
    results = []
    for label, (_, _, mode, opts) in rows.items():
        r = {"label": label, "ndcg@10": scores[label]["metrics"]["ndcg@10"], "search_p50_ms": lat[label],
             "p_value": scores[label]["p_values"].get("ndcg@10")}
        for key, other in (("p_vs_vector", opts.get("vector")), ("p_vs_bm25", "bm25" if mode == "hybrid" else None)):
            if other:
                pair = score_runs(qrels, {other: runs[other], label: runs[label]}, baseline=other, metrics=("ndcg@10",))
                r[key] = pair[label]["p_values"].get("ndcg@10")
        results.append(r)
    report = {"suite": "cached", "documents": len(sf.doc_ids), "queries": len(qids), "baseline": "mean",
              "machine": machine(), "results": results}
    if not args.max_docs:  # a slice is a smoke test of this script
        (RESULTS / "hybrid_cached.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suites", nargs="*", metavar="SUITE",
                    help=f"any of {', '.join(SUITES)} (default all), or cached alone")
    ap.add_argument("--work", default="/tmp/embedpool-bench-hybrid", help="kept collections (resumable)")
    ap.add_argument("--fusion", default="rrf")
    ap.add_argument("--weight", default="0.5")
    ap.add_argument("--latency-queries", default="32")
    ap.add_argument("--max-docs", type=int, help="cached: the first N documents only (a smoke test; no results written)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    if args.suites == ["cached"]:
        return cached(args)
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
        print(f"machine: {info['cpu']} x{info['cpus']} {' '.join(info['cpu_flags'])}; load {info['loadavg_start']}",
              flush=True)
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
