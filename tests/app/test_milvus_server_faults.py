"""Faults of a real Milvus 2.3 server under embedpool (``make test-slow``): the server SIGKILLed
under two API replicas (``/health`` says so, requests answer 503 naming Milvus, nothing is lost),
and SIGKILLed mid-job then restarted (the job resumes to the collection an uninterrupted run
makes). The replicas: tests/app/conftest.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from embedpool.app.datasets import CorpusSource
from embedpool.app.indexing import JOB_PROPERTY, IndexJob
from embedpool.errors import UnavailableError
from embedpool.index import open_collection
from job_testutil import assert_same_collections
from test_index_job import _corpus
from test_milvus_server import NOTES

pytestmark = pytest.mark.slow


def test_milvus_down_health_says_so_requests_503_nothing_lost(replicas, milvus_server):
    a, b = replicas
    with a.client() as ca, b.client() as cb:
        assert ca.post("/collections", json={"name": "outage"}).status_code == 201
        assert ca.post("/collections/outage/documents", json=NOTES).status_code == 200
        before = {"outage": cb.get("/collections/outage").json()["documents"]}
        assert before == {"outage": len(NOTES)}
        milvus_server.kill()
        try:
            for c in (ca, cb):
                health = c.get("/health")
                assert health.status_code == 200, health.text  # embedding still works
                storage = health.json()["storage"]
                assert storage["status"] == "unreachable" and f"Milvus at {milvus_server.uri}" in storage["error"]
                for r in (c.post("/collections/outage/search", json={"query": "cat", "k": 1}),
                          c.post("/collections/outage/documents", json=[{"id": "new", "text": "A new note."}]),
                          c.get("/collections/outage")):
                    assert r.status_code == 503, r.text
                    assert f"Milvus at {milvus_server.uri} is unreachable" in r.json()["error"]
                assert c.post("/embed", json={"inputs": "still embedding"}).status_code == 200
        finally:
            milvus_server.start()
        for c in (ca, cb):
            assert c.get("/health").json()["storage"]["status"] == "ok"
        assert {n: cb.get(f"/collections/{n}").json()["documents"] for n in before} == before  # nothing lost
        r = ca.post("/collections/outage/documents", json=[{"id": "new", "text": "A new note."}])  # the retry
        assert r.status_code == 200, r.text
        assert cb.get("/collections/outage/documents/new").json()["text"] == "A new note."
        hits = cb.post("/collections/outage/search", json={"query": "a kitten asleep in the sun", "k": 1}).json()
        assert hits["hits"][0]["id"] == "cat"


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
        with pytest.raises(UnavailableError, match=f"Milvus at {milvus_server.uri} is unreachable"):
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
