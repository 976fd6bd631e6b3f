"""embedpool against a real Milvus standalone server (PyPI's ``milvus`` 2.3, ``make milvus-server``;
tests/milvus_testutil.py starts and stops it), as a deployment runs it: two API replicas and an
indexing job on one server, the server SIGKILLed mid-job and restarted, the server down under the
replicas. Minutes on 2 cores: ``make test-slow``.

What 2.3 lacks (nullable fields, INVERTED indexes, grouping search) is replaced here as
index/milvus/versions.py says; the same collections work on Milvus Lite (the default suite).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from embedpool.app.datasets import CorpusSource
from embedpool.app.indexing import JOB_PROPERTY, IndexJob
from embedpool.index import BackendError, open_collection
from embedpool.index.milvus.versions import features_of
from job_testutil import assert_same_collections
from test_index_job import _corpus

pytestmark = pytest.mark.slow

NOTES = [{"id": "cat", "text": "The cat purred on the warm windowsill."},
         {"id": "stocks", "text": "Stock markets fell sharply as investors sold shares."},
         {"id": "rain", "text": "Heavy rain and storms are forecast for the weekend.", "metadata": {"kind": "weather"}}]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, start_server, milvus_server):
    """Two API servers on one Milvus server (each its own data directory, as on two machines)."""
    env = {"EMBEDPOOL_BACKEND": "milvus", "EMBEDPOOL_MILVUS_URI": milvus_server.uri, "EMBEDPOOL_PRECISION": "fp32"}
    a = start_server(tmp_path_factory.mktemp("replica-a"), env)
    b = start_server(tmp_path_factory.mktemp("replica-b"), env)
    return a.wait_ready(), b.wait_ready()


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


def test_milvus_down_health_says_so_requests_503_nothing_lost(replicas, milvus_server):
    a, b = replicas
    with a.client() as ca, b.client() as cb:
        before = {n: ca.get(f"/collections/{n}").json()["documents"] for n in ("notes",)}
        milvus_server.kill()
        try:
            for c in (ca, cb):
                health = c.get("/health")
                assert health.status_code == 200, health.text  # embedding still works
                storage = health.json()["storage"]
                assert storage["status"] == "unreachable" and f"Milvus at {milvus_server.uri}" in storage["error"]
                for r in (c.post("/collections/notes/search", json={"query": "cat", "k": 1}),
                          c.post("/collections/notes/documents", json=[{"id": "new", "text": "A new note."}]),
                          c.get("/collections/notes")):
                    assert r.status_code == 503, r.text
                    assert f"Milvus at {milvus_server.uri} is unreachable" in r.json()["error"]
                assert c.post("/embed", json={"inputs": "still embedding"}).status_code == 200
        finally:
            milvus_server.start()
        for c in (ca, cb):
            assert c.get("/health").json()["storage"]["status"] == "ok"
        assert {n: cb.get(f"/collections/{n}").json()["documents"] for n in before} == before  # nothing lost
        r = ca.post("/collections/notes/documents", json=[{"id": "new", "text": "A new note."}])  # the retry
        assert r.status_code == 200, r.text
        assert cb.get("/collections/notes/documents/new").json()["text"] == "A new note."


def test_sigkill_mid_job_then_restart_resumes_to_the_uninterrupted_collection(milvus_server, embedder, data_dir,
                                                                            tmp_path):
    """The server is SIGKILLed while the job writes (after its first commits); the job fails
    naming Milvus; the server restarts on its data; the job run again resumes after its last
    commit, and the collection equals an uninterrupted run (FAISS, same model), its exact
    search too."""
    corpus = tmp_path / "corpus.jsonl"
    n, kill_after = 60, 25
    _corpus(corpus, data_dir, n, chars=400)
    src = CorpusSource(str(corpus))
    poolers = ["cluster:pool_factor=4"]
    kw = dict(source=src.describe(), commit_every=10, batch_docs=5, progress=False)
    with IndexJob(embedder, tmp_path / "reference", "kill", poolers, **kw) as job:
        job.run(src.records(), total=n)

    def records_then_kill():
        for i, r in enumerate(src.records()):
            if i == kill_after:  # records 0..19 are committed, 20..24 written and not
                milvus_server.kill()
            yield r

    milvus = dict(backend="milvus", milvus_uri=milvus_server.uri)
    try:
        with pytest.raises(BackendError, match=f"Milvus at {milvus_server.uri} is unreachable"):
            with IndexJob(embedder, tmp_path / "job", "kill", poolers, **kw, **milvus) as job:
                job.run(records_then_kill(), total=n)
    finally:
        milvus_server.start()
    with open_collection(tmp_path / "job", "kill", **milvus) as coll:
        state = json.loads(coll.get_property(JOB_PROPERTY) or "{}")
    assert 0 < state.get("committed_records", 0) <= kill_after, state
    with IndexJob(embedder, tmp_path / "job", "kill", poolers, **kw, **milvus) as job:
        summary = job.run(src.records(), total=n)
    assert summary["indexed_this_run"] == n - state["committed_records"]
    assert_same_collections(tmp_path / "reference", tmp_path / "job", ["kill"], n, atol=1e-6, **milvus)
    with open_collection(tmp_path / "job", "kill", **milvus) as coll:  # searches agree with the reference
        q = [np.asarray(coll.get(coll.ids()[5])["vectors"])]
        with open_collection(tmp_path / "reference", "kill") as ref:
            want = [(h.id, round(h.score, 4)) for h in ref.search(q, k=5)[0]]
            assert [(h.id, round(h.score, 4)) for h in coll.search(q, k=5)[0]] == want
