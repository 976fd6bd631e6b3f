"""Read latency of a real Milvus server by read consistency (``EMBEDPOOL_MILVUS_CONSISTENCY``),
side by side in one run.

``bench/milvus_server.py`` found a real Milvus 2.3 server 21x slower than FAISS per HTTP search,
and a point query 195-407 ms at ``Strong`` against 2-3 ms at ``Bounded``: a strong read waits
for the server's time tick. This measures what the setting changes, in the index layer (no
encoder, no HTTP, so the figures are the reads alone):

1. A real Milvus standalone server starts (tests/milvus_testutil.py).
2. One single-vector collection of ``--docs`` random unit vectors (384 dimensions, a short text
   each) is written through embedpool.
3. One collection object per level (Strong, Session, Bounded, Eventually) on it; the levels take
   turns, one read each, ``--reads`` rounds: a search (one query vector, k=10) and a get by id.
   p50/p99 ms per level and read kind, the ratio to Strong, and whether every level returned
   Strong's top 10 for every query.

    flock /work/locks/cpu.lock .venv/bin/python bench/milvus_reads.py [--docs N] [--reads N]

Writes ``bench/results/milvus_reads.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from milvus_testutil import MilvusServer  # noqa: E402
from scale import machine  # noqa: E402

DIM, K = 384, 10


def pct(xs: list[float], p: float) -> float:
    return round(float(np.percentile(xs, p)), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=5183, help="documents in the collection (SciFact's count)")
    ap.add_argument("--reads", type=int, default=100, help="searches and gets per level")
    ap.add_argument("--out", default=str(HERE / "results" / "milvus_reads.json"))
    args = ap.parse_args()

    from embedpool.index import READ_CONSISTENCY, CollectionSpec, open_collection
    from embedpool.index.milvus.versions import features_of

    m = machine()
    print(f"machine: {m['cpu']} x{m['cpus']} {' '.join(m['cpu_flags'])}; load {m['loadavg_start']}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-milvus-reads-"))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.docs, DIM)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    ids = [f"d{i}" for i in range(args.docs)]
    out: dict = {"machine": m, "docs": args.docs, "reads": args.reads, "k": K}
    with MilvusServer(work / "milvus") as srv:
        out["server"] = features_of(srv.version()).name
        where = {"backend": "milvus", "milvus_uri": srv.uri}
        spec = CollectionSpec(kind="single", model="random", pooler="mean", dim=DIM)
        with open_collection(work, "reads", spec, **where) as coll:
            for a in range(0, args.docs, 1024):
                coll.add(ids[a:a + 1024], x[a:a + 1024], texts=[f"text of {i}" for i in ids[a:a + 1024]])
            coll.commit()
        colls = {lvl: open_collection(work, "reads", **where, milvus_consistency=lvl) for lvl in READ_CONSISTENCY}
        times = {lvl: {"search": [], "get": []} for lvl in READ_CONSISTENCY}
        same = dict.fromkeys(READ_CONSISTENCY, 0)
        try:
            for r in range(args.reads):
                q = x[rng.integers(args.docs)][None] + 0.05 * rng.standard_normal((1, DIM)).astype(np.float32)
                doc = ids[rng.integers(args.docs)]
                order = list(READ_CONSISTENCY[r % 4:] + READ_CONSISTENCY[:r % 4])  # rotate who goes first
                tops = {}
                for lvl in order:
                    t = time.perf_counter()
                    tops[lvl] = [h.id for h in colls[lvl].search(q, k=K)[0]]
                    times[lvl]["search"].append((time.perf_counter() - t) * 1e3)
                    t = time.perf_counter()
                    colls[lvl].get(doc)
                    times[lvl]["get"].append((time.perf_counter() - t) * 1e3)
                for lvl in READ_CONSISTENCY:
                    same[lvl] += tops[lvl] == tops["Strong"]
        finally:
            for c in colls.values():
                c.close()
    m["loadavg_end"] = __import__("os").getloadavg()
    rows = {lvl: {kind: {"p50_ms": pct(v, 50), "p99_ms": pct(v, 99)} for kind, v in times[lvl].items()}
            for lvl in READ_CONSISTENCY}
    for lvl in READ_CONSISTENCY:
        rows[lvl]["same_top10_as_strong"] = same[lvl]
        for kind in ("search", "get"):
            rows[lvl][kind]["strong_over_this"] = round(rows["Strong"][kind]["p50_ms"] / rows[lvl][kind]["p50_ms"], 1)
    out["levels"] = rows
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\n{out['server']}, {args.docs} documents x {DIM}, {args.reads} reads per level and kind, k={K}, "
          "in process (no HTTP, no encoder)\n")
    print("| read consistency | search p50 / p99 ms | Strong ÷ this (search p50) | get p50 / p99 ms "
          "| Strong ÷ this (get p50) | same top 10 as Strong |")
    print("|---|---:|---:|---:|---:|---:|")
    for lvl, r in rows.items():
        s, g = r["search"], r["get"]
        print(f"| {lvl} | {s['p50_ms']} / {s['p99_ms']} | {s['strong_over_this']}x | {g['p50_ms']} / {g['p99_ms']} "
              f"| {g['strong_over_this']}x | {r['same_top10_as_strong']}/{args.reads} |")
    print(f"\nload average {m['loadavg_start'][0]:.2f} at start, {m['loadavg_end'][0]:.2f} at end")


if __name__ == "__main__":
    main()
