"""embedpool against a real Milvus standalone server (PyPI's ``milvus`` 2.3, ``make milvus-server``;
tests/milvus_testutil.py starts and stops it), as a deployment runs it: two API replicas and an
indexing job on one server, every write visible to both (the faults: test_milvus_server_faults.py).
Minutes on 2 cores: ``make test-slow``.

What 2.3 lacks (nullable fields, INVERTED indexes, grouping search) is replaced here as
index/milvus/versions.py says; the same collections work on Milvus Lite (the default suite).
"""

from __future__ import annotations

import pytest

from embedpool.app.datasets import CorpusSource
from embedpool.app.indexing import IndexJob
from embedpool.index.milvus.versions import features_of
from test_index_job import _corpus

pytestmark = pytest.mark.slow

NOTES = [{"id": "cat", "text": "The cat purred on the warm windowsill."},
         {"id": "stocks", "text": "Stock markets fell sharply as investors sold shares."},
         {"id": "rain", "text": "Heavy rain and storms are forecast for the weekend.", "metadata": {"kind": "weather"}}]


def test_the_server_is_2_3_and_embedpool_says_so(milvus_server, replicas):
    f = features_of(milvus_server.version())
    assert f.version[:2] == (2, 3) and not f.nullable and not f.inverted_index
    with replicas[0].client() as c:
        storage = c.get("/health").json()["storage"]
    assert storage == {"backend": "milvus", "status": "ok", "location": milvus_server.uri,
                       "version": f.name}


def test_two_replicas_and_a_job_on_one_server_see_every_write(replicas, milvus_server, embedder, data_dir,
                                                              tmp_path):
    a, b = replicas
    corpus = tmp_path / "corpus.jsonl"
    recs = _corpus(corpus, data_dir, 30, chars=300)
    src = CorpusSource(str(corpus))
    # the job writes a single- and a multi-vector collection (the two failures on 2.3)
    with IndexJob(embedder, tmp_path / "job", "sf", ["mean", "cluster:pool_factor=4"], source=src.describe(),
                  commit_every=10, batch_docs=10, progress=False, backend="milvus",
                  milvus_uri=milvus_server.uri) as job:
        summary = job.run(src.records(), total=src.count())
    names = sorted(c["collection"] for c in summary["collections"])
    assert summary["indexed_this_run"] == 30 and len(names) == 2
    with a.client() as ca, b.client() as cb:
        for c in (ca, cb):  # the job's collections, from both replicas
            listed = {x["name"]: x["documents"] for x in c.get("/collections").json()["collections"]}
            assert {n: listed.get(n) for n in names} == {n: 30 for n in names}
            for n in names:
                modes = ["exhaustive", "tokens", "two_stage"] if "cluster" in n else [None]
                for mode in modes:
                    r = c.post(f"/collections/{n}/search", json={"query": recs[7].text, "k": 3,
                                                                  **({"mode": mode} if mode else {})})
                    assert r.status_code == 200, r.text
                    assert r.json()["hits"][0]["id"] == recs[7].id, (n, mode)
        # a write through one replica is read through the other at once
        assert ca.post("/collections", json={"name": "notes"}).status_code == 201
        r = ca.post("/collections/notes/documents", json=NOTES)
        assert r.status_code == 200, r.text
        got = cb.get("/collections/notes/documents/rain").json()
        assert (got["text"], got["metadata"]) == (NOTES[2]["text"], {"kind": "weather"})
        assert cb.get("/collections/notes/documents/cat").json()["metadata"] is None  # missing stays missing
        hits = cb.post("/collections/notes/search", json={"query": "a kitten asleep in the sun", "k": 1}).json()
        assert hits["hits"][0]["id"] == "cat"
        assert cb.delete("/collections/notes/documents/stocks").status_code == 200
        assert ca.get("/collections/notes/documents/stocks").status_code == 404
        assert ca.get("/collections/notes").json()["documents"] == 2
        for n in [*names, "notes"]:  # a restart later recovers only what the next tests load
            assert cb.delete(f"/collections/{n}").status_code == 200
        assert ca.get("/collections/notes").status_code == 404


def test_session_reads_see_their_own_writes_at_once_and_what_strong_reads_see(milvus_server, tmp_path):
    """``milvus_consistency="Session"`` (the server's EMBEDPOOL_MILVUS_CONSISTENCY): a collection
    object's reads skip the wait for the server's time tick that ``Strong`` reads make, and still
    see this client's own writes at once -- here a write then its read, three rounds, with a
    ``Strong`` object on the same collection reading the same."""
    import numpy as np

    from embedpool.errors import InvalidError
    from embedpool.index import CollectionSpec, delete_collection, open_collection

    where = {"backend": "milvus", "milvus_uri": milvus_server.uri}
    spec = CollectionSpec(kind="single", model="m", pooler="mean", dim=8)
    rng = np.random.default_rng(0)
    with pytest.raises(InvalidError, match="Strong, Session, Bounded, Eventually"):
        open_collection(tmp_path, "reads", spec, **where, milvus_consistency="session")
    try:
        with open_collection(tmp_path, "reads", spec, **where, milvus_consistency="Session") as mine, \
                open_collection(tmp_path, "reads", **where) as strong:
            for r in range(3):
                ids = [f"r{r}-{i}" for i in range(4)]
                x = rng.standard_normal((4, 8)).astype(np.float32)
                x /= np.linalg.norm(x, axis=1, keepdims=True)
                mine.add(ids, x, texts=ids)
                assert mine.get(ids[-1])["text"] == ids[-1]
                assert [h[0].id for h in mine.search(x, k=1)] == ids
                assert len(mine) == len(strong) == 4 * (r + 1)
                assert [h.id for h in strong.search(x[:1], k=3)[0]] == [h.id for h in mine.search(x[:1], k=3)[0]]
    finally:
        delete_collection(tmp_path, "reads", **where)
