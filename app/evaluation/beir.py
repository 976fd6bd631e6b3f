"""Retrieval evaluation (BEIR layout) on the same pipeline, collections and retrieval path as
the service.

The corpus is indexed by :class:`app.indexing.IndexJob` (one forward pass per tokenization plan
for every pooler; companion rows -- ``mean``, ``fde``, or their per-window forms -- kept by every
multi-vector collection when one is evaluated with ``two_stage``) into collections in a temporary (or kept) folder; the queries are embedded once
for all of them, each as its collection's manifest says (:mod:`app.retrieval`), and searched
with :meth:`app.retrieval.Search.run` -- the code ``embedpool search`` and the HTTP route run.
There is no second implementation of pooling or search here. Metrics and paired significance
tests come from ``ranx`` (:mod:`app.evaluation.scoring`).

Modes ``bm25`` and ``hybrid`` add the lexical baseline and the fusion beside every pooler: one
``bm25`` row (the collections' lexical index, the same in every collection), and per pooler (per
vector mode of a multi-vector one) a hybrid row per fusion fusing it with BM25 (``fusion``,
``weight``; a ``NAME:tuned`` fusion's weight is chosen on the ``dev`` split's queries and stored
in the collection, :mod:`app.evaluation.fusion`). A hybrid row also carries paired p-values
against its own vector row and against BM25.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embedpool.app.datasets import BeirData
from embedpool.app.timed_embedding import embed_by_plan
from embedpool.app.evaluation.fusion import FusionChoice, parse_fusions, tune_weight
from embedpool.app.evaluation.scoring import METRICS, score_runs
from embedpool.app.indexing import IndexJob
from embedpool.app.retrieval import Embedding, Search, embedding_calls
from embedpool.errors import InvalidError
from embedpool.index import ALL_MODES, SEARCH_MODES, TUNED_PROPERTY, tuned_entry

DEPTH = 100
BM25 = "bm25"


@dataclass
class Variant:
    label: str
    spec: str  # as given
    canonical: str
    mode: str  # one of index.SEARCH_MODES (single-vector: "flat"), or "bm25"
    multi: bool
    hybrid: bool = False  # BM25 fused with this vector variant
    vector: str | None = None  # hybrid: the label of its vector-only variant
    fusion: FusionChoice | None = None  # hybrid: how
    named: bool = False  # hybrid: the fusion is in the label and the mode (several fusions, or a tuned one)


def _variants(embedder, poolers: list[str], modes: list[str],
              fusions: list[FusionChoice] | None = None) -> list[Variant]:
    """Per pooler, a row per vector mode of ``modes`` (one for single-vector poolers; exhaustive
    if ``modes`` names none); with ``hybrid``, the same rows fused with BM25 (one per fusion of
    ``fusions``), after them; with ``bm25``, one BM25 row, first."""
    fusions = fusions or [FusionChoice("rrf")]
    named = len(fusions) > 1 or fusions[0].tuned
    vmodes = [m for m in modes if m in SEARCH_MODES] or ["exhaustive"]
    out, seen = [], set()
    if BM25 in modes:
        out.append(Variant(BM25, BM25, embedder.canonical(poolers[0]), BM25, False))
    hybrids = []
    for p in poolers:
        c = embedder.canonical(p)
        multi = bool(embedder.pooler(c).multi_vector)
        for m in (vmodes if multi else ["flat"]):
            if (c, m) in seen:
                continue
            seen.add((c, m))
            label = f"{p} [{m}]" if multi else p
            out.append(Variant(label, p, c, m, multi))  # hybrid rows are tested against it
            if "hybrid" in modes:
                for f in fusions:
                    how = f"hybrid {m}" if multi else "hybrid"
                    how += f" {f.name}" if named else ""
                    hybrids.append(Variant(f"{p} [{how}]", p, c, m, multi, True, label, f, named))
    return out + hybrids


def _baseline(embedder, variants: list[Variant], baseline: str | None) -> Variant:
    vector = [v for v in variants if v.mode != BM25 and not v.hybrid]
    if baseline is None:
        for v in vector:
            if v.canonical == embedder.canonical("mean"):
                return v
        return vector[0]
    if baseline == BM25:
        for v in variants:
            if v.mode == BM25:
                return v
    c = embedder.canonical(baseline.split(" [")[0])
    mode = baseline.split(" [")[1].rstrip("]") if " [" in baseline else None
    for v in variants:
        if v.canonical == c and (mode is None or v.mode == mode):
            return v
    raise InvalidError(f"--baseline {baseline!r} is not one of the evaluated poolers "
                       f"({', '.join(v.label for v in variants)})", param="--baseline")


# ---------------------------------------------------------------------------------- queries
@dataclass
class QueryVectors:
    """The queries, embedded once per :class:`app.retrieval.Embedding` and kept across the
    corpora of one evaluation (the synthetic-long K values share them).

    Attributes:
        vectors: per embedding, one vector (or ``[m_i, D]`` array) per query.
        seconds: per embedding, the time of all queries (one pass per plan): forward + pooling.
        latency: per embedding, the mean time of one query embedded alone (over the first
            ``latency_queries``), and ``forward`` its plan's shared forward part.
    """

    qids: list[str]
    texts: list[str]
    latency_queries: int = 32
    vectors: dict[Embedding, list] = field(default_factory=dict)
    seconds: dict[Embedding, float] = field(default_factory=dict)
    latency: dict[Embedding, float] = field(default_factory=dict)
    forward: dict[Embedding, float] = field(default_factory=dict)

    def ensure(self, embedder, embeddings: list[Embedding]) -> None:
        """Embed the queries for every embedding not done yet."""
        missing = [e for e in dict.fromkeys(embeddings) if e not in self.vectors]
        for opts, poolers in embedding_calls(missing):
            done = embed_by_plan(embedder, self.texts, poolers, opts)
            lat: dict[str, list[float]] = {}
            fwd: dict[str, list[float]] = {}
            for t in self.texts[: self.latency_queries]:
                one = embed_by_plan(embedder, [t], poolers, opts)
                for p in poolers:
                    lat.setdefault(p, []).append(one.seconds[p])
                    fwd.setdefault(p, []).append(one.forward[p])
            for p in poolers:
                e = Embedding(p, opts)
                self.vectors[e], self.seconds[e] = done.vectors[p], done.seconds[p]
                self.latency[e] = statistics.fmean(lat[p]) if lat else 0.0
                self.forward[e] = statistics.fmean(fwd[p]) if fwd else 0.0

    def single_query_seconds(self, embedder, search: Search) -> float:
        """Embedding one query alone for ``search``: its plan's forward and its pooling, plus
        the companion's pooling (and forward, unless it comes from the same pass); 0 for BM25."""
        main, comp = search.query, search.companion_query
        if main is None:
            return 0.0
        if comp is None:
            return self.latency[main]
        same_pass = (comp.options == main.options
                     and embedder.pooler(comp.pooler).plan == embedder.pooler(main.pooler).plan)
        return self.latency[main] + self.latency[comp] - (self.forward[comp] if same_pass else 0.0)


