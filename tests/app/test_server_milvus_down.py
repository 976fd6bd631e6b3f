"""Milvus goes down under a running ``embedpool serve`` and comes back: requests that need it
fail with 503 and a message saying so, the server keeps serving everything else, and once Milvus
is back the same requests succeed -- without restarting embedpool.

Real parts only: a real uvicorn server (conftest.py) with ``--backend milvus``, and a real Milvus
Lite engine in a process of its own (``python -m milvus_lite server``) that the test SIGKILLs
and starts again on the same data and port. (milvus-lite 3 runs the engine of a ``.db`` URI
inside the embedpool process, where it cannot be killed from outside; its in-process death and
recovery is ``tests/index/test_index_milvus.py::test_engine_death_fails_clearly_then_recovers``.)
"""

from __future__ import annotations

import pytest

import milvus_lite  # noqa: F401 -- a dependency: if it is missing these tests must fail, not vanish

DOCS = [
    {"id": "cat", "text": "The cat purred on the warm windowsill."},
    {"id": "stocks", "text": "Stock markets fell sharply as investors sold shares."},
    {"id": "rain", "text": "Heavy rain and storms are forecast for the weekend."},
]
QUERY = {"query": "a kitten sleeping in the sun", "k": 2}


@pytest.fixture(scope="module")
def outage(tmp_path_factory, start_server, milvus_lite_server):
    """Run the scenario once; the tests below check what it recorded."""
    milvus = milvus_lite_server
    server = start_server(tmp_path_factory.mktemp("milvus-down"),
                          {"EMBEDPOOL_BACKEND": "milvus", "EMBEDPOOL_MILVUS_URI": milvus.uri})
    try:
        server.wait_ready()
        rec: dict = {"milvus": milvus}
        with server.client() as c:
            assert c.post("/collections", json={"name": "notes"}).status_code == 201
            r = c.post("/collections/notes/documents", json=DOCS)
            assert r.status_code == 200, r.text
            rec["before"] = c.post("/collections/notes/search", json=QUERY).json()
            assert rec["before"]["hits"][0]["id"] == "cat"

            milvus.kill()  # under the running server
            rec["down"] = {
                "search": c.post("/collections/notes/search", json=QUERY),
                "search again": c.post("/collections/notes/search", json=QUERY),
                "add": c.post("/collections/notes/documents", json=[{"id": "new", "text": "A new note."}]),
                "info": c.get("/collections/notes"),
            }
            rec["health while down"] = c.get("/health")
            rec["embed while down"] = c.post("/embed", json={"inputs": "still embedding"}).status_code

            milvus.start()  # back, on the same data and port
            rec["health after"] = c.get("/health").json()["storage"]
            rec["after"] = {
                "search": c.post("/collections/notes/search", json=QUERY),
                "add": c.post("/collections/notes/documents", json=[{"id": "new", "text": "A new note."}]),
                "info": c.get("/collections/notes"),
            }
        rec["server alive"] = server.proc.poll() is None
        yield rec
    finally:
        server.stop()


def test_milvus_down_answers_503_with_a_message(outage):
    for what, r in outage["down"].items():
        assert r.status_code == 503, (what, r.status_code, r.text)
        assert r.json()["type"] == "not_ready"


def test_the_message_says_milvus_is_unreachable_and_the_server_keeps_serving(outage):
    for what, r in outage["down"].items():
        body = r.json()
        assert f"Milvus at {outage['milvus'].uri} is unreachable" in body["error"], (what, body)
        assert "retried once Milvus is back" in body["error"]
    health = outage["health while down"]
    assert health.status_code == 200 and outage["embed while down"] == 200  # embedding still works
    storage = health.json()["storage"]
    assert storage["status"] == "unreachable" and storage["backend"] == "milvus", storage
    assert f"Milvus at {outage['milvus'].uri} is unreachable" in storage["error"]
    assert outage["server alive"]


def test_requests_succeed_again_once_milvus_is_back(outage):
    assert outage["health after"]["status"] == "ok" and outage["health after"]["version"].startswith("Milvus")
    after = outage["after"]
    assert after["search"].status_code == 200, after["search"].text
    assert after["search"].json()["hits"] == outage["before"]["hits"]  # same data, same answer
    assert after["add"].status_code == 200, after["add"].text
    assert after["add"].json()["documents"] == len(DOCS) + 1
    assert after["info"].status_code == 200 and after["info"].json()["documents"] == len(DOCS) + 1
