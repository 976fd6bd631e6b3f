"""Long documents through the indexing job: the job cuts its work by tokens and bytes, so how it
cuts it never changes what it stores; a multi-vector collection keeps one companion row per
window of a long document, written with the document, and ``two_stage`` over those rows ranks
as exhaustive MaxSim does once the candidates cover the corpus. The real model, FAISS on disk.
(The job's peak memory on long documents is measured in tests/slow/test_long_job_memory.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from embedpool.app import indexing
from embedpool.app.datasets import CorpusSource
from embedpool.app.indexing import IndexJob
from embedpool.app.retrieval import Search, retrieve
from embedpool.errors import NotFoundError
from embedpool.index import FaissCollection
from embedpool.poolers.encoder import WINDOWED
from job_testutil import assert_same_collections, long_corpus

POOLERS = ["mean", "tokens:window=true", "cluster:pool_factor=4,window=true"]
NAMES = ["L-mean", "L-tokens-window-true", "L-cluster-pool_factor-4-window-true"]


def _windows(embedder, texts: list[str]) -> list[int]:
    """Windows of each text under the windowed plan, as the encoder cuts them."""
    return [len(w) for w in embedder.encoder.windows(texts, WINDOWED, role="document")]


def _run(embedder, corpus, out, **kw) -> dict:
    src = CorpusSource(str(corpus))
    with IndexJob(embedder, out, "L", POOLERS, companion_pooler="fde:per_window=true", source=src.describe(),
                  storage_precision="int8", progress=False, **kw) as job:
        return job.run(src.records(), total=src.count())


def test_small_budgets_cut_the_work_but_store_the_same_vectors(embedder, data_dir, tmp_path, monkeypatch):
    corpus = tmp_path / "long.jsonl"
    recs = long_corpus(corpus, data_dir, n_docs=3, parts=10)  # ~3,000 tokens each
    texts = [r.text for r in recs]
    calls: list[tuple[int, int]] = []  # (texts, tokens as measured) of every embedding call
    real = indexing.embed_by_plan

    def spy(embedder_, texts_, specs, role, **kw):
        tok = kw.get("tokenized")
        assert tok is not None, "the job tokenizes a record once: the call must reuse it"
        calls.append((len(texts_), sum(len(r.ids) for t in tok for rows in t.rows.values() for r in rows)))
        return real(embedder_, texts_, specs, role, **kw)

    monkeypatch.setattr(indexing, "embed_by_plan", spy)
    _run(embedder, corpus, tmp_path / "default")
    assert calls == [(3, calls[0][1])]  # the defaults: 3 documents fit one call
    calls.clear()
    budget = 1500
    _run(embedder, corpus, tmp_path / "small", batch_tokens=budget, commit_bytes=300_000)
    # every document is over the budget: a call of its own (its windows still forwarded a budget at a time)
    assert [n for n, _ in calls] == [1, 1, 1] and all(t > budget for _, t in calls)
    with FaissCollection.open(tmp_path / "small", NAMES[1]) as coll:
        assert coll.stats()["segments"] == 3  # 3 x ~3,000 int8 token rows of 388 bytes: a commit each
    assert_same_collections(tmp_path / "default", tmp_path / "small", NAMES, 3, atol=2e-5)
    with FaissCollection.open(tmp_path / "small", NAMES[1]) as coll:
        assert coll.spec.companion_rows == "window" and coll.spec.companion_pooler.startswith("fde:")
        assert coll.stats()["companion_rows"] == sum(_windows(embedder, texts))
        first = embedder.encoder.windows([texts[0]], WINDOWED, role="document")[0]
        assert len(coll.get(recs[0].id)["vectors"]) == sum(len(w.ids) for w in first)  # every token of every window


def test_per_window_companion_ranks_like_exhaustive_and_deletes_with_the_document(embedder, data_dir, tmp_path):
    corpus = tmp_path / "long.jsonl"
    recs = long_corpus(corpus, data_dir, n_docs=6, parts=6)
    src = CorpusSource(str(corpus))
    out = tmp_path / "d"
    with IndexJob(embedder, out, "w", ["tokens:window=true"], companion_pooler="mean:per_window=true",
                  source=src.describe(), progress=False) as job:
        job.run(src.records(), total=src.count())
    windows = _windows(embedder, [r.text for r in recs])
    assert max(windows) > 1  # long documents: several rows each
    # the needle of each of the first documents: a query that lives inside one window
    queries = [r.text.split(". ")[0] for r in recs[:3]]
    with FaissCollection.open(out, "w") as coll:
        assert coll.stats()["companion_rows"] == sum(windows)
        for i, r in enumerate(recs):  # one row per window, each the mean of that window
            rows = coll.get(r.id)["companion"]
            assert rows.shape == (windows[i], embedder.dim)
        every = Search(coll, embedder.dim, k=len(recs), mode="two_stage", candidates=len(recs))
        exact = Search(coll, embedder.dim, k=len(recs), mode="exhaustive")
        for a, b in zip(retrieve(embedder, queries, every), retrieve(embedder, queries, exact)):
            assert [h.id for h in a] == [h.id for h in b]
            np.testing.assert_allclose([h.score for h in a], [h.score for h in b], rtol=1e-6)
        one = retrieve(embedder, queries[:1], Search(coll, embedder.dim, k=3, mode="two_stage", candidates=1))[0]
        assert len(one) == 1  # candidates count documents, not rows
        gone = one[0].id
        coll.delete([gone])
        coll.commit()
    with FaissCollection.open(out, "w") as coll:  # reopened: the rows went with the document
        left = sum(w for r, w in zip(recs, windows) if r.id != gone)
        assert coll.stats()["companion_rows"] == left
        with pytest.raises(NotFoundError):
            coll.get(gone)
        hits = retrieve(embedder, queries[:1], Search(coll, embedder.dim, k=6, mode="two_stage",
                                                      candidates=len(recs)))[0]
        assert gone not in {h.id for h in hits} and len(hits) == len(recs) - 1
