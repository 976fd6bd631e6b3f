"""Issue 13's benchmark, part of bench/index.py (``--fde``): MUVERA FDE vs mean-pooled companions
as the candidate source of ``two_stage`` search, on real MiniLM states (read from the embedding
cache of bench/scifact_data.py; the long documents are encoded once into the same cache).

1. SciFact test, full corpus: for ``tokens`` and ``cluster:pool_factor=4`` collections, candidates
   from ``mean`` and from ``fde`` (FDEs of all token states; for ``cluster``, also FDEs of the
   collection's own clustered vectors) at N = 20/50/100/200: recall of the exhaustive MaxSim
   top-10 and nDCG@10 after the exact MaxSim rerank; p50/p99 per query at N = 100.
2. Synthetic long documents (app.evaluation.synthetic_long, K = 16) with ``tokens:window=true``:
   the ``mean`` companion sees the first window only, the FDE every window's tokens; N = 10% of
   the corpus and 20/50/100.
3. A parameter sweep of the FDE (k_sim, dim_proj, reps): Spearman with MaxSim per query, SciFact
   recall at N = 100 and long-document nDCG@10 at N = 10%: where the defaults come from.

    flock /tmp/embedpool-bench.lock .venv/bin/python bench/index.py --fde
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from embedpool.app.tables import render_table
from embedpool.index import FaissCollection, CollectionSpec, delete_collection
from embedpool.poolers import build_pooler

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
FDE_CANDIDATES = (20, 50, 100, 200)
LONG_K = 16
SWEEP = ((4, 32, 10), (3, 32, 20), (3, 64, 20), (2, 64, 20), (4, 64, 10), (5, 32, 10), (4, 32, 20))


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def fde_vectors(spec: str, sets: list[np.ndarray], role: str) -> np.ndarray:
    """FDEs as the pipeline stores them (L2-normalized), from already pooled vector sets."""
    pooler = build_pooler(spec)
    return unit(np.concatenate([pooler.encode_sets(sets[s:s + 256], role) for s in range(0, len(sets), 256)]))


def _multi(root: Path, name: str, pooler: str, sets: list[np.ndarray], ids: list[str],
           companion: tuple[str, np.ndarray] | None = None) -> FaissCollection:
    """A multi-vector collection of ``sets``; ``companion``: the ``(pooler spec, [n, d] vectors)``
    it keeps for two_stage candidates."""
    comp = {} if companion is None else {"companion_pooler": companion[0], "companion_dim": companion[1].shape[1]}
    c = FaissCollection.create(root, name, CollectionSpec(kind="multi", model=MODEL, pooler=pooler, dim=384, **comp))
    for s in range(0, len(ids), 500):
        c.add(ids[s:s + 500], sets[s:s + 500], companion=None if companion is None else companion[1][s:s + 500])
    c.commit()
    return c


def _two_stage(root: Path, pooler: str, sets: list[np.ndarray], ids: list[str], companion: tuple[str, np.ndarray],
               run):
    """``run(coll)`` on the documents in a collection keeping ``companion``, deleted afterwards."""
    coll = _multi(root, "two-stage", pooler, sets, ids, companion)
    try:
        return run(coll)
    finally:
        coll.close()
        delete_collection(root, "two-stage")


def _pct(ms: list[float]) -> dict[str, float]:
    return {"p50_ms": round(float(np.percentile(ms, 50)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 2)}


def candidates_table(root: Path, coll, sets, ids, qids, q_tokens, qrels, companions: dict, ns, latency_queries: int,
                     ndcg10) -> dict:
    """Exhaustive MaxSim (``coll``), then two_stage per companion and N: recall of the exhaustive
    top-10 and nDCG@10; latency one query per call at the N closest to 100. ``companions``: name ->
    (pooler spec, the documents' vectors, the queries'); each is kept by a collection of ``sets``."""
    exact = {}
    for s in range(0, len(qids), 50):
        exact.update(zip(qids[s:s + 50], coll.search(q_tokens[s:s + 50], k=10)))
    out = {"exhaustive_ndcg@10": ndcg10(qrels, exact), "companions": {}}
    n_lat = min(ns, key=lambda n: abs(n - 100))

    def table(two, cq) -> dict:
        rows = {}
        for n in ns:
            hits = {}
            for s in range(0, len(qids), 50):
                hits.update(zip(qids[s:s + 50], two.search(q_tokens[s:s + 50], k=10, mode="two_stage",
                                                           candidates=n, companion_queries=cq[s:s + 50])))
            rec = np.mean([len({h.id for h in hits[q]} & {h.id for h in exact[q]}) / max(len(exact[q]), 1)
                           for q in qids])
            rows[n] = {"recall_of_exhaustive_top10": round(float(rec), 4), "ndcg@10": ndcg10(qrels, hits)}
        lat = []
        for i in range(min(latency_queries, len(qids))):
            t0 = time.perf_counter()
            two.search([q_tokens[i]], k=10, mode="two_stage", candidates=n_lat, companion_queries=cq[i:i + 1])
            lat.append(1000 * (time.perf_counter() - t0))
        rows["latency"] = {"candidates": n_lat, **_pct(lat)}
        return rows

    for cname, (spec, docs, cq) in companions.items():
        out["companions"][cname] = _two_stage(root, coll.spec.pooler, sets, ids, (spec, docs),
                                              lambda two, cq=cq: table(two, cq))
    return out


def spearman_per_query(q_sets, d_sets, qf, df) -> tuple[float, float]:
    """Mean over queries of Spearman(<FDE(q), FDE(d)>, MaxSim(q, d)) across the documents, and
    Spearman over all pairs pooled."""
    from scipy.stats import spearmanr

    x = np.concatenate(d_sets)
    offs = np.cumsum([0] + [len(d) for d in d_sets])[:-1]
    ms = np.stack([np.maximum.reduceat(q @ x.T, offs, axis=1).sum(0) for q in q_sets])
    approx = qf @ df.T
    per = float(np.mean([spearmanr(m, a).statistic for m, a in zip(ms, approx)]))
    return round(per, 4), round(float(spearmanr(ms.ravel(), approx.ravel()).statistic), 4)


def long_documents(sd, cache, log, n_queries: int = 100, distractors: int = LONG_K) -> tuple:
    """The synthetic long documents of SciFact (K distractors, seed 0, 100 queries), windowed
    token vectors and first-window mean vectors from the cache (encoded by the first run)."""
    from embedpool.app.evaluation import load_beir, synthetic_long

    data = synthetic_long(load_beir(sd.SCIFACT), distractors, n_queries=n_queries, seed=0)
    ids, texts = [r.id for r in data.corpus], [r.text for r in data.corpus]
    log(f"synthetic long documents K={distractors}: {len(ids)} documents, {len(data.qrels)} queries")
    got = cache.embed(f"scifact-long{distractors}" + (f"-q{n_queries}" if n_queries != 100 else ""), ids, texts, ("tokens:window=true", "mean"), "document")
    return data, ids, got["tokens:window=true"], np.stack(got["mean"])


def bench_fde(root: Path, sf, cache, ndcg10, latency_queries: int, sweep: bool, fde_spec: str | None = None,
              long: tuple[int, int] = (100, LONG_K), log=print) -> dict:
    """``sf``/``cache``: SciFact and the embedding cache (bench/scifact_data.py); ``ndcg10``: the
    ranx nDCG@10 of bench/index.py. With ``sweep`` the FDE parameters are swept first and the
    tables use the best setting (:func:`choose`) unless ``fde_spec`` names one."""
    import scifact_data as sd

    qids = sf.query_ids
    q = sd.scifact_queries(sf, cache)
    q_tokens, q_mean = q["tokens"], np.stack(q["mean"])
    d = sd.scifact_docs(sf, cache, ("tokens", "mean", "cluster:pool_factor=4"))
    data, lids, ltok, lmean = long_documents(sd, cache, log, *long)
    pos = {qq: j for j, qq in enumerate(sf.all_query_ids)}
    allq = sd.scifact_queries(sd.load_scifact(None), cache)  # every test query, in all_query_ids order
    lq = list(data.qrels)
    lq_tokens = [allq["tokens"][pos[x]] for x in lq]
    lq_mean = np.stack([allq["mean"][pos[x]] for x in lq])
    n10 = max(1, round(0.1 * len(lids)))
    colls = {p: _multi(root, "m-" + p.replace(":", "-").replace("=", "-"), p, d[p], sf.doc_ids)
             for p in ("tokens", "cluster:pool_factor=4")}
    long_coll = _multi(root, "m-long", "tokens:window=true", ltok, lids)
    out = {"documents": len(sf.doc_ids), "queries": len(qids), "scifact": {}}
    if sweep:
        out["sweep"] = fde_sweep(root, sf, q_tokens, d, colls["tokens"], long_coll, lids, ltok, lq, lq_tokens,
                                 data.qrels, n10, ndcg10, log)
    fde_spec = build_pooler(fde_spec or (choose(out["sweep"]) if sweep else "fde")).spec
    q_fde = fde_vectors(fde_spec, q_tokens, "query")
    t0 = time.perf_counter()
    fde_tokens = fde_vectors(fde_spec, d["tokens"], "document")
    fde_seconds = time.perf_counter() - t0
    out.update(fde=fde_spec, fde_dim=int(q_fde.shape[1]),
               fde_encode_docs_per_s=round(len(sf.doc_ids) / fde_seconds, 1))
    fde_c = fde_vectors(fde_spec, d["cluster:pool_factor=4"], "document")
    for pooler, coll in colls.items():
        comps = {"mean": ("mean", np.stack(d["mean"]), q_mean), "fde (all tokens)": (fde_spec, fde_tokens, q_fde)}
        if pooler != "tokens":
            comps["fde (clustered vectors)"] = (fde_spec, fde_c, q_fde)
        out["scifact"][pooler] = candidates_table(root, coll, d[pooler], sf.doc_ids, qids, q_tokens, sf.qrels, comps,
                                                  FDE_CANDIDATES, latency_queries, ndcg10)
        log(f"scifact {pooler}: {out['scifact'][pooler]}")
        coll.close()

    long_ns = tuple(sorted({n10, 20, 50, 100} - {n for n in (20, 50, 100) if n >= len(lids)}))
    lfde_spec = build_pooler(fde_spec.replace("window=false", "window=true")).spec
    out["long"] = {"distractors": long[1], "documents": len(lids), "queries": len(lq), "n_10pct": n10,
                   "tokens_per_doc": round(float(np.mean([len(t) for t in ltok])), 1),
                   **candidates_table(root, long_coll, ltok, lids, lq, lq_tokens, data.qrels,
                                      {"mean (first window)": ("mean", lmean, lq_mean),
                                       "fde (all windows)": (lfde_spec, fde_vectors(lfde_spec, ltok, "document"),
                                                             fde_vectors(lfde_spec, lq_tokens, "query"))},
                                      long_ns, latency_queries, ndcg10)}
    log(f"long: {out['long']}")
    long_coll.close()
    out["targets"] = fde_targets(out)
    return out


def choose(rows: list[dict]) -> str:
    """The sweep's pick: among settings whose inner product tracks MaxSim (Spearman per query
    >= 0.8), the best SciFact nDCG@10 (N = 100) plus long-document nDCG@10 (N = 10%); ties: fewer
    dimensions. Without such a setting, the best Spearman."""
    ok = [r for r in rows if r["spearman_per_query"] >= 0.8]
    best = (max(ok, key=lambda r: (round(r["scifact_ndcg@10_N100"] + r["long_ndcg@10_N10pct"], 3), -r["dim"]))
            if ok else max(rows, key=lambda r: r["spearman_per_query"]))
    return f"fde:k_sim={best['k_sim']},dim_proj={best['dim_proj']},reps={best['reps']}"


def fde_sweep(root, sf, q_tokens, d, tok, long_coll, lids, ltok, lq, lq_tokens, lqrels, n10, ndcg10,
              log) -> list[dict]:
    """Per FDE setting: Spearman with MaxSim (100 queries x 500 documents), SciFact ``tokens``
    recall of the exhaustive top-10 and nDCG@10 at N = 100, long-document nDCG@10 at N = 10%."""
    exact = {}
    for s in range(0, len(sf.query_ids), 50):
        exact.update(zip(sf.query_ids[s:s + 50], [[h.id for h in r] for r in tok.search(q_tokens[s:s + 50], k=10)]))
    rows = []
    for k, dp, reps in SWEEP:
        spec = build_pooler(f"fde:k_sim={k},dim_proj={dp},reps={reps}").spec
        qf = fde_vectors(spec, q_tokens, "query")
        t0 = time.perf_counter()
        df = fde_vectors(spec, d["tokens"], "document")
        secs = time.perf_counter() - t0
        per, pooled = spearman_per_query(q_tokens[:100], d["tokens"][:500], qf[:100], df[:500])
        hits = _two_stage(root, tok.spec.pooler, d["tokens"], sf.doc_ids, (spec, df), lambda two: {
            q: h for s in range(0, len(sf.query_ids), 50)
            for q, h in zip(sf.query_ids[s:s + 50], two.search(q_tokens[s:s + 50], k=10, mode="two_stage",
                                                               candidates=100, companion_queries=qf[s:s + 50]))})
        rec = np.mean([len({h.id for h in hits[x]} & set(exact[x])) / 10 for x in sf.query_ids])
        lspec = build_pooler(f"fde:k_sim={k},dim_proj={dp},reps={reps},window=true").spec
        lqf = fde_vectors(lspec, lq_tokens, "query")
        lh = _two_stage(root, long_coll.spec.pooler, ltok, lids, (lspec, fde_vectors(lspec, ltok, "document")),
                        lambda two: dict(zip(lq, two.search(lq_tokens, k=10, mode="two_stage", candidates=n10,
                                                            companion_queries=lqf))))
        rows.append({"k_sim": k, "dim_proj": dp, "reps": reps, "dim": reps * 2 ** k * dp,
                     "spearman_per_query": per, "spearman_pooled": pooled,
                     "scifact_recall@100": round(float(rec), 4), "scifact_ndcg@10_N100": ndcg10(sf.qrels, hits),
                     "long_ndcg@10_N10pct": ndcg10(lqrels, lh), "docs_per_s": round(len(df) / secs, 1)})
        log(f"sweep {rows[-1]}")
    return rows


def fde_targets(out: dict) -> dict:
    """Issue 13's FDE targets."""
    t = {}
    for pooler, r in out["scifact"].items():
        ex = r["exhaustive_ndcg@10"]
        got = r["companions"]["fde (all tokens)"][100]["ndcg@10"]
        t[f"scifact {pooler}: fde N=100 >= 99% of exhaustive"] = {
            "met": got >= 0.99 * ex, "value": got, "exhaustive": ex, "ratio": round(got / ex, 4)}
    lo = out["long"]
    ex, n = lo["exhaustive_ndcg@10"], lo["n_10pct"]
    f, m = lo["companions"]["fde (all windows)"][n]["ndcg@10"], lo["companions"]["mean (first window)"][n]["ndcg@10"]
    t[f"long K={lo['distractors']}: fde at N=10% >= 95% of exhaustive"] = {"met": f >= 0.95 * ex, "value": f, "exhaustive": ex,
                                                         "ratio": round(f / ex, 4)}
    t[f"long K={lo['distractors']}: fde beats mean by >= 5 points at N=10%"] = {"met": f - m >= 0.05, "fde": f, "mean": m,
                                                              "points": round(100 * (f - m), 2)}
    return t