# ---------------------------------------------------------------------------------- evaluation
def _check(poolers: list[str], modes) -> list[str]:
    modes = list(dict.fromkeys(modes))
    for m in modes:
        if m not in ALL_MODES:
            raise InvalidError(f"unknown mode {m!r}; use one of {', '.join(ALL_MODES)}", param="--mode")
    if not poolers:
        raise InvalidError("give at least one --pooler", param="--pooler")
    return modes


def _searches(job: IndexJob, variants: list[Variant], model_dim, candidates: int,
              k_token: int, weights: dict[str, float]) -> dict[str, Search]:
    def search(v: Variant) -> Search:
        vmode = v.mode if v.multi else "exhaustive"
        mode = BM25 if v.mode == BM25 else "hybrid" if v.hybrid else vmode
        return Search(job.targets[v.canonical].coll, model_dim, k=DEPTH, mode=mode, candidates=candidates,
                      k_token=k_token, vector_mode=vmode, fusion=v.fusion.fusion if v.fusion else "rrf",
                      weight=weights.get(v.label, 0.5))

    return {v.label: search(v) for v in variants}


def _run(search: Search, queries: QueryVectors, latency_queries: int) -> tuple[dict, list[float]]:
    """The run (``{qid: {doc: score}}``, batched calls) and one-query-per-call search times."""
    lat = []
    for i in range(min(latency_queries, len(queries.qids))):
        s = time.perf_counter()
        search.run(queries.vectors, [i], texts=queries.texts)
        lat.append(time.perf_counter() - s)
    run: dict[str, dict[str, float]] = {}
    for b in range(0, len(queries.qids), 64):
        rows = list(range(b, min(b + 64, len(queries.qids))))
        for i, hits in zip(rows, search.run(queries.vectors, rows, texts=queries.texts)):
            run[queries.qids[i]] = {h.id: float(h.score) for h in hits}
    return run, lat


