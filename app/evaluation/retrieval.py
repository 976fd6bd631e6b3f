"""Retrieval and STS evaluation on top of the same pipeline and collections as the service.

Retrieval (BEIR layout): the corpus is indexed by :class:`app.indexing.IndexJob` (one forward
pass per tokenization plan for every pooler; a ``mean`` companion when a multi-vector pooler is
evaluated with ``two_stage``) into collections in a temporary (or kept) folder, the queries are
embedded once for all poolers, and each query is searched through :meth:`index.Collection.search`
-- there is no second implementation of pooling or search here. Metrics and paired significance
tests come from ``ranx``.

STS: Spearman (and Pearson) correlation of the cosine similarity (normalized MaxSim for
multi-vector poolers, via ``index.maxsim_scores``) with the gold scores; significance against the
baseline by a paired bootstrap over sentence pairs.

Synthetic long documents: each relevant document of a sample of queries is hidden at a random
position among ``K`` random other documents (none relevant to any query) and the ``K + 1`` texts
are concatenated into one long document; as many haystack-only long documents are added as
negatives. Truncating poolers only see the first window.
"""

from __future__ import annotations

import csv
import json
import math
import random
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from embedpool.app.indexing import IndexJob, Record, _PoolTimer, embed_by_plan, render_table
from embedpool.errors import InvalidError, MissingFileError

METRICS = ("ndcg@10", "recall@100", "mrr@10", "map@100")
STAT_TESTS = ("student", "fisher")
DEPTH = 100
_NO_DOC = "\x00no-result"


# ---------------------------------------------------------------------------------- data
@dataclass
class BeirData:
    corpus: list[Record]
    queries: dict[str, str]  # only queries with at least one relevant document
    qrels: dict[str, dict[str, int]]
    name: str = ""
    info: dict[str, Any] = field(default_factory=dict)


