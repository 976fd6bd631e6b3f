"""A multi-vector collection created over HTTP with a companion pooler keeps its companion rows
itself: every upsert writes them, ``two_stage`` takes its candidates from them (the same hits as
the collection ``embedpool index`` builds from the same documents), a delete removes them; a
companion given the old way, as a collection name, is refused with what to send instead. A real
uvicorn server (fp32, as the in-process model), FAISS on disk."""

from __future__ import annotations

import numpy as np

from embedpool.app.datasets import CorpusSource
from embedpool.app.indexing import IndexJob
from embedpool.poolers.encoder import WINDOWED
from job_testutil import long_corpus

POOLER = "tokens:window=true"
COMPANION = "mean:per_window=true"


def test_http_collection_keeps_per_window_companion_rows(server, client, embedder, data_dir, tmp_path):
    recs = long_corpus(tmp_path / "long.jsonl", data_dir, n_docs=4, parts=4)
    windows = {r.id: len(w) for r, w in zip(recs, embedder.encoder.windows([r.text for r in recs], WINDOWED,
                                                                           role="document"))}
    assert max(windows.values()) > 1
    r = client.post("/collections", json={"name": "lw-http", "pooler": POOLER, "companion_pooler": COMPANION})
    assert r.status_code == 201, r.text
    info = r.json()
    assert (info["kind"], info["companion_pooler"], info["companion_rows"], info["companion_dim"]) == \
        ("multi", COMPANION, "window", 384)
    r = client.post("/collections/lw-http/documents", json=[{"id": x.id, "text": x.text} for x in recs])
    assert r.status_code == 200, r.text
    assert client.get("/collections/lw-http").json()["stats"]["companion_rows"] == sum(windows.values())

    # the same documents through the indexing job, into the server's data dir
    src = CorpusSource(str(tmp_path / "long.jsonl"))
    with IndexJob(embedder, server.data_dir, "lw-cli", [POOLER], companion_pooler=COMPANION, source=src.describe(),
                  progress=False) as job:
        job.run(src.records())
    queries = [x.text.split(". ")[0] for x in recs]
    body = {"queries": queries, "k": 3, "mode": "two_stage", "candidates": 2}
    a = client.post("/collections/lw-http/search", json=body)
    b = client.post("/collections/lw-cli/search", json=body)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    for ha, hb in zip(a.json()["results"], b.json()["results"]):
        assert [h["id"] for h in ha] == [h["id"] for h in hb] and len(ha) == 2  # 2 candidate documents
        np.testing.assert_allclose([h["score"] for h in ha], [h["score"] for h in hb], atol=1e-4)

    gone = recs[1].id
    assert client.delete(f"/collections/lw-http/documents/{gone}").status_code == 200
    stats = client.get("/collections/lw-http").json()["stats"]
    assert stats["companion_rows"] == sum(windows.values()) - windows[gone] and stats["documents"] == 3
    r = client.post("/collections/lw-http/search", json={"query": recs[1].text.split(". ")[0], "k": 4,
                                                           "mode": "two_stage", "candidates": 4})
    assert r.status_code == 200 and gone not in {h["id"] for h in r.json()["hits"]}


def test_http_companion_errors_say_what_to_send(client):
    assert client.post("/collections", json={"name": "lw-single", "pooler": "mean"}).status_code == 201
    r = client.post("/collections", json={"name": "lw-old", "pooler": "tokens", "companion": "lw-single"})
    assert r.status_code == 422 and "pooler" in r.json()["error"] and "lw-single" in r.json()["error"]
    r = client.post("/collections", json={"name": "lw-multi", "pooler": "tokens", "companion_pooler": "cluster"})
    assert r.status_code == 422 and "single-vector" in r.json()["error"]
    r = client.post("/collections", json={"name": "lw-auto", "pooler": "tokens:window=true",
                                          "companion_pooler": "auto"})
    assert r.status_code == 201 and r.json()["companion_pooler"] == COMPANION
    r = client.post("/collections", json={"name": "lw-plain", "pooler": "tokens", "companion": "auto"})  # older name
    assert r.status_code == 201 and (r.json()["companion_pooler"], r.json()["companion_rows"]) == ("mean", "document")
    # a collection without a companion answers two_stage with a 422 that names the way to get one
    assert client.post("/collections", json={"name": "lw-none", "pooler": "tokens",
                                             "companion_pooler": "none"}).status_code == 201
    assert client.post("/collections/lw-none/documents", json=[{"id": "a", "text": "x"}]).status_code == 200
    r = client.post("/collections/lw-none/search", json={"query": "x", "mode": "two_stage"})
    assert r.status_code == 422 and "keeps no companion vectors" in r.json()["error"] \
        and "companion_pooler" in r.json()["error"]
    # asked again with the field left out (as a client made it before multi-vector collections had
    # a default companion), it is the same collection, not a conflict
    r = client.post("/collections", json={"name": "lw-none", "pooler": "tokens"})
    assert r.status_code == 200 and r.json()["companion_pooler"] is None, r.text
    for name in ("lw-single", "lw-auto", "lw-plain", "lw-none"):
        client.delete(f"/collections/{name}")
