"""SPLADE collections are sparse collections (issue 49, 1 and 4) on every path that makes one: a
real API server (uvicorn, conftest.py) and the indexing job, on the tiny random-weight SPLADE
model (splade_testutil.py). They take documents, find them by the exact dot product of the
weights (sentence-transformers' SparseEncoder on the same folder is the reference), replace and
delete them, and store (token id, weight) pairs: bytes per document far below the vocabulary's
4 bytes an entry that the dense collection of the same pooler takes. On the Milvus backend (Milvus
Lite under a server in this process) too."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from embedpool.app.datasets import Record
from embedpool.app.indexing import IndexJob
from embedpool.app.retrieval import Search, retrieve
from embedpool.app.server import create_app
from embedpool.app.settings import Settings
from embedpool.index import open_collection
from server_testutil import Uvicorn

DOCS = {"cat": "the cat sat on the mat", "market": "stock market fell and investors sold shares",
        "rain": "heavy rain and storm for the weekend", "dog": "a dog sat with the cat"}
QUERIES = {"market fell": "market", "the cat sat": "cat", "rain storm": "rain"}


@pytest.fixture(scope="module")
def exact(splade_server):
    """The reference scores [query, document] (SparseEncoder's weights, float64 dot products)."""
    ref = splade_server.reference
    d = ref.encode(list(DOCS.values()), convert_to_tensor=True).to_dense().numpy().astype(np.float64)
    q = ref.encode(list(QUERIES), convert_to_tensor=True).to_dense().numpy().astype(np.float64)
    scores = q @ d.T
    assert [list(DOCS)[j] for j in scores.argmax(1)] == list(QUERIES.values())  # the data tells them apart
    return scores, d


@pytest.fixture(scope="module")
def splade_embedder(splade_server):
    from embedpool.poolers import Embedder, FrozenEncoder

    return Embedder(FrozenEncoder(splade_server.model_path, precision="fp32"))


def _search(c, name: str, k: int = 4) -> list[dict[str, float]]:
    r = c.post(f"/collections/{name}/search", json={"queries": list(QUERIES), "k": k})
    assert r.status_code == 200, r.text
    return [{h["id"]: h["score"] for h in hits} for hits in r.json()["results"]]


def test_a_splade_collection_made_over_http_is_sparse_and_finds_its_documents(splade_server, exact):
    scores, dense = exact
    vocab = dense.shape[1]
    with splade_server.client() as c:
        r = c.post("/collections", json={"name": "sparse-http", "pooler": "splade"})
        assert r.status_code == 201, r.text
        info = r.json()
        assert (info["kind"], info["factory"], info["normalized"], info["metric"], info["dim"]) == \
            ("sparse", "auto", False, "ip", vocab)
        r = c.post("/collections/sparse-http/documents", json=[{"id": k, "text": t} for k, t in DOCS.items()])
        assert r.status_code == 200, r.text
        for i, got in enumerate(_search(c, "sparse-http")):
            assert max(got, key=got.get) == list(QUERIES.values())[i]
            np.testing.assert_allclose([got[k] for k in DOCS], scores[i], rtol=1e-4, atol=1e-6)
        stats = c.get("/collections/sparse-http").json()["stats"]
        nnz = np.count_nonzero(dense, axis=1).mean()
        assert stats["bytes_per_doc"] == pytest.approx(nnz * 6 + 16)  # uint16 token id + float32 weight
        doc = c.get("/collections/sparse-http/documents/cat", params={"include_vector": True}).json()
        assert doc["vector"]["indices"] == np.flatnonzero(dense[0]).tolist()
        np.testing.assert_allclose(doc["vector"]["values"], dense[0][dense[0] != 0], rtol=1e-5)

        # replace and delete
        r = c.post("/collections/sparse-http/documents", json=[{"id": "market", "text": "the cat sat on the mat"}])
        assert r.status_code == 200, r.text
        c.delete("/collections/sparse-http/documents/cat")
        got = _search(c, "sparse-http")
        assert "cat" not in got[1] and got[1]["market"] == pytest.approx(scores[1][0], rel=1e-4)
        assert c.get("/collections/sparse-http").json()["documents"] == 3
        assert c.delete("/collections/sparse-http").status_code == 200


def test_sparse_rows_take_far_fewer_bytes_than_the_vocabulary(splade_server, exact):
    """The random tiny model's weights are hardly sparse (most of its 85 entries are non-zero, where
    a real SPLADE model's ~285 of 30,522 are), so ``top_k=10`` makes them as sparse as SPLADE's;
    the same pooler stored dense (kind ``single``, as before sparse collections) takes the whole
    vocabulary, 4 bytes an entry."""
    vocab = exact[1].shape[1]
    bpd = {}
    with splade_server.client() as c:
        for kind in ("sparse", "single"):
            r = c.post("/collections", json={"name": f"bytes-{kind}", "pooler": "splade:top_k=10", "kind": kind})
            assert r.status_code == 201, r.text
            r = c.post(f"/collections/bytes-{kind}/documents", json=[{"id": k, "text": t} for k, t in DOCS.items()])
            assert r.status_code == 200, r.text
            bpd[kind] = c.get(f"/collections/bytes-{kind}").json()["stats"]["bytes_per_doc"]
            assert c.delete(f"/collections/bytes-{kind}").status_code == 200
    assert bpd["sparse"] == pytest.approx(10 * 6 + 16)
    assert bpd["single"] >= vocab * 4 > 4 * bpd["sparse"]
    print(f"tiny SPLADE top_k=10 ({vocab} entries): bytes per document dense {bpd['single']:.1f}, "
          f"sparse {bpd['sparse']:.1f}")


@pytest.mark.parametrize("body, field", [
    ({"kind": "multi"}, "kind"), ({"factory": "HNSW32"}, "factory"), ({"factory": "seismic:nope=1"}, "factory")])
def test_a_splade_collection_refuses_options_it_cannot_have(splade_server, body, field):
    with splade_server.client() as c:
        r = c.post("/collections", json={"name": "sparse-bad", "pooler": "splade", **body})
        assert r.status_code == 422 and r.json()["param"] == field, r.text
        assert c.get("/collections/sparse-bad").status_code == 404


def test_kind_sparse_is_for_sparse_poolers(server):
    with server.client() as c:
        r = c.post("/collections", json={"name": "sparse-mean", "pooler": "mean", "kind": "sparse"})
        assert r.status_code == 422 and r.json()["param"] == "kind" and "dense vectors" in r.text


@pytest.mark.parametrize("backend", ["faiss", "milvus"])
def test_the_indexing_job_makes_the_same_sparse_collection_and_search_finds_it(splade_server, splade_embedder,
                                                                                exact, tmp_path, backend):
    """On both backends (Milvus: Milvus Lite); a rerun resumes from the state the job committed
    in the collection: nothing left to index."""
    scores, dense = exact
    records = [Record(k, t) for k, t in DOCS.items()]
    where = {"backend": backend, "milvus_uri": str(tmp_path / "milvus.db")}
    for run, want in enumerate((len(DOCS), 0)):
        with IndexJob(splade_embedder, tmp_path, "sparse-job", ["splade"], commit_every=2, progress=False,
                      **where) as job:
            summary = job.run(iter(records))
        assert summary["collections"][0]["kind"] == "sparse" and summary["indexed_this_run"] == want, run
    with open_collection(tmp_path, "sparse-job", **where) as coll:
        assert coll.spec.kind == "sparse" and coll.spec.factory == "auto" and len(coll) == len(DOCS)
        st = coll.stats()
        assert st["bytes_per_doc"] == pytest.approx(np.count_nonzero(dense, axis=1).mean() * 6 + 16)
        hits = retrieve(splade_embedder, list(QUERIES), Search(coll, splade_embedder.natural_dim, k=4))
        for i, h in enumerate(hits):
            assert h[0].id == list(QUERIES.values())[i]
            np.testing.assert_allclose([{x.id: x.score for x in h}[k] for k in DOCS], scores[i], rtol=1e-4,
                                       atol=1e-6)


def test_a_splade_collection_made_over_http_on_milvus_accepts_and_finds_documents(splade_embedder, exact, tmp_path):
    """The same HTTP path on the Milvus backend (Milvus Lite: SPARSE_FLOAT_VECTOR rows under
    Milvus' sparse inverted index): the same scores, bytes per document and rows as the FAISS
    collection above, replace, delete, a filter and hybrid search."""
    scores, dense = exact
    settings = Settings(data_dir=str(tmp_path), precision="fp32", backend="milvus",
                        milvus_uri=str(tmp_path / "milvus.db"))
    with Uvicorn(create_app(settings, embedder=splade_embedder)) as url, \
            httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/collections", json={"name": "sparse-milvus", "pooler": "splade"})
        assert r.status_code == 201, r.text
        assert (r.json()["kind"], r.json()["factory"]) == ("sparse", "auto")
        r = c.post("/collections/sparse-milvus/documents",
                   json=[{"id": k, "text": t, "metadata": {"n": j}} for j, (k, t) in enumerate(DOCS.items())])
        assert r.status_code == 200, r.text
        for i, got in enumerate(_search(c, "sparse-milvus")):
            assert max(got, key=got.get) == list(QUERIES.values())[i]
            np.testing.assert_allclose([got[k] for k in got], [scores[i][list(DOCS).index(k)] for k in got],
                                       rtol=1e-4, atol=1e-6)
        info = c.get("/collections/sparse-milvus").json()
        assert info["stats"]["index_type"] == "SPARSE_INVERTED_INDEX"
        assert info["stats"]["bytes_per_doc"] == pytest.approx(np.count_nonzero(dense, axis=1).mean() * 6 + 16)
        doc = c.get("/collections/sparse-milvus/documents/cat", params={"include_vector": True}).json()
        assert doc["vector"]["indices"] == np.flatnonzero(dense[0]).tolist()
        r = c.post("/collections/sparse-milvus/search",
                   json={"queries": ["the cat sat"], "k": 4, "filter": {"n": {"$gte": 2}}})
        assert r.status_code == 200 and [h["id"] for h in r.json()["results"][0]][:1] == ["dog"], r.text
        r = c.post("/collections/sparse-milvus/search", json={"queries": ["rain storm"], "k": 1, "mode": "hybrid"})
        assert r.status_code == 200 and r.json()["results"][0][0]["id"] == "rain", r.text

        r = c.post("/collections/sparse-milvus/documents", json=[{"id": "market", "text": "the cat sat on the mat"}])
        assert r.status_code == 200, r.text
        assert c.delete("/collections/sparse-milvus/documents/cat").status_code == 200
        got = _search(c, "sparse-milvus")
        assert "cat" not in got[1] and got[1]["market"] == pytest.approx(scores[1][0], rel=1e-4)
        assert c.get("/collections/sparse-milvus").json()["documents"] == 3
        assert c.delete("/collections/sparse-milvus").status_code == 200