def load_beir(folder: str | Path, split: str = "test") -> BeirData:
    """``corpus.jsonl`` (documents as ``title + " " + text``), ``queries.jsonl`` and
    ``qrels/<split>.tsv``; keeps the queries that have a relevant (score > 0) document."""
    folder = Path(folder)
    for need in ("corpus.jsonl", "queries.jsonl", f"qrels/{split}.tsv"):
        if not (folder / need).is_file():
            raise MissingFileError(f"{folder / need} not found: --data expects a BEIR folder with "
                                    f"corpus.jsonl, queries.jsonl and qrels/{split}.tsv")
    qrels: dict[str, dict[str, int]] = {}
    with open(folder / "qrels" / f"{split}.tsv", encoding="utf-8") as f:
        for n, line in enumerate(f):
            parts = line.rstrip("\n").split("\t")
            if n == 0 and not parts[-1].lstrip("-").isdigit():
                continue  # header
            if len(parts) < 3:
                continue
            qid, did, score = parts[0], parts[1], int(parts[-1])
            if score > 0:
                qrels.setdefault(qid, {})[did] = score
    queries = {}
    with open(folder / "queries.jsonl", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                obj = json.loads(line)
                if str(obj["_id"]) in qrels:
                    queries[str(obj["_id"])] = obj["text"]
    corpus = []
    with open(folder / "corpus.jsonl", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                obj = json.loads(line)
                corpus.append(Record(str(obj["_id"]), ((obj.get("title") or "") + " " + (obj.get("text") or "")).strip()))
    qrels = {q: r for q, r in qrels.items() if q in queries}
    return BeirData(corpus, queries, qrels, name=folder.name,
                    info={"dataset": folder.name, "path": str(folder.resolve()), "split": split})


def slice_beir(data: BeirData, max_docs: int | None = None, max_queries: int | None = None,
               seed: int = 0) -> BeirData:
    """A small, self-consistent slice: queries (in a seeded random order) whose relevant
    documents all fit in half of ``max_docs``, plus random other documents up to ``max_docs``."""
    if not max_docs and not max_queries:
        return data
    rng = random.Random(seed)
    qids = list(data.qrels)
    rng.shuffle(qids)
    by_id = {r.id: r for r in data.corpus}
    budget = max_docs // 2 if max_docs else len(data.corpus)
    chosen, rel_docs = [], set()
    for q in qids:
        if max_queries and len(chosen) >= max_queries:
            break
        rel = {d for d in data.qrels[q] if d in by_id}
        if not rel or len(rel_docs | rel) > budget:
            continue
        chosen.append(q)
        rel_docs |= rel
    keep = set(rel_docs)
    if max_docs:
        others = [r.id for r in data.corpus if r.id not in keep]
        keep |= set(rng.sample(others, min(len(others), max_docs - len(keep))))
    else:
        keep = set(by_id)
    corpus = [r for r in data.corpus if r.id in keep]
    chosen_set = set(chosen)
    qrels = {q: {d: s for d, s in data.qrels[q].items() if d in keep} for q in data.qrels if q in chosen_set}
    info = {**data.info, "slice": {"max_docs": max_docs, "max_queries": max_queries, "seed": seed}}
    return BeirData(corpus, {q: data.queries[q] for q in qrels}, qrels, data.name, info)


def synthetic_long(data: BeirData, distractors: int, n_queries: int | None = 100, seed: int = 0,
                   negatives: int | None = None) -> BeirData:
    """Needle-in-a-haystack variant of a BEIR set (see module docstring). The query sample
    depends on ``seed`` only, so every ``K`` uses the same queries and needles."""
    if distractors < 0:
        raise InvalidError("--distractors must be >= 0")
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


# ---------------------------------------------------------------------------------- metrics
def score_runs(qrels: dict[str, dict[str, int]], runs: dict[str, dict[str, dict[str, float]]],
               baseline: str | None = None, stat_test: str = "student",
               metrics: tuple[str, ...] = METRICS) -> dict[str, dict[str, Any]]:
    """Mean metrics per run (ranx) and, against ``baseline``, paired p-values per metric
    (ranx ``compare``: ``student`` paired t-test or ``fisher`` randomization test).

    Returns ``{label: {"metrics": {m: mean}, "per_query": {m: {qid: score}}, "p_values": {m: p}}}``
    (``p_values`` empty for the baseline itself)."""
    if stat_test not in STAT_TESTS:
        raise InvalidError(f"stat test must be one of {', '.join(STAT_TESTS)}")
    import os
    import sys

    if "numba" not in sys.modules:
        # ranx's numba kernels: one thread starts ~3x faster on a busy 2-core machine and the
        # problems here are far too small to gain from more
        os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from ranx import Qrels, Run, compare, evaluate

        rq = Qrels.from_dict(qrels)
        rruns = {}
        for label, run in runs.items():
            # exactly the judged queries, each with an entry (an empty result is a placeholder
            # document no qrels name, so it scores 0): ranx needs no make_comparable pass, which
            # would JIT-compile more of numba's typed-dict methods (slow to start)
            full = {q: (run.get(q) or {_NO_DOC: 0.0}) for q in qrels}
            rruns[label] = Run.from_dict(full, name=label)
        out: dict[str, dict[str, Any]] = {}
        for label, rr in rruns.items():
            evaluate(rq, rr, list(metrics), return_mean=False)
            per = {m: {q: float(v) for q, v in rr.scores[m].items()} for m in metrics}
            out[label] = {"metrics": {m: float(np.mean(list(per[m].values()))) for m in metrics},
                          "per_query": per, "p_values": {}}
        if baseline is not None and len(rruns) > 1:
            if baseline not in rruns:
                raise InvalidError(f"baseline {baseline!r} is not among the runs")
            labels = [baseline] + [x for x in rruns if x != baseline]
            rep = compare(rq, [rruns[x] for x in labels], list(metrics), stat_test=stat_test)
            comp = rep.to_dict()[baseline]["comparisons"]
            for x in labels[1:]:
                pv = {}
                for m in metrics:
                    p = float(comp[x][m])
                    if math.isnan(p):  # identical per-query scores: no difference at all
                        same = out[x]["per_query"][m] == out[baseline]["per_query"][m]
                        p = 1.0 if same else p
                    pv[m] = p
                out[x]["p_values"] = pv
    return out


# ---------------------------------------------------------------------------------- retrieval
@dataclass
class Variant:
    label: str
    spec: str  # as given
    canonical: str
    mode: str  # exhaustive | two_stage | tokens (single-vector: "flat")
    multi: bool


def _variants(embedder, poolers: list[str], modes: list[str]) -> list[Variant]:
    out, seen = [], set()
    for p in poolers:
        c = embedder.canonical(p)
        multi = bool(embedder.pooler(c).multi_vector)
        for m in (modes if multi else ["flat"]):
            if (c, m) in seen:
                continue
            seen.add((c, m))
            out.append(Variant(f"{p} [{m}]" if multi else p, p, c, m, multi))
    return out


def _baseline(embedder, variants: list[Variant], baseline: str | None) -> Variant:
    if baseline is None:
        for v in variants:
            if v.canonical == embedder.canonical("mean"):
                return v
        return variants[0]
    c = embedder.canonical(baseline.split(" [")[0])
    mode = baseline.split(" [")[1].rstrip("]") if " [" in baseline else None
    for v in variants:
        if v.canonical == c and (mode is None or v.mode == mode):
            return v
    raise InvalidError(f"--baseline {baseline!r} is not one of the evaluated poolers "
                     f"({', '.join(v.label for v in variants)})")


def evaluate_retrieval(embedder, data: BeirData, poolers: list[str], *, modes: list[str] = ("exhaustive",),
                       baseline: str | None = None, stat_test: str = "student", candidates: int = 100,
                       k_token: int = 32, index_dir: str | Path | None = None, name: str = "eval",
                       commit_every: int = 500, batch_docs: int = 256, storage_precision: str = "float32",
                       progress: bool = True, query_vectors: dict | None = None,
                       log: Callable[[str], None] | None = None, extra: dict | None = None,
                       latency_queries: int = 32) -> dict[str, Any]:
    """Index ``data.corpus`` with every pooler, search every query, score with ranx.

    Returns the report: ``{"task": "retrieval", ..., "results": [row, ...]}`` with one row per
    pooler (and per mode for multi-vector poolers)."""
    log = log or (lambda m: None)
    modes = list(dict.fromkeys(modes))
    for m in modes:
        if m not in ("exhaustive", "two_stage", "tokens"):
            raise InvalidError(f"unknown mode {m!r}; use exhaustive, two_stage or tokens")
    if not poolers:
        raise InvalidError("give at least one --pooler")
    variants = _variants(embedder, poolers, modes)
    base = _baseline(embedder, variants, baseline)
    need_companion = any(v.multi and v.mode == "two_stage" for v in variants)
    tmp = None
    if index_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="embedpool-eval-")
        index_dir = tmp.name
    try:
        job = IndexJob(embedder, index_dir, name, list(dict.fromkeys(v.spec for v in variants)),
                       source={"eval": data.info, "documents": len(data.corpus)},
                       companion="mean" if need_companion else None, commit_every=commit_every,
                       batch_docs=batch_docs, storage_precision=storage_precision, progress=progress,
                       log=log)
        with job:
            t0 = time.perf_counter()
            summary = job.run(data.corpus, total=len(data.corpus))
            index_s = time.perf_counter() - t0
            log(f"indexed {len(data.corpus)} documents in {index_s:.1f}s")
            qids = list(data.qrels)
            qtexts = [data.queries[q] for q in qids]
            specs = [t.spec for t in job.targets.values()]
            t_q = time.perf_counter()
            if query_vectors is None:
                query_vectors = embed_queries(embedder, qtexts, specs, latency_queries)
            timings = {"index_s": index_s, "queries_s": time.perf_counter() - t_q}
            t_s = time.perf_counter()
            # shared across several corpora (synthetic-long K values): embedded once
            qvec, qsec, qlat = query_vectors["vectors"], query_vectors["seconds"], query_vectors["latency"]
            comp_t = job.targets[job.companion] if job.companion else None
            runs: dict[str, dict[str, dict[str, float]]] = {}
            rows: dict[str, dict[str, Any]] = {}
            for v in variants:
                t = job.targets[v.canonical]
                coll = t.coll

                def search(rows: list[int]) -> list[list]:
                    if not v.multi:
                        return coll.search(np.stack([qvec[v.canonical][i] for i in rows]), k=DEPTH)
                    qs = [qvec[v.canonical][i] for i in rows]
                    if v.mode == "two_stage":
                        return coll.search(qs, k=DEPTH, mode="two_stage", candidates=candidates,
                                           companion=comp_t.coll,
                                           companion_queries=np.stack([qvec[comp_t.spec][i] for i in rows]))
                    return coll.search(qs, k=DEPTH, mode=v.mode, k_token=k_token)

                # latency: one query per call, on the first `latency_queries` queries
                lat = []
                for i in range(min(latency_queries, len(qids))):
                    s = time.perf_counter()
                    search([i])
                    lat.append(time.perf_counter() - s)
                # the run: batched calls (same collections, same search code)
                run: dict[str, dict[str, float]] = {}
                for b in range(0, len(qids), 64):
                    rows_ = list(range(b, min(b + 64, len(qids))))
                    for i, hits in zip(rows_, search(rows_)):
                        run[qids[i]] = {h.id: float(h.score) for h in hits}
                runs[v.label] = run
                st = coll.stats()
                bpd = float(st["bytes_per_doc"])
                if v.multi and v.mode == "two_stage":
                    bpd += float(comp_t.coll.stats()["bytes_per_doc"])
                two = v.multi and v.mode == "two_stage"
                enc_q = qsec[v.canonical] + (qsec[comp_t.spec] if two else 0.0)
                # one query alone: its plan's forward + its pooling (+ the companion's pooling)
                lat_q = qlat[v.canonical] + (qlat[comp_t.spec] - qlat.get("_forward:" + comp_t.spec, 0.0)
                                             if two and embedder.pooler(comp_t.spec).plan == embedder.pooler(v.canonical).plan
                                             else (qlat[comp_t.spec] if two else 0.0))
                rows[v.label] = {
                    "pooler": v.spec, "mode": v.mode if v.multi else None, "label": v.label,
                    "kind": "multi" if v.multi else "single", "documents": st["documents"],
                    "vectors": st["vectors"], "vectors_per_doc": st["vectors"] / max(st["documents"], 1),
                    "bytes_per_doc": bpd, "encode_s": round(t.encode_seconds, 3),
                    "query_encode_ms": 1000 * enc_q / max(len(qids), 1),
                    "query_encode_single_ms": 1000 * lat_q,
                    "search_ms": 1000 * statistics.fmean(lat) if lat else None,
                    "search_p50_ms": 1000 * statistics.median(lat) if lat else None,
                }
                rows[v.label]["query_latency_ms"] = rows[v.label]["query_encode_single_ms"] + (rows[v.label]["search_ms"] or 0)
                log(f"searched {v.label}: {rows[v.label]['search_ms']:.1f} ms/query")
            timings["search_s"] = time.perf_counter() - t_s
        t_m = time.perf_counter()
        scores = score_runs(data.qrels, runs, baseline=base.label, stat_test=stat_test)
        timings["metrics_s"] = time.perf_counter() - t_m
        log("timings: " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    finally:
        if tmp is not None:
            tmp.cleanup()
    results = []
    for v in variants:
        r = rows[v.label]
        sc = scores[v.label]
        results.append({**{k: r[k] for k in ("pooler", "mode", "label", "kind")},
                        **{m: sc["metrics"][m] for m in METRICS},
                        "bytes_per_doc": r["bytes_per_doc"],
                        "p_value": sc["p_values"].get("ndcg@10") if v is not base else None,
                        "p_values": sc["p_values"] or None,
                        **{k: r[k] for k in ("documents", "vectors", "vectors_per_doc", "encode_s",
                                             "query_encode_ms", "query_encode_single_ms", "search_ms", "search_p50_ms",
                                             "query_latency_ms")},
                        **(extra or {})})
    return {"task": "retrieval", **data.info, "model": embedder.model_id,
            "encoder_precision": getattr(embedder.encoder, "precision", None),
            "documents": len(data.corpus), "queries": len(data.qrels), "baseline": base.label,
            "stat_test": stat_test, "candidates": candidates if need_companion else None,
            "index": {"seconds": round(summary["seconds"], 2), "tokens": summary["tokens"],
                      "docs_per_s": summary["docs_per_s"], "tokens_per_s": summary["tokens_per_s"]},
            "timings": {k: round(v, 2) for k, v in timings.items()},
            "per_query": {v.label: scores[v.label]["per_query"]["ndcg@10"] for v in variants},
            "results": results}


def embed_queries(embedder, texts: list[str], specs: list[str], latency_queries: int = 32) -> dict[str, Any]:
    """All queries in one pass per plan (``vectors``, ``seconds`` per spec), plus the mean time
    of embedding one query alone per spec (``latency``; ``_forward:<spec>`` is the shared
    forward part of it) over the first ``latency_queries`` queries."""
    vec, sec, _ = embed_by_plan(embedder, texts, specs, "query")
    lat: dict[str, list[float]] = {}
    timer = _PoolTimer()
    for t in texts[:latency_queries]:
        _, s1, _ = embed_by_plan(embedder, [t], specs, "query", timer=timer)
        for k, v in s1.items():
            lat.setdefault(k, []).append(v)
            lat.setdefault("_forward:" + k, []).append(timer.shared[k])
    return {"vectors": vec, "seconds": sec, "latency": {k: statistics.fmean(v) for k, v in lat.items()}}


def evaluate_synthetic_long(embedder, data: BeirData, poolers: list[str], distractors: list[int], *,
                            n_queries: int | None = 100, seed: int = 0, negatives: int | None = None,
                            **kw) -> dict[str, Any]:
    """:func:`evaluate_retrieval` on the needle-in-a-haystack variant for each ``K``; the queries
    (the same for every K) are embedded once."""
    log = kw.get("log") or (lambda m: None)
    reports = []
    qvecs = None
    index_dir = kw.pop("index_dir", None)
    for K in distractors:
        d = synthetic_long(data, K, n_queries=n_queries, seed=seed, negatives=negatives)
        log(f"synthetic-long K={K}: {len(d.corpus)} documents, {len(d.qrels)} queries, "
            f"~{statistics.fmean(len(r.text) for r in d.corpus):,.0f} characters per document")
        if qvecs is None:
            specs = _all_specs(embedder, poolers, kw.get("modes", ("exhaustive",)))
            qids = list(d.qrels)
            qvecs = embed_queries(embedder, [d.queries[q] for q in qids], specs,
                                  kw.get("latency_queries", 32))
            qvecs["qids"] = qids
        assert list(d.qrels) == qvecs["qids"]
        sub = None if index_dir is None else Path(index_dir) / f"k{K}"
        rep = evaluate_retrieval(embedder, d, poolers, index_dir=sub, name=f"long-k{K}",
                                 query_vectors=qvecs, extra={"distractors": K}, **kw)
        reports.append(rep)
    first = reports[0]
    return {**{k: v for k, v in first.items() if k not in ("results", "per_query", "synthetic_long", "index")},
            "task": "synthetic_long", "distractors": list(distractors),
            "synthetic_long": [r["synthetic_long"] for r in reports],
            "index": [r["index"] for r in reports],
            "results": [row for r in reports for row in r["results"]]}


def _all_specs(embedder, poolers, modes) -> list[str]:
    specs = [embedder.canonical(p) for p in poolers]
    if any(embedder.pooler(s).multi_vector for s in specs) and "two_stage" in modes:
        specs.append(embedder.canonical("mean"))
    return list(dict.fromkeys(specs))


# ---------------------------------------------------------------------------------- STS
def load_sts(folder: str | Path, split: str = "test") -> list[tuple[str, str, float]]:
    path = Path(folder) / f"{split}.tsv"
    if not path.is_file():
        raise MissingFileError(f"{path} not found: --sts expects a folder with {split}.tsv "
                                "(sentence1, sentence2, score)")
    pairs = []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader)
        cols = {h.strip(): i for i, h in enumerate(header)}
        try:
            a, b, s = cols["sentence1"], cols["sentence2"], cols["score"]
        except KeyError:
            raise InvalidError(f"{path}: the header must name sentence1, sentence2 and score") from None
        for row in reader:
            if len(row) > max(a, b, s):
                pairs.append((row[a], row[b], float(row[s])))
    return pairs


def _bootstrap_p(gold: np.ndarray, x: np.ndarray, y: np.ndarray, n: int = 2000, seed: int = 0) -> float:
    """Two-sided paired bootstrap p-value for Spearman(x) != Spearman(y) over the same pairs."""
    from scipy.stats import rankdata

    rng = np.random.default_rng(seed)
    diffs = np.empty(n)
    for i in range(n):
        idx = rng.integers(0, len(gold), len(gold))
        g = rankdata(gold[idx])
        diffs[i] = np.corrcoef(g, rankdata(x[idx]))[0, 1] - np.corrcoef(g, rankdata(y[idx]))[0, 1]
    p = 2 * min((diffs <= 0).mean(), (diffs >= 0).mean())
    return float(min(1.0, max(p, 1.0 / n)))


def evaluate_sts(embedder, pairs: list[tuple[str, str, float]], poolers: list[str], *,
                 baseline: str | None = None, name: str = "sts", info: dict | None = None,
                 seed: int = 0) -> dict[str, Any]:
    from scipy.stats import pearsonr, spearmanr

    from embedpool.index import maxsim_scores

    sentences = list(dict.fromkeys([p[0] for p in pairs] + [p[1] for p in pairs]))
    pos = {s: i for i, s in enumerate(sentences)}
    specs = list(dict.fromkeys(embedder.canonical(p) for p in poolers))
    labels = {}
    for p in poolers:
        labels.setdefault(embedder.canonical(p), p)
    # Both sides of a pair are the same kind of text: embed them all as documents, so a
    # document-side pooler (cluster) pools them as it would pool a corpus.
    vec, sec, _ = embed_by_plan(embedder, sentences, specs, "document")
    gold = np.array([p[2] for p in pairs])
    preds, rows = {}, []
    for s in specs:
        v = vec[s]
        multi = bool(embedder.pooler(s).multi_vector)
        sims = []
        for a, b, _ in pairs:
            x, y = v[pos[a]], v[pos[b]]
            if multi:  # symmetric MaxSim, normalized by the number of query vectors
                ab = maxsim_scores([x], y, np.array([0, len(y)], dtype=np.int64))[0, 0] / len(x)
                ba = maxsim_scores([y], x, np.array([0, len(x)], dtype=np.int64))[0, 0] / len(y)
                sims.append((ab + ba) / 2)
            else:
                sims.append(float(x @ y))
        preds[s] = np.array(sims)
        n_vec = sum(len(x) if multi else 1 for x in v)
        rows.append({"pooler": labels[s], "mode": None, "label": labels[s], "kind": "multi" if multi else "single",
                     "spearman": float(spearmanr(gold, preds[s]).statistic),
                     "pearson": float(pearsonr(gold, preds[s]).statistic),
                     "bytes_per_doc": 4.0 * embedder.dim * n_vec / len(sentences),
                     "vectors_per_doc": n_vec / len(sentences), "encode_s": round(sec[s], 3)})
    bc = embedder.canonical(baseline) if baseline else (embedder.canonical("mean") if embedder.canonical("mean") in specs else specs[0])
    if bc not in specs:
        raise InvalidError(f"--baseline {baseline!r} is not one of the evaluated poolers")
    for s, r in zip(specs, rows):
        r["p_value"] = None if s == bc else _bootstrap_p(gold, preds[s], preds[bc], seed=seed)
    return {"task": "sts", **(info or {}), "model": embedder.model_id,
            "encoder_precision": getattr(embedder.encoder, "precision", None),
            "pairs": len(pairs), "sentences": len(sentences), "baseline": labels[bc],
            "stat_test": "paired bootstrap (2000 resamples) of the Spearman difference", "results": rows}


# ---------------------------------------------------------------------------------- outputs
def _cols(report: dict) -> list[tuple[str, str, Callable[[Any], str]]]:
    f3 = lambda x: "" if x is None else f"{x:.4f}"  # noqa: E731
    fp = lambda x: "" if x is None else (f"{x:.2g}" if x < 0.001 else f"{x:.3f}")  # noqa: E731
    fb = lambda x: "" if x is None else f"{x:,.0f}"  # noqa: E731
    f1 = lambda x: "" if x is None else f"{x:,.1f}"  # noqa: E731
    if report["task"] == "sts":
        return [("pooler", "pooler", str), ("spearman", "Spearman", f3), ("pearson", "Pearson", f3),
                ("p_value", "p (vs " + report["baseline"] + ")", fp), ("vectors_per_doc", "vectors/sent", f1),
                ("bytes_per_doc", "bytes/sent", fb), ("encode_s", "encode s", f1)]
    cols = [("pooler", "pooler", str), ("mode", "mode", lambda x: x or "")]
    if report["task"] == "synthetic_long":
        cols.append(("distractors", "K", str))
    return cols + [("ndcg@10", "nDCG@10", f3), ("recall@100", "R@100", f3), ("mrr@10", "MRR@10", f3),
                   ("map@100", "MAP@100", f3), ("p_value", "p nDCG (vs " + report["baseline"] + ")", fp),
                   ("vectors_per_doc", "vectors/doc", f1), ("bytes_per_doc", "bytes/doc", fb),
                   ("encode_s", "encode s", f1), ("query_latency_ms", "query ms", f1)]


def format_report(report: dict) -> str:
    cols = _cols(report)
    rows = [[fmt(r.get(k)) for k, _, fmt in cols] for r in report["results"]]
    head = _headline(report)
    return head + "\n" + render_table([h for _, h, _ in cols], rows)


def _headline(report: dict) -> str:
    if report["task"] == "sts":
        return (f"STS {report.get('dataset', '')} {report.get('split', '')}: {report['pairs']} pairs, "
                f"model {report['model']} ({report['encoder_precision']}); p-values: {report['stat_test']}")
    if report["task"] == "synthetic_long":
        sl = report["synthetic_long"][0]
        what = (f"K = {', '.join(map(str, report['distractors']))}: {sl['needles']} long documents with a "
                f"needle + {sl['negatives']} haystack-only ones per K, {report['queries']} queries")
    else:
        what = f"{report['documents']} documents, {report['queries']} queries"
    return (f"{report['task']} {report.get('dataset', '')} {report.get('split', '')}: {what}, model {report['model']} "
            f"({report['encoder_precision']}); p-values: ranx {report['stat_test']} "
            f"({'paired t-test' if report['stat_test'] == 'student' else 'randomization test'}) vs {report['baseline']}")


def to_markdown(report: dict) -> str:
    cols = _cols(report)
    lines = [f"<!-- embedpool eval -->", "", _headline(report), ""]
    lines.append("| " + " | ".join(h for _, h, _ in cols) + " |")
    lines.append("|" + "|".join("---" if k in ("pooler", "mode") else "---:" for k, _, _ in cols) + "|")
    for r in report["results"]:
        lines.append("| " + " | ".join(f"`{r[k]}`" if k == "pooler" else fmt(r.get(k)) for k, _, fmt in cols) + " |")
    if report["task"] == "synthetic_long":
        ks = report["distractors"]
        lines += ["", "nDCG@10 by number of distractors K:", "",
                  "| pooler | mode | " + " | ".join(f"K={k}" for k in ks) + " |",
                  "|---|---|" + "---:|" * len(ks)]
        seen = []
        for r in report["results"]:
            if (r["pooler"], r["mode"]) not in seen:
                seen.append((r["pooler"], r["mode"]))
        for p, m in seen:
            vals = {r["distractors"]: r["ndcg@10"] for r in report["results"] if r["pooler"] == p and r["mode"] == m}
            lines.append(f"| `{p}` | {m or ''} | " + " | ".join(f"{vals[k]:.4f}" if k in vals else "" for k in ks) + " |")
    return "\n".join(lines) + "\n"


def plot_report(report: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = "spearman" if report["task"] == "sts" else "ndcg@10"
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=120)
    series: dict[str, list[dict]] = {}
    for r in report["results"]:
        series.setdefault(r["label"], []).append(r)
    markers = "osD^v<>pXh*"
    long_docs = report["task"] == "synthetic_long"
    for i, (label, rs) in enumerate(series.items()):
        style = {"marker": markers[i % len(markers)], "color": plt.cm.tab10(i % 10), "label": label}
        if long_docs:  # one line per pooler across the number of distractors K
            rs = sorted(rs, key=lambda r: r["distractors"])
            ax.plot([r["distractors"] for r in rs], [r[metric] for r in rs], **style)
        else:  # one point per pooler/mode
            ax.scatter([max(r["bytes_per_doc"], 1.0) for r in rs], [r[metric] for r in rs], s=40, zorder=3, **style)
    if long_docs:
        ax.set_xlabel("distractor documents K in each long document")
        ax.set_xticks(sorted({r["distractors"] for r in report["results"]}))
    else:
        ax.set_xscale("log")
        ax.set_xlabel("bytes per document (log scale)")
    ax.set_ylabel("Spearman (cosine)" if metric == "spearman" else "nDCG@10")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    against = "K" if long_docs else "bytes/doc"
    title = {"sts": "STS", "retrieval": "retrieval", "synthetic_long": "synthetic long documents"}[report["task"]]
    ax.set_title(f"{report.get('dataset', '')} {report.get('split', '')} {title}: {metric} vs {against}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_outputs(report: dict, out: str | Path | None = None, markdown: str | Path | None = None,
                  plot: str | Path | None = None) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(_jsonable(report), indent=2) + "\n")
    if markdown:
        Path(markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(markdown).write_text(to_markdown(report))
    if plot:
        Path(plot).parent.mkdir(parents=True, exist_ok=True)
        plot_report(report, plot)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, float)):
        return None if not math.isfinite(float(x)) else float(x)
    if isinstance(x, np.integer):
        return int(x)
    return x
