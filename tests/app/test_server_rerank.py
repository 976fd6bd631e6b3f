"""``POST /rerank`` against the real server: scores against a plain MaxSim / cosine written
here, errors, one batcher round, the cache, and SciFact: reranking the ``mean`` top-100 with
``tokens`` reaches the nDCG@10 of ``two_stage`` search on a collection."""

from __future__ import annotations

import re

import numpy as np
import pytest

QUERY = "How do plants make their food?"
TEXTS = [
    "Photosynthesis turns light, water and carbon dioxide into sugar in the leaves.",
    "The stock market closed higher on Friday.",
    "Plants take up water and minerals through their roots.",
    "A recipe for sourdough bread needs flour, water and salt.",
    "Chlorophyll absorbs red and blue light.",
]


def embed(client, texts, pooler, role="document"):
    r = client.post("/embed", json={"inputs": texts, "pooler": pooler, "role": role, "truncate": True})
    assert r.status_code == 200, r.text
    return [np.asarray(e, dtype=np.float64) for e in r.json()["embeddings"]]


def reference_maxsim(q: np.ndarray, d: np.ndarray) -> float:
    """ColBERT's late interaction: each query vector's best dot product in the document, summed."""
    return float(sum(max(float(np.dot(qi, dj)) for dj in d) for qi in q))


def rounds(client) -> float:
    text = client.get("/metrics").text
    return float(re.search(r"^embedpool_batch_size_count (\S+)$", text, re.M).group(1))


def test_rerank_maxsim_order_and_indices(client):
    r = client.post("/rerank", json={"query": QUERY, "texts": TEXTS, "return_text": True})
    assert r.status_code == 200, r.text
    ranks = r.json()
    assert sorted(x["index"] for x in ranks) == list(range(len(TEXTS)))
    assert [x["score"] for x in ranks] == sorted((x["score"] for x in ranks), reverse=True)
    assert all(x["text"] == TEXTS[x["index"]] for x in ranks)
    # the default pooler is `tokens`, the query in the query role, the texts as documents
    q = embed(client, [QUERY], "tokens", role="query")[0]
    docs = embed(client, TEXTS, "tokens")
    want = [reference_maxsim(q, d) / len(q) for d in docs]
    got = {x["index"]: x["score"] for x in ranks}
    assert np.allclose([got[i] for i in range(len(TEXTS))], want, atol=1e-5)
    assert [x["index"] for x in ranks] == list(np.argsort(-np.asarray(want), kind="stable"))
    assert {ranks[0]["index"], ranks[1]["index"]} == {0, 2}  # the two texts about plants
    raw = client.post("/rerank", json={"query": QUERY, "texts": TEXTS, "raw_scores": True}).json()
    assert [x["index"] for x in raw] == [x["index"] for x in ranks] and "text" not in raw[0]
    assert np.allclose([x["score"] for x in raw], [x["score"] * len(q) for x in ranks], atol=1e-4)


def test_rerank_cosine_for_single_vector_poolers(client, st_model):
    ranks = client.post("/rerank", json={"query": QUERY, "texts": TEXTS, "pooler": "mean"}).json()
    # sentence-transformers' own cosine similarity on the same model is the reference
    ref = st_model.similarity(st_model.encode([QUERY]), st_model.encode(TEXTS)).numpy()[0]
    got = {x["index"]: x["score"] for x in ranks}
    assert np.allclose([got[i] for i in range(len(TEXTS))], ref, atol=1e-5)
    assert [x["index"] for x in ranks] == list(np.argsort(-ref, kind="stable"))


def test_rerank_query_and_texts_share_one_batcher_round(client):
    texts = [f"{t} (round check)" for t in TEXTS]  # not in the rerank cache yet
    before = rounds(client)
    assert client.post("/rerank", json={"query": QUERY + " (round check)", "texts": texts}).status_code == 200
    assert rounds(client) - before == 1
    # seen texts come from the cache: only the query is encoded, the answer is the same
    again = client.post("/rerank", json={"query": QUERY + " (round check)", "texts": texts}).json()
    first = client.post("/rerank", json={"query": QUERY + " (round check)", "texts": texts + ["new one"]}).json()
    kept = [x for x in first if x["index"] < len(texts)]
    assert [x["index"] for x in kept] == [x["index"] for x in again]
    assert np.allclose([x["score"] for x in kept], [x["score"] for x in again], atol=1e-6)  # BLAS blocking


def test_rerank_duplicates_and_one_text(client):
    ranks = client.post("/rerank", json={"query": QUERY, "texts": [TEXTS[0], TEXTS[1], TEXTS[0]]}).json()
    by_index = {x["index"]: x["score"] for x in ranks}
    assert by_index[0] == by_index[2] and len(ranks) == 3
    assert [x["index"] for x in ranks][:2] == [0, 2]  # ties keep request order
    assert [x["index"] for x in client.post("/rerank", json={"query": QUERY, "texts": ["one"]}).json()] == [0]


