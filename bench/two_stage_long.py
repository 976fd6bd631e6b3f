"""Two-stage search on long documents: per-window companion rows against one companion vector
per document, each against exhaustive MaxSim, in one run.

The corpus is ``embedpool eval --synthetic-long``'s (app/evaluation/long.py): 100 sampled SciFact
test queries, each relevant abstract hidden among ``K`` (default 16) others in one long document,
as many haystack-only documents. It is embedded once -- one forward pass of the windowed plan
serves every pooler below, cut in token-budget calls as the indexing job cuts them
(``app.indexing.token_calls``) -- and written into one collection per (multi-vector pooler,
companion): ``tokens:window=true`` and ``cluster:pool_factor=4,window=true``, int8, each with

- ``mean:per_window=true``  one mean row per window of a document (the default companion of a
  windowing pooler),
- ``fde:per_window=true``   one MUVERA FDE row per window,
- ``fde:window=true``       one FDE per document over all its windows (the companion before),
- ``mean``                  one mean per document (its first window: the standard plan).

Queries go through the one retrieval path (``app.retrieval.Search``); metrics come from ranx
(``app.evaluation.scoring``). Reported per collection: nDCG@10 exhaustive and two_stage at
``--candidates`` (default 5% and 10% of the corpus), their ratio, and the search p50 of one
query at a time (first 32 queries). Targets (issue 21): two_stage >= 95% of exhaustive nDCG@10
at candidates <= 10% of the corpus, p50 <= 100 ms.

    flock /tmp/embedpool-bench.lock .venv/bin/python bench/two_stage_long.py      # ~20 min on 2 cores
    .venv/bin/python bench/two_stage_long.py --max-queries 10 --distractors 2     # a smoke run

Writes ``bench/results/two_stage_long.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
DATA = (HERE.parent / ".." / "shared" / "data" / "scifact").resolve()
RESULTS = HERE / "results" / "two_stage_long.json"
POOLERS = ("tokens:window=true", "cluster:pool_factor=4,window=true")
COMPANIONS = ("mean:per_window=true", "fde:per_window=true", "fde:window=true", "mean")
TARGET_RATIO, TARGET_P50_MS, TARGET_CANDIDATES = 0.95, 100.0, 0.10


def build(embedder, corpus, root: Path, specs: list[str], log) -> dict[tuple[str, str], object]:
    """One collection per (pooler, companion), all from one pass over the corpus."""
    from embedpool.app.indexing import BATCH_TOKENS, embed_records, token_calls
    from embedpool.app.retrieval import resolve_companion_pooler
    from embedpool.index import FaissCollection, CollectionSpec

    colls = {}
    for p in POOLERS:
        for c in COMPANIONS:
            cspec, rows = resolve_companion_pooler(embedder, p, c)
            spec = CollectionSpec(kind="multi", model=embedder.model_id, pooler=embedder.canonical(p),
                                  dim=embedder.dim, precision="int8", companion_pooler=cspec,
                                  companion_rows=rows, companion_dim=embedder.output_dim(cspec))
            colls[(p, c)] = FaissCollection.create(root, f"c{len(colls)}", spec)
    t0 = time.perf_counter()
    done = 0
    for call in token_calls(embedder, enumerate(corpus), specs, batch_tokens=BATCH_TOKENS, batch_docs=256):
        block = embed_records(embedder, call, call[-1].pos + 1, call[-1].record.id, specs)
        for (p, c), coll in colls.items():
            cspec = coll.spec.companion_pooler
            coll.add(block.ids, block.vectors[embedder.canonical(p)], companion=block.vectors[cspec])
            coll.commit()
        done += len(call)
        log(f"  {done}/{len(corpus)} documents, {time.perf_counter() - t0:.0f} s")
    return colls


def run_search(embedder, search, qids, texts, vectors, latency_queries: int) -> tuple[dict, list[float]]:
    """The run of ``search`` on every query (batched) and one-query search times."""
    lat = []
    for i in range(min(latency_queries, len(qids))):
        t = time.perf_counter()
        search.run(vectors, [i])
        lat.append(1000 * (time.perf_counter() - t))
    run = {}
    for b in range(0, len(qids), 64):
        rows = list(range(b, min(b + 64, len(qids))))
        for i, hits in zip(rows, search.run(vectors, rows)):
            run[qids[i]] = {h.id: float(h.score) for h in hits}
    return run, lat


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--distractors", type=int, default=16)
    ap.add_argument("--max-queries", type=int, default=100)
    ap.add_argument("--candidates", type=float, nargs="+", default=[0.05, 0.10],
                    help="fractions of the corpus (default 5%% and 10%%)")
    ap.add_argument("--latency-queries", type=int, default=32)
    ap.add_argument("--precision", default=os.environ.get("EMBEDPOOL_PRECISION", "auto"))
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    from scale import machine

    from embedpool.app.datasets import load_beir
    from embedpool.app.evaluation.long import synthetic_long
    from embedpool.app.evaluation.scoring import score_runs
    from embedpool.app.retrieval import Search, embed_texts
    from embedpool.poolers import Embedder, FrozenEncoder

    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    mach = machine()
    log(f"CPU {mach['cpu']}: {' '.join(mach['cpu_flags'])}; torch {mach['torch_cpu_capability']}; "
        f"load {mach['loadavg_start']}")
    data = synthetic_long(load_beir(DATA, "test"), args.distractors, n_queries=args.max_queries, seed=0)
    embedder = Embedder(FrozenEncoder(precision=args.precision))
    specs = list(dict.fromkeys([embedder.canonical(p) for p in POOLERS]
                               + [embedder.canonical(c) for c in COMPANIONS]))
    qids = list(data.qrels)
    texts = [data.queries[q] for q in qids]
    n_docs = len(data.corpus)
    log(f"K={args.distractors}: {n_docs} documents, {len(qids)} queries; encoder {embedder.encoder.precision}")
    out = {"machine": mach, "distractors": args.distractors, "documents": n_docs, "queries": len(qids),
           "encoder_precision": embedder.encoder.precision, "rows": []}
    with tempfile.TemporaryDirectory(prefix="embedpool-two-stage-") as tmp:
        t0 = time.perf_counter()
        colls = build(embedder, data.corpus, Path(tmp), specs, log)
        out["index_s"] = round(time.perf_counter() - t0, 1)
        runs, rows = {}, []
        for (p, c), coll in colls.items():
            searches = {"exhaustive": Search(coll, embedder.dim, k=100, mode="exhaustive")}
            for f in args.candidates:
                n = max(1, round(f * n_docs))
                searches[f"two_stage@{n}"] = Search(coll, embedder.dim, k=100, mode="two_stage", candidates=n)
            vectors, _ = embed_texts(embedder.embed, texts, [e for s in searches.values() for e in s.embeddings()])
            st = coll.stats()
            for mode, search in searches.items():
                label = f"{p} | {c} | {mode}"
                runs[label], lat = run_search(embedder, search, qids, texts, vectors, args.latency_queries)
                rows.append({"label": label, "pooler": p, "companion": c, "mode": mode,
                             "candidates": search.candidates if mode != "exhaustive" else None,
                             "companion_rows_per_doc": st["companion_rows"] / max(st["documents"], 1),
                             "search_p50_ms": statistics.median(lat), "search_mean_ms": statistics.fmean(lat)})
            coll.close()
        scores = score_runs(data.qrels, runs)
    for r in rows:
        r["ndcg@10"] = scores[r["label"]]["metrics"]["ndcg@10"]
        r["recall@100"] = scores[r["label"]]["metrics"]["recall@100"]
    for r in rows:
        base = next(x for x in rows if x["pooler"] == r["pooler"] and x["companion"] == r["companion"]
                    and x["mode"] == "exhaustive")
        r["ratio"] = r["ndcg@10"] / base["ndcg@10"] if base["ndcg@10"] else None
        judged = r["mode"] != "exhaustive" and r["candidates"] <= TARGET_CANDIDATES * n_docs
        r["target"] = (r["ratio"] >= TARGET_RATIO and r["search_p50_ms"] <= TARGET_P50_MS) if judged else None
    out["rows"] = rows
    out["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(table(out))
    return 0


def table(out: dict) -> str:
    from embedpool.app.tables import render_table

    rows = [[r["pooler"], r["companion"], f"{r['companion_rows_per_doc']:.1f}", r["mode"], f"{r['ndcg@10']:.4f}",
             f"{r['ratio']:.3f}", f"{r['search_p50_ms']:.1f}",
             "" if r["target"] is None else ("met" if r["target"] else "missed")] for r in out["rows"]]
    return "\n".join([f"K={out['distractors']}: {out['documents']} documents, {out['queries']} queries, encoder "
                      f"{out['encoder_precision']}; CPU flags {' '.join(out['machine']['cpu_flags'])}", "",
                      render_table(["pooler", "companion pooler", "rows/doc", "mode", "nDCG@10", "vs exhaustive",
                                    "p50 ms", "target"], rows, markdown=True)])


if __name__ == "__main__":
    sys.exit(main())
