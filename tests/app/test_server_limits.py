"""Work limits per request (``max_request_tokens``, ``max_request_vectors``) on a real server,
and the longest input it accepts served in bounded memory."""

from __future__ import annotations

import re

import pytest
from memory_testutil import PeakRSS

POOLER = "cluster:pool_factor=4,window=true"


@pytest.fixture(scope="module")
def long_inputs(scifact_docs) -> list[str]:
    """Two inputs of ~95,000 characters (each ~20,000 tokens; the server's max_input_chars is
    100,000) of SciFact abstracts."""
    text = "\n\n".join(scifact_docs)
    return [text[:95_000], text[95_000:190_000]]


def _error(r) -> str:
    body = r.json()
    return body["error"] if isinstance(body["error"], str) else body["error"]["message"]


def test_request_over_max_request_tokens_is_413_and_costs_no_memory(scale_server, long_inputs):
    """~40,000 tokens after windowing against a limit of 30,000: refused before any forward
    pass, with the limit and the request's count in the message; the server keeps serving and
    its RSS grows by less than 200 MB (whole-text clustering of 40k tokens took 22 GB)."""
    with scale_server.client() as c, PeakRSS(scale_server.proc.pid) as rss:
        r = c.post("/embed", json={"inputs": long_inputs, "pooler": POOLER})
    assert r.status_code == 413, r.text[:300]
    assert r.json()["type"] == "payload_too_large"
    msg = _error(r)
    assert "max_request_tokens" in msg and "30000" in msg, msg
    count = int(re.search(r"needs (\d+) tokens", msg).group(1))
    assert count > 38_000  # every window of both inputs counted, not the truncated 2 x 256
    assert rss.growth_mb < 200, rss.report()
    scale_server.alive()
    # the OpenAI route and collection writes have the same limit
    with scale_server.client() as c:
        # 200 inputs, each truncated to the 256-token window: 51,200 tokens
        pieces = [long_inputs[i % 2][(i // 2) * 900:(i // 2) * 900 + 2000] for i in range(200)]
        r = c.post("/v1/embeddings", json={"input": pieces})
        assert r.status_code == 413, r.text[:300]
        assert "max_request_tokens" in _error(r) and "51200 tokens" in _error(r), _error(r)
        assert r.json()["error"]["param"] == "input"
        c.post("/collections", json={"name": "long", "pooler": POOLER})
        r = c.post("/collections/long/documents",
                   json=[{"id": str(i), "text": t} for i, t in enumerate(long_inputs)])
        assert r.status_code == 413 and "max_request_tokens" in _error(r), r.text[:300]
        assert r.json()["type"] == "payload_too_large"
        assert c.get("/collections/long").json()["documents"] == 0  # the index unchanged


def test_request_over_max_request_vectors_is_413(scale_server, long_inputs):
    """One ~20,000-token input with every token a vector: 20,000 vectors over the limit of
    10,000 (within the token limit)."""
    with scale_server.client() as c:
        r = c.post("/embed", json={"inputs": long_inputs[0], "pooler": "tokens:window=true"})
    assert r.status_code == 413, r.text[:300]
    msg = _error(r)
    assert "max_request_vectors" in msg and "10000" in msg, msg
    scale_server.alive()


def test_longest_input_served_in_bounded_memory(scale_server, long_inputs):
    """The longest input the server accepts (~20,000 tokens) with per-window clustering:
    served, about a quarter of its tokens as vectors, the server's RSS growing < 200 MB."""
    with scale_server.client(timeout=600) as c, PeakRSS(scale_server.proc.pid) as rss:
        r = c.post("/embed", json={"inputs": long_inputs[0], "pooler": POOLER})
    assert r.status_code == 200, r.text[:300]
    vectors = r.json()["embeddings"][0]
    assert 19_000 / 4 < len(vectors) < 21_000 / 4 + 2 * 90
    assert rss.growth_mb < 200, rss.report()
    scale_server.alive()


def test_rerank_and_tokenize_have_the_same_limit(scale_server, long_inputs):
    """/rerank counts the query and every text's windows together; /tokenize the tokens it
    would list. Both refuse ~40,000 tokens against the limit of 30,000."""
    with scale_server.client() as c:
        r = c.post("/rerank", json={"query": "white matter development", "texts": long_inputs,
                                    "pooler": "tokens:window=true", "truncate": True})
        assert r.status_code == 413, r.text[:300]
        assert "max_request_tokens" in _error(r) and "30000" in _error(r), _error(r)
        r = c.post("/tokenize", json={"inputs": long_inputs})
        assert r.status_code == 413, r.text[:300]
        assert "max_request_tokens" in _error(r) and "30000" in _error(r), _error(r)
        # within the limit both answer: one long text reranked over all its windows
        r = c.post("/rerank", json={"query": "white matter development", "texts": [long_inputs[0], "unrelated"],
                                    "pooler": "cluster:pool_factor=4,window=true", "truncate": True})
        assert r.status_code == 200, r.text[:300]
        assert [x["index"] for x in r.json()] == [0, 1]
    scale_server.alive()
