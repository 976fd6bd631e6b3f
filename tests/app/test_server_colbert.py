"""A ColBERT (PyLate) model served: a real uvicorn server on the tiny ColBERT model PyLate saved
(tests/family_models.py). Its default pooler (auto = tokens) gives PyLate's vectors over HTTP;
a collection made on it stores them (the model's 16-d projection, not the transformer's 32-d
states), and exhaustive MaxSim, two-stage through its mean companion, /rerank, Cohere's
/v1/rerank and TEI's /tei/embed_all and /tei/rerank all rank by PyLate's own MaxSim."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import Server
from family_models import COLBERT, DOCUMENTS, QUERIES

DOCS = [d for d in DOCUMENTS if d]


def pylate_maxsim(q: np.ndarray, d: np.ndarray) -> float:
    """ColBERT's score, written out: the sum over query vectors of their best dot product."""
    return float((q @ d.T).max(1).sum())


@pytest.fixture(scope="module")
def colbert_server(colbert_reference, tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("colbert-server"),
               {"EMBEDPOOL_MODEL": str(colbert_reference["path"]), "EMBEDPOOL_PRECISION": "fp32"})
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def test_colbert_served_at_parity_with_pylate(colbert_server, colbert_reference):
    ref = colbert_reference
    qvecs = ref["queries"]
    dvecs = [v for d, v in zip(DOCUMENTS, ref["documents"]) if d]
    dim = COLBERT["embedding_size"]
    with colbert_server.client() as c:
        info = c.get("/info").json()
        assert info["dim"] == dim, info
        r = c.post("/embed", json={"inputs": QUERIES, "role": "query"})
        assert r.status_code == 200, r.text
        got = r.json()["embeddings"] if isinstance(r.json(), dict) else r.json()
        for a, b in zip(got, qvecs):
            a = np.asarray(a, np.float32)
            assert a.shape == b.shape and np.allclose(a, b, atol=1e-4)

        # a collection on the model's own pooler: PyLate's vectors, MaxSim ranking
        r = c.post("/collections", json={"name": "cb", "pooler": "auto", "companion_pooler": "auto"})
        assert r.status_code == 201, r.text
        made = r.json()
        assert (made["kind"], made["dim"], made["companion_dim"]) == ("multi", dim, dim), made
        r = c.post("/collections/cb/documents", json=[{"id": f"d{i}", "text": t} for i, t in enumerate(DOCS)])
        assert r.status_code == 200, r.text
        expected = [[pylate_maxsim(q, d) for d in dvecs] for q in qvecs]
        for mode in ("exhaustive", "two_stage"):
            r = c.post("/collections/cb/search", json={"queries": QUERIES, "k": len(DOCS), "mode": mode,
                                                       "candidates": len(DOCS)})
            assert r.status_code == 200, (mode, r.text)
            for hits, want in zip(r.json()["results"], expected):
                assert [h["id"] for h in hits] == [f"d{i}" for i in np.argsort(-np.asarray(want), kind="stable")], mode

        # rerank routes: MaxSim of PyLate's vectors
        q = QUERIES[0]
        raw = c.post("/rerank", json={"query": q, "texts": DOCS, "raw_scores": True, "truncate": True}).json()
        assert np.allclose([x["score"] for x in sorted(raw, key=lambda x: x["index"])], expected[0], atol=1e-3)
        cohere = c.post("/v1/rerank", json={"query": q, "documents": DOCS}).json()
        assert [x["index"] for x in cohere["results"]] == [x["index"] for x in raw]
        tei = c.post("/tei/rerank", json={"query": q, "texts": DOCS}).json()
        assert [x["index"] for x in tei] == [x["index"] for x in raw]
        embed_all = c.post("/tei/embed_all", json={"inputs": DOCS}).json()
        for a, b in zip(embed_all, dvecs):
            assert np.allclose(np.asarray(a, np.float32), b, atol=1e-4)
