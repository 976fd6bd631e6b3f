"""Synthetic long documents: each relevant document of a sample of queries is hidden at a random
position among ``K`` random other documents (none relevant to any query) and the ``K + 1`` texts
are concatenated into one long document; as many haystack-only long documents are added as
negatives. Truncating poolers only see the first window."""

from __future__ import annotations

import random
import statistics
from pathlib import Path
from typing import Any

from embedpool.app.datasets import BeirData, Record
from embedpool.app.evaluation.beir import QueryVectors, evaluate_retrieval
from embedpool.errors import InvalidError


def synthetic_long(data: BeirData, distractors: int, n_queries: int | None = 100, seed: int = 0,
                   negatives: int | None = None) -> BeirData:
    """Needle-in-a-haystack variant of a BEIR set (see the module docstring). The query sample
    depends on ``seed`` only, so every ``K`` uses the same queries and needles."""
    if distractors < 0:
        raise InvalidError("--distractors must be >= 0", param="--distractors")
    qids = list(data.qrels)
    if n_queries and n_queries < len(qids):
        qids = random.Random(seed).sample(qids, n_queries)
    by_id = {r.id: r for r in data.corpus}
    wanted = {d for q in qids for d in data.qrels[q] if d in by_id}
    needles = [r.id for r in data.corpus if r.id in wanted]
    relevant_anywhere = {d for rel in data.qrels.values() for d in rel}
    hay_pool = [r.id for r in data.corpus if r.id not in relevant_anywhere]
    if len(hay_pool) < distractors + 1:
        raise InvalidError(f"the corpus has only {len(hay_pool)} non-relevant documents; fewer than K+1")
    rng = random.Random(f"{seed}-{distractors}")
    corpus, needle_doc = [], {}
    for d in needles:
        hay = rng.sample(hay_pool, distractors)
        hay.insert(rng.randint(0, distractors), d)
        doc_id = f"long-{d}"
        corpus.append(Record(doc_id, " ".join(by_id[h].text for h in hay),
                             {"needle": d, "position": hay.index(d), "parts": len(hay)}))
        needle_doc[d] = doc_id
    for i in range(len(needles) if negatives is None else negatives):
        hay = rng.sample(hay_pool, distractors + 1)
        corpus.append(Record(f"hay-{i}", " ".join(by_id[h].text for h in hay), {"needle": None, "parts": len(hay)}))
    qrels = {q: {needle_doc[d]: s for d, s in data.qrels[q].items() if d in needle_doc} for q in qids}
    qrels = {q: r for q, r in qrels.items() if r}
    info = {**data.info, "synthetic_long": {"distractors": distractors, "queries": len(qrels), "seed": seed,
                                            "needles": len(needles), "negatives": len(corpus) - len(needles)}}
    return BeirData(corpus, {q: data.queries[q] for q in qrels}, qrels, data.name, info)


def evaluate_synthetic_long(embedder, data: BeirData, poolers: list[str], distractors: list[int], *,
                            n_queries: int | None = 100, seed: int = 0, negatives: int | None = None,
                            **kw) -> dict[str, Any]:
    """:func:`evaluate_retrieval` on the needle-in-a-haystack variant for each ``K``; the queries
    (the same for every K) are embedded once."""
    log = kw.get("log") or (lambda m: None)
    index_dir = kw.pop("index_dir", None)
    reports, queries = [], None
    for K in distractors:
        d = synthetic_long(data, K, n_queries=n_queries, seed=seed, negatives=negatives)
        log(f"synthetic-long K={K}: {len(d.corpus)} documents, {len(d.qrels)} queries, "
            f"~{statistics.fmean(len(r.text) for r in d.corpus):,.0f} characters per document")
        if queries is None:
            qids = list(d.qrels)
            queries = QueryVectors(qids, [d.queries[q] for q in qids], kw.get("latency_queries", 32))
        sub = None if index_dir is None else Path(index_dir) / f"k{K}"
        reports.append(evaluate_retrieval(embedder, d, poolers, index_dir=sub, name=f"long-k{K}",
                                          query_vectors=queries, extra={"distractors": K}, **kw))
    first = reports[0]
    return {**{k: v for k, v in first.items() if k not in ("results", "per_query", "synthetic_long", "index")},
            "task": "synthetic_long", "distractors": list(distractors),
            "synthetic_long": [r["synthetic_long"] for r in reports],
            "index": [r["index"] for r in reports],
            "results": [row for r in reports for row in r["results"]]}
