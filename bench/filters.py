"""Filtered search latency at 1%, 10% and 100% selectivity on 100k and 1M documents (issue 33).

Vectors are ``bench/million.py``'s (real SciFact documents pooled by the real model, recombined
by ``tests/synthetic_corpus.py``; run ``bench/million.py encode`` once), with synthetic metadata:
document ``j`` has ``{"tenant": "t<j % 100>", "group": j % 10, "year": 2000 + j % 25}``, so
``{"tenant": "t7"}`` keeps 1%, ``{"group": 3}`` 10% and ``{"year": {"$gte": 2000}}`` 100%.
Queries are the real SciFact test queries (``mean``), one per call, ``k = 10``.

Layouts, each grown through the public interface (``open_collection``, ``add``, ``commit``)
to each size of ``--sizes``:

- ``single``: the ``mean`` vectors in ``--factory`` (default ``IVF1024,SQ8``, as million.py);
- ``multi`` (``--layout multi``): int8 token vectors + ``mean`` companion rows, searched
  ``two_stage`` (100 candidates).

Per size and filter: the p50 latency of a query whose filter was not seen before (the matching
ids are read from the document store: ``cold``) and of one whose filter's ids are cached from
an earlier query (``warm``), against the unfiltered p50 of the same run; and checks that every
hit matches and that ``k`` hits come back.

    flock /work/locks/cpu.lock .venv/bin/python bench/filters.py --sizes 100000 1000000

Writes ``bench/results/filters.json``; docs/storage.md has the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from million import load_sources, machine, rss_mb, spec_for  # noqa: E402

RESULTS = HERE / "results" / "filters.json"
FILTERS = {"1%": ({"tenant": "t7"}, lambda j: j % 100 == 7), "10%": ({"group": 3}, lambda j: j % 10 == 3),
           "100%": ({"year": {"$gte": 2000}}, lambda j: True)}


def meta(j: int) -> dict:
    return {"tenant": f"t{j % 100}", "group": j % 10, "year": 2000 + j % 25}


def grow(coll, layout: str, start: int, stop: int, corpus, factory: str) -> float:
    """Append documents ``start .. stop`` (the first add trains the index: FAISS's recommended
    sample size); commit every 100k."""
    from embedpool.index.faiss.single import recommended_training_vectors

    t = time.perf_counter()
    want = max(recommended_training_vectors(factory), 10_000) if start == 0 else 10_000
    buf: list = []
    done = start

    def flush() -> None:
        nonlocal done, buf
        ids = [f"doc{j}" for b in buf for j in range(b.start, b.start + len(b.ids))]
        metas = [meta(int(i[3:])) for i in ids]
        comp = np.concatenate([b.companion for b in buf])
        if layout == "single":
            coll.add(ids, comp, metadata=metas)
        else:
            coll.add(ids, [d for b in buf for d in b.docs], metadata=metas, companion=comp)
        if (done + len(ids)) // 100_000 > done // 100_000:
            coll.commit()
        done += len(ids)
        buf = []

    for b in corpus.batches(stop, keep=lambda nums: nums >= start):
        if not b.ids:
            continue
        buf.append(b)
        if sum(len(x.ids) for x in buf) >= want:
            flush()
            want = 10_000
    if buf:
        flush()
    coll.commit()
    return time.perf_counter() - t


def measure(coll, layout: str, q_mean, q_tokens, n: int, reps: int) -> dict:
    def search(i, flt):
        if layout == "single":
            return coll.search(q_mean[i:i + 1], k=10, filter=flt)[0]
        return coll.search([q_tokens[i]], k=10, mode="two_stage", candidates=100, companion_queries=q_mean[i:i + 1],
                           filter=flt)[0]

    nq = min(reps, len(q_mean))
    out = {}
    lat = []
    for i in range(nq):
        t = time.perf_counter()
        search(i, None)
        lat.append(time.perf_counter() - t)
    out["unfiltered_p50_ms"] = 1000 * statistics.median(lat)
    for name, (flt, pred) in FILTERS.items():
        cold, warm, ok = [], [], True
        for i in range(nq):
            coll._filter_cache.clear()  # a filter not seen before: its ids come from the document store
            t = time.perf_counter()
            hits = search(i, flt)
            cold.append(time.perf_counter() - t)
            ok &= len(hits) == 10 and all(pred(int(h.id[3:])) for h in hits)
        search(0, flt)
        for i in range(nq):
            t = time.perf_counter()
            search(i, flt)
            warm.append(time.perf_counter() - t)
        out[name] = {"cold_p50_ms": 1000 * statistics.median(cold), "warm_p50_ms": 1000 * statistics.median(warm),
                     "k_hits_all_matching": bool(ok)}
        print(f"  {n:>9,} {name:>4}: cold p50 {out[name]['cold_p50_ms']:.1f} ms, warm p50 "
              f"{out[name]['warm_p50_ms']:.1f} ms, unfiltered {out['unfiltered_p50_ms']:.1f} ms, ok={ok}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--layout", choices=["single", "multi"], default="single")
    ap.add_argument("--factory", default="IVF1024,SQ8")
    ap.add_argument("--data", default=str(HERE / ".filters-data"))
    ap.add_argument("--queries", type=int, default=50)
    args = ap.parse_args()
    from embedpool.index import open_collection
    from synthetic_corpus import SyntheticCorpus  # tests/, on the path through million

    docs, q_tokens, q_mean, _, model = load_sources()
    corpus = SyntheticCorpus(docs, seed=0)
    name = f"filters-{args.layout}"
    coll = open_collection(args.data, name, spec_for(args.layout, args.factory, model), backend="faiss")
    results = {"machine": machine(), "layout": args.layout, "factory": args.factory, "sizes": {}}
    if RESULTS.exists():
        old = json.loads(RESULTS.read_text())
        if old.get("layout") == args.layout and old.get("factory") == args.factory:
            results["sizes"] = old.get("sizes", {})
    for n in sorted(args.sizes):
        have = len(coll)
        build = grow(coll, args.layout, have, n, corpus, args.factory) if have < n else None
        if build is not None:
            print(f"grew {name} {have:,} -> {n:,} in {build:.0f}s", flush=True)
        coll.close()
        t = time.perf_counter()
        coll = open_collection(args.data, name, backend="faiss")
        open_s = time.perf_counter() - t
        st = coll.stats()
        row = {"documents": len(coll), "open_s": open_s, "bytes_on_disk": st["bytes_on_disk"], "rss_mb": rss_mb(),
               **({"build_s": build} if build is not None else {}),
               **measure(coll, args.layout, q_mean, q_tokens, n, args.queries)}
        results["sizes"][str(n)] = row
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    coll.close()
    print("| documents | unfiltered p50 ms | 1% cold / warm | 10% cold / warm | 100% cold / warm |")
    print("|---:|---:|---:|---:|---:|")
    for n, r in results["sizes"].items():
        cells = [f"{r[s]['cold_p50_ms']:.1f} / {r[s]['warm_p50_ms']:.1f}" for s in FILTERS]
        print(f"| {int(n):,} | {r['unfiltered_p50_ms']:.1f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
