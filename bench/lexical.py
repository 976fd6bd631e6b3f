"""Which BM25 implementation a collection keeps (issue 33): SQLite FTS5 in the document store
(what index/lexical.py chose), bm25s 0.3.16 and tantivy 0.27, measured on the same SciFact
corpus with the same analyzed terms (bm25s' tokenizer, PyStemmer's English stemmer, English
stopwords).

For each: build time over the corpus, the time to add one document and make it durable (an
upsert: what a collection does at every commit), p50 latency of one query, and nDCG@10 on
SciFact test (ranx). FTS5 is measured through the collection itself (``open_collection``,
``add``, ``commit``, ``search(mode="bm25")``), so its numbers include what a search pays there.
bm25s has no incremental update: its "add one" is a rebuild of the whole index. tantivy is
optional (``pip install tantivy==0.27.0``); without it its row says so.

    flock /work/locks/cpu.lock .venv/bin/python bench/lexical.py

Writes ``bench/results/lexical.json`` and prints the table (docs/storage.md has it).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "lexical.json"
DATA = (ROOT / ".." / "shared" / "data" / "scifact").resolve()


def _ndcg(qrels, run) -> float:
    from embedpool.app.evaluation import score_runs

    return score_runs(qrels, {"r": run}, metrics=("ndcg@10",))["r"]["metrics"]["ndcg@10"]


def _p50(f, queries) -> float:
    lat = []
    for q in queries:
        t = time.perf_counter()
        f(q)
        lat.append(time.perf_counter() - t)
    return 1000 * statistics.median(lat)


def main() -> int:
    import argparse

    import bm25s
    import Stemmer

    from embedpool.app.datasets import load_beir
    from embedpool.index import CollectionSpec, open_collection
    from embedpool.index.lexical import Analyzer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-docs", type=int, help="a slice (a smoke test of this script; writes no results)")
    ap.add_argument("--scale", type=int, nargs="*", default=[4, 16],
                    help="also time one query on the corpus repeated this many times (default 4 16: ~21k, ~83k)")
    args = ap.parse_args()
    data = load_beir(DATA, "test")
    if args.max_docs:
        from embedpool.app.datasets import slice_beir

        data = slice_beir(data, args.max_docs, None, 0)
    ids = [r.id for r in data.corpus]
    texts = [r.text for r in data.corpus]
    qids = list(data.qrels)
    qtexts = [data.queries[q] for q in qids]
    stem = Stemmer.Stemmer("english").stemWords
    analyzer = Analyzer()
    rows = {}
    print(f"SciFact: {len(texts)} documents, {len(qids)} queries", file=sys.stderr)

    # ---- FTS5, through the collection
    with tempfile.TemporaryDirectory() as tmp:
        spec = CollectionSpec(kind="single", model="m", pooler="mean", dim=2, normalized=False)
        vecs = np.ones((len(ids), 2), np.float32)
        t = time.perf_counter()
        coll = open_collection(tmp, "lex", spec)
        coll.add(ids, vecs, texts=texts)
        coll.commit()
        build = time.perf_counter() - t
        t = time.perf_counter()
        coll.add(["new"], vecs[:1], texts=["a new document about cells"])
        coll.commit()
        add_one = time.perf_counter() - t
        coll.delete(["new"])
        coll.commit()
        run = {q: {h.id: h.score for h in hits} for q, hits in
               zip(qids, coll.search(k=100, mode="bm25", texts=qtexts))}
        p50 = _p50(lambda q: coll.search(k=10, mode="bm25", texts=[q]), qtexts)
        coll.close()
    rows["fts5"] = {"build_s": build, "add_one_commit_s": add_one, "p50_ms": p50, "ndcg@10": _ndcg(data.qrels, run),
                    "scoring": "FTS5 bm25(): Robertson idf, k1 1.2, b 0.75", "atomic_with_vectors": True}

    # ---- bm25s (the reference: Lucene idf, k1 1.5) and its Robertson variant
    for method, k1 in (("lucene", 1.5), ("robertson", 1.2)):
        t = time.perf_counter()
        ret = bm25s.BM25(method=method, k1=k1, b=0.75)
        ret.index(bm25s.tokenize(texts, stopwords="en", stemmer=stem, show_progress=False), show_progress=False)
        build = time.perf_counter() - t
        qtok = bm25s.tokenize(qtexts, stopwords="en", stemmer=stem, show_progress=False)
        res, scores = ret.retrieve(qtok, k=100, show_progress=False, n_threads=1)
        run = {q: {ids[int(d)]: float(s) for d, s in zip(r, sc) if s > 0} for q, r, sc in zip(qids, res, scores)}

        def one(q, ret=ret):
            ret.retrieve(bm25s.tokenize([q], stopwords="en", stemmer=stem, show_progress=False), k=10,
                         show_progress=False, n_threads=1)

        rows[f"bm25s-{method}"] = {"build_s": build, "add_one_commit_s": build, "p50_ms": _p50(one, qtexts),
                                   "ndcg@10": _ndcg(data.qrels, run), "atomic_with_vectors": False,
                                   "scoring": f"bm25s {method}, k1 {k1}, b 0.75; no incremental add: a rebuild"}

    # ---- tantivy, on the same analyzed terms (its own "whitespace" tokenizer keeps them as they are)
    try:
        import tantivy
    except ImportError:
        rows["tantivy"] = {"skipped": "pip install tantivy==0.27.0"}
    else:
        with tempfile.TemporaryDirectory() as tmp:
            sb = tantivy.SchemaBuilder()
            sb.add_text_field("id", stored=True, tokenizer_name="raw")
            sb.add_text_field("terms", stored=False, tokenizer_name="whitespace")
            schema = sb.build()
            t = time.perf_counter()
            index = tantivy.Index(schema, path=tmp)
            w = index.writer(heap_size=64 << 20, num_threads=1)
            for i, terms in zip(ids, analyzer.document_terms(texts)):
                w.add_document(tantivy.Document(id=i, terms=terms))
            w.commit()
            w.wait_merging_threads()
            build = time.perf_counter() - t
            t = time.perf_counter()
            w = index.writer(heap_size=64 << 20, num_threads=1)
            w.add_document(tantivy.Document(id="new", terms=" ".join(analyzer.terms(["a new document about cells"])[0])))
            w.commit()
            w.wait_merging_threads()
            add_one = time.perf_counter() - t
            index.reload()
            searcher = index.searcher()

            def search(q, k):
                terms = analyzer.terms([q])[0]
                if not terms:
                    return []
                query = index.parse_query(" OR ".join(dict.fromkeys(terms)), ["terms"])
                return [(s, searcher.doc(a)["id"][0]) for s, a in searcher.search(query, k).hits]

            run = {q: {d: s for s, d in search(text, 100)} for q, text in zip(qids, qtexts)}
            rows["tantivy"] = {"build_s": build, "add_one_commit_s": add_one, "p50_ms": _p50(lambda q: search(q, 10), qtexts),
                               "ndcg@10": _ndcg(data.qrels, run), "atomic_with_vectors": False,
                               "scoring": "tantivy BM25 (Lucene idf, k1 1.2, b 0.75); its own commit"}

    # ---- how each query's cost grows with the corpus: SciFact repeated (FTS5 scores every
    # document that shares a query term; bm25s multiplies a sparse matrix)
    scaling = {}
    for times in args.scale:
        big_ids = [f"{i}~{r}" for r in range(times) for i in ids]
        big_texts = texts * times
        with tempfile.TemporaryDirectory() as tmp:
            coll = open_collection(tmp, "lex", spec)
            for a in range(0, len(big_ids), 20_000):
                coll.add(big_ids[a:a + 20_000], np.ones((len(big_ids[a:a + 20_000]), 2), np.float32),
                         texts=big_texts[a:a + 20_000])
            coll.commit()
            fts = _p50(lambda q: coll.search(k=10, mode="bm25", texts=[q]), qtexts[:50])
            coll.close()
        ret = bm25s.BM25(method="robertson", k1=1.2, b=0.75)
        ret.index(bm25s.tokenize(big_texts, stopwords="en", stemmer=stem, show_progress=False), show_progress=False)
        b25 = _p50(lambda q: ret.retrieve(bm25s.tokenize([q], stopwords="en", stemmer=stem, show_progress=False),
                                          k=10, show_progress=False, n_threads=1), qtexts[:50])
        scaling[len(big_ids)] = {"fts5_p50_ms": fts, "bm25s_p50_ms": b25}
        print(f"{len(big_ids):,} documents: FTS5 p50 {fts:.1f} ms, bm25s p50 {b25:.2f} ms", file=sys.stderr)

    from scale import machine  # noqa: E402  (the CPU flags, load average)

    out = {"corpus": "scifact test", "documents": len(texts), "queries": len(qids), "machine": machine(), "rows": rows,
           "scaling": scaling}
    if not args.max_docs:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print("| implementation | build s | add 1 + commit s | p50 ms/query | nDCG@10 | same commit as vectors |")
    print("|---|---:|---:|---:|---:|---|")
    for name, r in rows.items():
        if "skipped" in r:
            print(f"| {name} | skipped: {r['skipped']} | | | | |")
            continue
        print(f"| {name} | {r['build_s']:.2f} | {r['add_one_commit_s']:.3f} | {r['p50_ms']:.2f} | "
              f"{r['ndcg@10']:.4f} | {'yes' if r['atomic_with_vectors'] else 'no'} |")
    if scaling:
        print("\n| documents (SciFact repeated) | FTS5 p50 ms | bm25s p50 ms |\n|---:|---:|---:|")
        for n, r in scaling.items():
            print(f"| {n:,} | {r['fts5_p50_ms']:.1f} | {r['bm25s_p50_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
