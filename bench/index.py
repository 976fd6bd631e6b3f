"""Index benchmarks.

Synthetic part (no model needed; runs now):
  A. flat single-vector search latency on 100k synthetic 384-d unit vectors (``IDMap2,Flat``):
     add/commit time, per-query p50/p99 (one query per call) and batched throughput;
  B. multi-vector MaxSim: ``exhaustive`` vs ``two_stage`` (mean-pooled companion, N candidates)
     latency and agreement with the exhaustive top-10, per storage precision, on synthetic token
     sets (each document's tokens scatter around a topic direction; queries are noisy copies of
     some of a document's tokens).

    .venv/bin/python bench/index.py            # ~1-2 minutes on 2 cores
    .venv/bin/python bench/index.py --quick    # smaller sizes, a few seconds

Writes ``bench/results/index_synthetic.json`` and prints a table.

The SciFact part (real MiniLM token states from ``poolers/``: tokens / cluster poolers x
precision, nDCG@10, two_stage N = 50/100/200/500) is still to be written.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# this file is named index.py: keep its own folder off sys.path so `import index` is the package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))


def _threads_from_argv(default: int = 1) -> int:
    """--threads must take effect before numpy/faiss load their thread pools."""
    for i, a in enumerate(sys.argv):
        if a == "--threads" and i + 1 < len(sys.argv):
            return int(sys.argv[i + 1])
        if a.startswith("--threads="):
            return int(a.split("=", 1)[1])
    return default


THREADS = _threads_from_argv()
if THREADS > 0:
    for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_v] = str(THREADS)

import numpy as np  # noqa: E402

from index import Collection, CollectionSpec  # noqa: E402

RESULTS = _HERE / "results" / "index_synthetic.json"


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def pct(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {"p50_ms": round(float(np.percentile(a, 50)), 3), "p99_ms": round(float(np.percentile(a, 99)), 3),
            "mean_ms": round(float(a.mean()), 3)}


def bench_flat(root: Path, n: int, dim: int, n_queries: int, batch: int, rng) -> dict:
    coll = Collection.create(root, "flat", CollectionSpec(kind="single", dim=dim))
    t0 = time.perf_counter()
    step = 20_000
    for s in range(0, n, step):
        m = min(step, n - s)
        coll.add([f"d{i}" for i in range(s, s + m)], unit(rng.standard_normal((m, dim), dtype=np.float32)))
    t_add = time.perf_counter() - t0
    t0 = time.perf_counter()
    coll.commit()
    t_commit = time.perf_counter() - t0
    q = unit(rng.standard_normal((n_queries, dim), dtype=np.float32))
    coll.search(q[:5], k=10)  # warm-up
    single = []
    for i in range(n_queries):
        t0 = time.perf_counter()
        coll.search(q[i:i + 1], k=10)
        single.append(1000 * (time.perf_counter() - t0))
    import faiss

    # faiss-cpu ships distance_compute_blas_threshold=128000, so batches use the per-query scan;
    # measure batches with that default and with BLAS (threshold 20), which a batch job can set.
    # (Not set by index/: on this machine it made single-query search ~2.5x slower.)
    default_th = faiss.cvar.distance_compute_blas_threshold
    batched: dict[int, list[float]] = {}
    for th in (default_th, 20):
        faiss.cvar.distance_compute_blas_threshold = th
        batched[th] = []
        for s in range(0, n_queries, batch):
            t0 = time.perf_counter()
            coll.search(q[s:s + batch], k=10)
            batched[th].append(1000 * (time.perf_counter() - t0) / len(q[s:s + batch]))
    faiss.cvar.distance_compute_blas_threshold = default_th
    st = coll.stats()
    coll.close()
    return {"vectors": n, "dim": dim, "factory": "IDMap2,Flat", "add_s": round(t_add, 2),
            "commit_s": round(t_commit, 2), "bytes_per_doc": round(st["bytes_per_doc"], 1),
            "per_query_k10": pct(single),
            "batch_size": batch,
            "batched_per_query_ms": round(float(np.mean(batched[default_th])), 3),
            "batched_qps": round(1000 / float(np.mean(batched[default_th])), 1),
            "batched_blas_per_query_ms": round(float(np.mean(batched[20])), 3),
            "batched_blas_qps": round(1000 / float(np.mean(batched[20])), 1),
            "faiss_blas_threshold_default": int(default_th)}


def synth_tokens(rng, n_docs: int, dim: int, lo: int, hi: int, n_q: int, q_tokens: int):
    topics = unit(rng.standard_normal((n_docs, dim), dtype=np.float32))
    docs = [unit(t + 0.8 * unit(rng.standard_normal((int(rng.integers(lo, hi + 1)), dim), dtype=np.float32)))
            for t in topics]
    targets = rng.choice(n_docs, n_q, replace=False)
    queries = []
    for t in targets:
        d = docs[t]
        take = d[rng.choice(len(d), min(q_tokens, len(d)), replace=False)]
        queries.append(unit(take + 0.5 * rng.standard_normal(take.shape, dtype=np.float32) / np.sqrt(dim)))
    return docs, queries


def bench_maxsim(root: Path, n_docs: int, dim: int, n_q: int, candidates: list[int], rng) -> dict:
    docs, queries = synth_tokens(rng, n_docs, dim, 32, 128, n_q, 16)
    ids = [f"d{i}" for i in range(n_docs)]
    pooled = Collection.create(root, "pooled", CollectionSpec(kind="single", dim=dim))
    pooled.add(ids, unit(np.stack([d.mean(0) for d in docs])))
    pooled.commit()
    cq = unit(np.stack([q.mean(0) for q in queries]))
    out = {"documents": n_docs, "dim": dim, "tokens": int(sum(len(d) for d in docs)),
           "queries": n_q, "query_tokens": 16, "precisions": {}}
    for precision in ("float32", "float16", "int8"):
        coll = Collection.create(root, f"multi-{precision}",
                                 CollectionSpec(kind="multi", dim=dim, precision=precision, companion="pooled"))
        for s in range(0, n_docs, 1000):
            coll.add(ids[s:s + 1000], docs[s:s + 1000])
        coll.commit()
        res = {"bytes_per_doc": round(coll.stats()["bytes_per_doc"], 1)}
        coll.search(queries[:1], k=10)  # warm-up
        exact, lat = [], []
        for q in queries:
            t0 = time.perf_counter()
            exact.append([h.id for h in coll.search([q], k=10)[0]])
            lat.append(1000 * (time.perf_counter() - t0))
        res["exhaustive"] = pct(lat)
        for n in candidates:
            got, lat = [], []
            for i, q in enumerate(queries):
                t0 = time.perf_counter()
                got.append([h.id for h in coll.search([q], k=10, mode="two_stage", candidates=n,
                                                      companion_queries=cq[i:i + 1])[0]])
                lat.append(1000 * (time.perf_counter() - t0))
            overlap = float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got, exact)]))
            top1 = float(np.mean([a[0] == b[0] for a, b in zip(got, exact)]))
            res[f"two_stage_{n}"] = {**pct(lat), "top10_overlap_vs_exhaustive": round(overlap, 4),
                                     "top1_agreement": round(top1, 4),
                                     "speedup_p50": round(res["exhaustive"]["p50_ms"] / max(pct(lat)["p50_ms"], 1e-9), 1)}
        out["precisions"][precision] = res
        coll.close()
    pooled.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--threads", type=int, default=1,
                    help="BLAS/OpenMP threads (default 1: on a small shared machine more threads "
                         "spin against other processes and single-query latency gets much worse; "
                         "0 = library default)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    n_single, n_docs, n_q = (10_000, 300, 10) if args.quick else (100_000, 2_000, 30)
    with tempfile.TemporaryDirectory() as tmp:
        flat = bench_flat(Path(tmp), n_single, 384, 200, 100, rng)
        ms = bench_maxsim(Path(tmp), n_docs, 384, n_q, [50, 100, 200], rng)
    result = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "threads": THREADS},
              "flat_single": flat, "maxsim": ms}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    f = flat
    print(f"threads: {THREADS or 'library default'}")
    print(f"\nA. flat single-vector search, {f['vectors']:,} x {f['dim']}-d, {f['factory']}, k=10")
    print(f"   add {f['add_s']} s, commit {f['commit_s']} s, {f['bytes_per_doc']} bytes/doc")
    print(f"   one query per call: p50 {f['per_query_k10']['p50_ms']} ms, p99 {f['per_query_k10']['p99_ms']} ms;"
          f"  batches of {f['batch_size']}: {f['batched_per_query_ms']} ms/query ({f['batched_qps']} q/s),"
          f" with faiss BLAS threshold 20: {f['batched_blas_per_query_ms']} ms/query ({f['batched_blas_qps']} q/s)")
    print(f"\nB. MaxSim, {ms['documents']:,} docs, {ms['tokens']:,} tokens x {ms['dim']}-d, "
          f"{ms['queries']} queries x {ms['query_tokens']} tokens, k=10 (one query per call)")
    hdr = f"   {'precision':9} {'B/doc':>8} {'mode':>14} {'p50 ms':>8} {'p99 ms':>8} {'speedup':>8} {'top10 ovl':>9} {'top1':>5}"
    print(hdr)
    for p, r in ms["precisions"].items():
        e = r["exhaustive"]
        print(f"   {p:9} {r['bytes_per_doc']:>8} {'exhaustive':>14} {e['p50_ms']:>8} {e['p99_ms']:>8} {'1.0':>8} {'1.0':>9} {'1.0':>5}")
        for key, v in r.items():
            if key.startswith("two_stage_"):
                print(f"   {'':9} {'':>8} {'two_stage N=' + key.rsplit('_', 1)[1]:>14} {v['p50_ms']:>8} "
                      f"{v['p99_ms']:>8} {v['speedup_p50']:>8} {v['top10_overlap_vs_exhaustive']:>9} "
                      f"{v['top1_agreement']:>5}")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