def _row(v: Variant, search: Search, encode_s: float, queries: QueryVectors, embedder,
         lat: list[float], tuned: dict | None = None) -> dict[str, Any]:
    st = search.collection.stats()
    bpd = float(st["bytes_per_doc"]) if search.query is not None else None  # BM25: its index is not counted
    enc_q = queries.seconds[search.query] if search.query is not None else 0.0
    if search.companion_query is not None:  # bytes_per_doc of a multi-vector collection counts its companion rows
        enc_q += queries.seconds[search.companion_query]
    lexical = v.mode == BM25
    row = {"pooler": BM25 if lexical else v.spec,
           "mode": BM25 if lexical else (f"hybrid {v.mode}" if v.multi else "hybrid") if v.hybrid
           else v.mode if v.multi else None, "label": v.label,
           "kind": "lexical" if lexical else "multi" if v.multi else "single", "documents": st["documents"],
           "vectors": None if lexical else st["vectors"],
           "vectors_per_doc": None if lexical else st["vectors"] / max(st["documents"], 1),
           "bytes_per_doc": bpd, "encode_s": round(encode_s, 3),
           "query_encode_ms": 1000 * enc_q / max(len(queries.qids), 1),
           "query_encode_single_ms": 1000 * queries.single_query_seconds(embedder, search),
           "search_ms": 1000 * statistics.fmean(lat) if lat else None,
           "search_p50_ms": 1000 * statistics.median(lat) if lat else None}
    row["query_latency_ms"] = row["query_encode_single_ms"] + (row["search_ms"] or 0)
    if v.hybrid:
        row.update(fusion=search.fusion, weight=search.weight, tuned=tuned)
        if v.named:
            row["mode"] += f" {search.fusion} w={search.weight:g}" + (" tuned" if tuned else "")
    return row


def _search_all(embedder, job: IndexJob, variants: list[Variant], queries: QueryVectors, *,
                candidates: int, k_token: int, latency_queries: int, log, weights: dict[str, float],
                tuned: dict[str, dict] | None = None) -> tuple[dict, dict, dict]:
    """Embed the queries (what is missing) and search every variant: ``(runs, rows, timings)``."""
    tuned = tuned or {}
    searches = _searches(job, variants, embedder.natural_dim, candidates, k_token, weights)
    t_q = time.perf_counter()
    queries.ensure(embedder, [e for s in searches.values() for e in s.embeddings()])
    timings = {"queries_s": time.perf_counter() - t_q}
    t_s = time.perf_counter()
    runs, rows = {}, {}
    for v in variants:
        runs[v.label], lat = _run(searches[v.label], queries, latency_queries)
        encode_s = job.targets[v.canonical].encode_seconds
        rows[v.label] = _row(v, searches[v.label], encode_s, queries, embedder, lat, tuned.get(v.label))
        ms = rows[v.label]["search_ms"]
        log(f"searched {v.label}" + ("" if ms is None else f": {ms:.1f} ms/query"))
    timings["search_s"] = time.perf_counter() - t_s
    return runs, rows, timings