def test_rerank_errors(server, client):
    r = client.post("/rerank", json={"query": QUERY, "texts": []})
    assert r.status_code == 422 and r.json()["error"].startswith("texts: empty list")
    long_query = "why " * 300
    r = client.post("/rerank", json={"query": long_query, "texts": TEXTS})
    assert r.status_code == 422, r.text
    msg = r.json()["error"]
    assert msg.startswith("query: 302 tokens, over the model's window of 256") and "truncate=true" in msg
    assert client.post("/rerank", json={"query": long_query, "texts": TEXTS, "truncate": True}).status_code == 200
    r = client.post("/rerank", json={"query": QUERY, "texts": TEXTS[:2] + ["word " * 300]})
    assert r.status_code == 422 and r.json()["error"].startswith("texts[2]: 302 tokens")
    r = client.post("/rerank", json={"query": "x" * 100_001, "texts": TEXTS})
    assert r.status_code == 413 and "query" in r.json()["error"] and "max_input_chars" in r.json()["error"]
    r = client.post("/rerank", json={"query": QUERY, "texts": TEXTS, "pooler": "mean:window=true"})
    assert r.status_code == 422, r.text
    assert "gives one vector per text" in r.json()["error"] and "multi-vector poolers (cluster, tokens)" in r.json()["error"]
    r = client.post("/rerank", json={"query": QUERY, "texts": TEXTS, "documents": TEXTS})
    assert r.status_code == 422 and "documents" in r.json()["error"]
    server.alive()


def test_rerank_needs_the_api_key(limited_server):
    with limited_server.client(auth=False) as c:
        assert c.post("/rerank", json={"query": QUERY, "texts": TEXTS}).status_code == 401
    with limited_server.client() as c:
        assert c.post("/rerank", json={"query": QUERY, "texts": TEXTS}).status_code == 200


# ---------------------------------------------------------------------- SciFact
@pytest.fixture(scope="module")
def scifact_collections(server, embedder, data_dir):
    """A SciFact slice (50 test queries, their relevant documents and distractors) indexed by
    `embedpool index`'s job into the server's data folder: `tokens` with a `mean` companion."""
    from embedpool.app import datasets as ev
    from embedpool.app.indexing import IndexJob

    data = ev.slice_beir(ev.load_beir(data_dir / "scifact", "test"), max_docs=160, max_queries=50, seed=1)
    assert len(data.queries) == 50
    with IndexJob(embedder, server.data_dir, "sf-rerank", ["tokens", "mean"], companion_pooler="mean",
                  progress=False) as job:
        job.run(data.corpus)
        names = {t.spec: t.name for t in job.targets.values()}
    return data, names


CANDIDATES = 50  # each query reranks this many documents over HTTP (the test's cost)


def test_rerank_scifact_matches_two_stage(client, scifact_collections):
    from embedpool.app.evaluation import score_runs

    data, names = scifact_collections
    qids = list(data.queries)
    queries = [data.queries[q] for q in qids]
    two = client.post(f"/collections/{names['tokens']}/search",
                      json={"queries": queries, "k": 10, "mode": "two_stage", "candidates": CANDIDATES,
                            "include_text": False})
    assert two.status_code == 200, two.text
    top = client.post(f"/collections/{names['mean']}/search", json={"queries": queries, "k": CANDIDATES})
    assert top.status_code == 200, top.text
    runs = {"two_stage": {}, "rerank": {}}
    for qid, query, hits2, hits in zip(qids, queries, two.json()["results"], top.json()["results"]):
        runs["two_stage"][qid] = {h["id"]: h["score"] for h in hits2}
        assert len(hits) == CANDIDATES
        r = client.post("/rerank", json={"query": query, "texts": [h["text"] for h in hits], "truncate": True,
                                         "raw_scores": True})
        assert r.status_code == 200, r.text
        ranks = r.json()
        assert sorted(x["index"] for x in ranks) == list(range(CANDIDATES))
        runs["rerank"][qid] = {hits[x["index"]]["id"]: x["score"] for x in ranks[:10]}
        # the same MaxSim scores rank by rank as two_stage over the same candidates, and the same
        # documents but for near-ties (the collection's vectors were encoded in other batches)
        for i, (x, h) in enumerate(zip(ranks[:10], hits2)):
            assert abs(x["score"] - h["score"]) < 1e-3, qid
            if hits[x["index"]]["id"] != h["id"]:
                near = [hits2[j]["score"] for j in (i - 1, i + 1) if 0 <= j < len(hits2)]
                assert any(abs(h["score"] - s) < 1e-3 for s in near), qid
    scores = score_runs(data.qrels, runs, metrics=("ndcg@10",))
    a, b = scores["rerank"]["metrics"]["ndcg@10"], scores["two_stage"]["metrics"]["ndcg@10"]
    print(f"\nSciFact slice ({len(data.corpus)} docs, {len(qids)} queries): /rerank tokens over mean top-{CANDIDATES} "
          f"nDCG@10 {a:.4f}, two_stage search {b:.4f}")
    assert abs(a - b) <= 0.002
    assert a > 0.5  # MaxSim over MiniLM tokens on SciFact is ~0.6; a broken ranking is far lower


def test_rerank_a_20000_token_document(client):
    long = " ".join(["leaf sun"] * 10_000)  # 20,000 tokens in 90,000 characters
    r = client.post("/rerank", json={"query": QUERY, "texts": [long, TEXTS[1]], "truncate": True})
    assert r.status_code == 200, r.text
    assert r.json()[0]["index"] == 0
    r = client.post("/rerank", json={"query": QUERY, "texts": [long, TEXTS[1]], "pooler": "tokens:window=true",
                                     "truncate": True})
    assert r.status_code == 200 and r.json()[0]["index"] == 0  # every window's tokens are scored