def md_table(header: list[str], rows: list[list]) -> str:
    return render_table(header, rows, markdown=True)


def fde_markdown(out: dict) -> str:
    """The tables for the README."""

    lines = [f"FDE `{out['fde']}` ({out['fde_dim']:,} dims, {out['fde_encode_docs_per_s']} docs/s from cached "
             f"token vectors); SciFact test, {out['documents']:,} documents, {out['queries']} queries; "
             "cells: recall of the exhaustive MaxSim top-10 / nDCG@10 after the exact rerank.", ""]
    for title, r, ns in [(f"`{p}`", v, FDE_CANDIDATES) for p, v in out["scifact"].items()] + [
            (f"`tokens:window=true`, synthetic long documents K={out['long']['distractors']} "
             f"({out['long']['documents']} documents, ~{out['long']['tokens_per_doc']:,.0f} tokens each, "
             f"{out['long']['queries']} queries; N = {out['long']['n_10pct']} is 10%)",
             out["long"], [n for n in out["long"]["companions"][next(iter(out["long"]["companions"]))]
                           if n != "latency"])]:
        rows = [[c] + [f"{v[n]['recall_of_exhaustive_top10']:.3f} / {v[n]['ndcg@10']:.4f}" for n in ns]
                + [f"{v['latency']['p50_ms']} / {v['latency']['p99_ms']}"] for c, v in r["companions"].items()]
        lines += [f"{title}: exhaustive nDCG@10 {r['exhaustive_ndcg@10']:.4f}", "",
                  md_table(["candidates from"] + [f"N={n}" for n in ns]
                           + [f"p50 / p99 ms (N={r['companions'][next(iter(r['companions']))]['latency']['candidates']})"],
                           rows), ""]
    if out.get("sweep"):
        lines += ["FDE parameter sweep (`tokens`; Spearman over 100 queries x 500 documents):", "",
                  md_table(["k_sim", "dim_proj", "reps", "dims", "Spearman per query / pooled",
                            "SciFact recall@N=100", "SciFact nDCG@10 N=100", "long nDCG@10 N=10%", "docs/s"],
                           [[r["k_sim"], r["dim_proj"], r["reps"], f"{r['dim']:,}",
                             f"{r['spearman_per_query']:.3f} / {r['spearman_pooled']:.3f}",
                             f"{r['scifact_recall@100']:.3f}", f"{r['scifact_ndcg@10_N100']:.4f}",
                             f"{r['long_ndcg@10_N10pct']:.4f}", r["docs_per_s"]] for r in out["sweep"]]), ""]
    lines += ["Targets:"] + [f"- {k}: **{'met' if v['met'] else 'missed'}** "
                             f"({', '.join(f'{a} {b}' for a, b in v.items() if a != 'met')})"
                             for k, v in out["targets"].items()]
    return "\n".join(lines)