def _tune(embedder, job: IndexJob, variants: list[Variant], dev: BeirData, candidates: int, k_token: int,
          log) -> tuple[dict[str, float], dict[str, dict]]:
    """Each tuned hybrid variant's weight, chosen on ``dev``'s queries (same corpus), and stored
    in its collection per vector mode (the best on ``dev`` where several fusions are tuned)."""
    qids = [q for q in dev.qrels if dev.qrels[q]]
    queries = QueryVectors(qids, [dev.queries[q] for q in qids], 0)
    weights, about, best = {}, {}, {}
    for v in variants:
        if not (v.hybrid and v.fusion.tuned):
            continue
        coll = job.targets[v.canonical].coll
        vmode = v.mode if v.multi else "exhaustive"
        sides = [Search(coll, embedder.natural_dim, k=DEPTH, mode=m, candidates=candidates, k_token=k_token)
                 for m in (vmode, BM25)]
        queries.ensure(embedder, [e for s in sides for e in s.embeddings()])
        vec, lex = (s.run(queries.vectors, texts=queries.texts) for s in sides)
        lower = coll.spec.kind == "single" and coll.spec.metric == "l2"
        w, by_weight = tune_weight(dev.qrels, qids, vec, lex, v.fusion.fusion, lower_is_better=lower)
        weights[v.label] = w
        about[v.label] = {"split": dev.info.get("split"), "queries": len(qids), "dev_ndcg@10": by_weight[w],
                          "dev_ndcg@10_by_weight": by_weight}
        log(f"tuned {v.label} on {len(qids)} {dev.info.get('split')} queries: weight {w:g} "
            f"(dev nDCG@10 {by_weight[w]:.4f}; at 0.5 {by_weight[0.5]:.4f})")
        key = (v.canonical, vmode)
        if key not in best or by_weight[w] > best[key][0]:
            best[key] = (by_weight[w], coll, vmode, v.fusion.fusion, w, len(qids), dev.info.get("split"))
    for ndcg, coll, vmode, fusion, w, n, split in best.values():
        coll.set_property(TUNED_PROPERTY, tuned_entry(coll.get_property(TUNED_PROPERTY), vmode, fusion, w,
                                                      split=split, queries=n, dev_ndcg=round(ndcg, 6)))
        coll.commit()
    return weights, about


def _hybrid_p_values(qrels: dict, runs: dict, variants: list[Variant], stat_test: str) -> dict[str, dict]:
    """Per hybrid variant, paired p-values of nDCG@10 against its own vector variant and
    against BM25 (when evaluated)."""
    out: dict[str, dict] = {}
    for v in variants:
        if not v.hybrid:
            continue
        p = {}
        for key, other in (("p_vs_vector", v.vector), ("p_vs_bm25", BM25)):
            if other in runs:
                sc = score_runs(qrels, {other: runs[other], v.label: runs[v.label]}, baseline=other,
                                stat_test=stat_test, metrics=("ndcg@10",))
                p[key] = sc[v.label]["p_values"].get("ndcg@10")
        out[v.label] = p
    return out


def _results(variants: list[Variant], base: Variant, rows: dict, scores: dict, extra: dict | None,
             hybrid_p: dict | None = None) -> list[dict]:
    out = []
    for v in variants:
        r, sc = rows[v.label], scores[v.label]
        out.append({**{k: r[k] for k in ("pooler", "mode", "label", "kind")},
                    **{m: sc["metrics"][m] for m in METRICS},
                    "bytes_per_doc": r["bytes_per_doc"],
                    "p_value": sc["p_values"].get("ndcg@10") if v is not base else None,
                    "p_values": sc["p_values"] or None,
                    **((hybrid_p or {}).get(v.label) or {}),
                    **{k: r[k] for k in ("documents", "vectors", "vectors_per_doc", "encode_s",
                                         "query_encode_ms", "query_encode_single_ms", "search_ms", "search_p50_ms",
                                         "query_latency_ms")},
                    **{k: r[k] for k in ("fusion", "weight", "tuned") if k in r},
                    **(extra or {})})
    return out


def evaluate_retrieval(embedder, data: BeirData, poolers: list[str], *, modes: list[str] = ("exhaustive",),
                       baseline: str | None = None, stat_test: str = "student", candidates: int = 100,
                       companion_pooler: str = "auto", k_token: int = 32, index_dir: str | Path | None = None,
                       name: str = "eval",
                       commit_every: int = 500, storage_precision: str = "float32",
                       progress: bool = True, query_vectors: QueryVectors | None = None,
                       log: Callable[[str], None] | None = None, extra: dict | None = None,
                       latency_queries: int = 32, fusion: str | list[str] = "rrf", weight: float = 0.5,
                       dev: BeirData | None = None, **job_options: Any) -> dict[str, Any]:
    """Index ``data.corpus`` with every pooler, search every query, score with ranx.

    ``job_options``: further :class:`app.indexing.IndexJob` settings (``batch_tokens``,
    ``commit_bytes``, ``batch_docs``); the defaults bound the job's memory whatever the corpus.

    ``query_vectors``: queries embedded by an earlier call on the same queries (their ids must
    be ``data.qrels``'s), completed and reused here.

    ``fusion``: the hybrid rows' fusions (:func:`app.evaluation.fusion.parse_fusions`; a tuned
    one's weight is chosen on ``dev``: other queries and qrels over the same corpus).

    Returns the report: ``{"task": "retrieval", ..., "results": [row, ...]}`` with one row per
    pooler (and per mode for multi-vector poolers)."""
    log = log or (lambda m: None)
    modes = _check(poolers, modes)
    fusions = parse_fusions(fusion)
    variants = _variants(embedder, poolers, modes, fusions)
    base = _baseline(embedder, variants, baseline)
    tuning = any(v.hybrid and v.fusion.tuned for v in variants)
    if tuning and dev is None:
        raise InvalidError("a tuned fusion needs a dev split (--tune-split) of the same corpus", param="--fusion")
    need_companion = any(v.multi and v.mode == "two_stage" for v in variants)
    qids = list(data.qrels)
    queries = query_vectors or QueryVectors(qids, [data.queries[q] for q in qids], latency_queries)
    if queries.qids != qids:
        raise InvalidError("query_vectors were embedded for other queries")
    with tempfile.TemporaryDirectory(prefix="embedpool-eval-") as tmp:
        job = IndexJob(embedder, index_dir or tmp, name, list(dict.fromkeys(v.spec for v in variants if v.mode != BM25)),
                       source={"eval": data.info, "documents": len(data.corpus)},
                       companion_pooler=companion_pooler if need_companion else None, commit_every=commit_every,
                       storage_precision=storage_precision, progress=progress, log=log, **job_options)
        with job:
            t0 = time.perf_counter()
            summary = job.run(data.corpus, total=len(data.corpus))
            timings = {"index_s": time.perf_counter() - t0}
            log(f"indexed {len(data.corpus)} documents in {timings['index_s']:.1f}s")
            weights, tuned = {v.label: weight for v in variants if v.hybrid}, {}
            if tuning:
                t_t = time.perf_counter()
                more_weights, tuned = _tune(embedder, job, variants, dev, candidates, k_token, log)
                weights.update(more_weights)
                timings["tune_s"] = time.perf_counter() - t_t
            runs, rows, more = _search_all(embedder, job, variants, queries, candidates=candidates,
                                           k_token=k_token, latency_queries=latency_queries, log=log,
                                           weights=weights, tuned=tuned)
            timings.update(more)
    t_m = time.perf_counter()
    scores = score_runs(data.qrels, runs, baseline=base.label, stat_test=stat_test)
    hybrid_p = _hybrid_p_values(data.qrels, runs, variants, stat_test)
    timings["metrics_s"] = time.perf_counter() - t_m
    log("timings: " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    return {"task": "retrieval", **data.info, "model": embedder.model_id,
            "encoder_precision": getattr(embedder.encoder, "precision", None),
            "documents": len(data.corpus), "queries": len(data.qrels), "baseline": base.label,
            "stat_test": stat_test, "candidates": candidates if need_companion else None,
            "index": {"seconds": round(summary["seconds"], 2), "tokens": summary["tokens"],
                      "docs_per_s": summary["docs_per_s"], "tokens_per_s": summary["tokens_per_s"]},
            "timings": {k: round(v, 2) for k, v in timings.items()},
            "per_query": {v.label: scores[v.label]["per_query"]["ndcg@10"] for v in variants},
            "fusion": ({"fusion": ",".join(f.name for f in fusions), "weight": weight,
                        "tuned": {k: {x: t[x] for x in ("split", "queries", "dev_ndcg@10")} | {"weight": weights[k]}
                                  for k, t in tuned.items()} or None}
                       if any(v.hybrid for v in variants) else None),
            "results": _results(variants, base, rows, scores, extra, hybrid_p)}
