"""The embedding routes served directly (app/server/direct.py, issue 34: /v1/embeddings, /embed
and TEI's /tei/embed and /tei/v1/embeddings) answer exactly as
FastAPI's routing does: every request is sent twice to a real uvicorn server, once with a
Content-Length (the direct path) and once as a chunked body (no length: FastAPI's path), and the
two answers must be equal -- status, body and headers -- for answers, route errors (413, 422, 404)
and what the direct path hands to FastAPI (validation errors, other content types, bad JSON).
FastAPI's dependency solving is counted (instrumentation: the real function still runs), so the
test fails if the direct path is not taken, or taken where it should not be."""

from __future__ import annotations

import re

import fastapi.routing
import httpx
import numpy as np
import pytest

from embedpool.app.server import create_app
from embedpool.app.settings import Settings
from server_testutil import Uvicorn


@pytest.fixture()
def served(embedder, tmp_path, monkeypatch):
    """``(url, calls)``: a server of the session's fp32 model with small input limits; ``calls``
    counts FastAPI's dependency solving (once per request FastAPI routes to an endpoint)."""
    calls = [0]
    real = fastapi.routing.solve_dependencies

    async def counting(*args, **kwargs):
        calls[0] += 1
        return await real(*args, **kwargs)

    monkeypatch.setattr(fastapi.routing, "solve_dependencies", counting)
    settings = Settings(data_dir=str(tmp_path), precision="fp32", max_client_batch=4, max_input_chars=200)
    with Uvicorn(create_app(settings, embedder=embedder)) as url:
        yield url, calls


def _both(client: httpx.Client, path: str, body: bytes, content_type: str = "application/json"):
    """The answer with a Content-Length, and the answer to the same bytes sent chunked."""
    direct = client.post(path, content=body, headers={"Content-Type": content_type})
    chunked = client.post(path, content=iter([body[:5], body[5:]]), headers={"Content-Type": content_type})
    return direct, chunked


def _same(a: httpx.Response, b: httpx.Response) -> None:
    assert a.status_code == b.status_code, (a.text, b.text)
    assert a.content == b.content
    skip = {"date", "content-length", "transfer-encoding"}
    assert {k: v for k, v in a.headers.items() if k not in skip} == {k: v for k, v in b.headers.items() if k not in skip}


DIRECT = [  # (path, body): answered by the direct path, its answer or its route's error
    ("/v1/embeddings", b'{"input": "a single sentence", "model": "anything"}'),
    ("/v1/embeddings", b'{"input": ["one", "two, a little longer"], "dimensions": 64}'),
    ("/v1/embeddings", b'{"input": ["base64 of float32"], "encoding_format": "base64"}'),
    ("/v1/embeddings", b'{"input": ["int8 codes"], "precision": "int8", "input_type": "query"}'),
    ("/embed", b'{"inputs": ["two poolers", "of one pass"], "poolers": ["mean", "cls"]}'),
    ("/embed", b'{"inputs": "tokens", "pooler": "tokens", "normalize": false}'),
    ("/embed", b'{"inputs": ["x"], "pooler": "mean", "truncate": false}'),  # measured before queueing
    # errors of the route itself: 413, 422, 404
    ("/v1/embeddings", b'{"input": ["1", "2", "3", "4", "5"]}'),
    ("/v1/embeddings", b'{"input": ["' + b"y" * 300 + b'"]}'),
    ("/v1/embeddings", b'{"input": ["a"], "pooler": "tokens"}'),
    ("/v1/embeddings", b'{"input": ["a"], "pooler": "nonsense"}'),
    ("/v1/embeddings", b'{"input": ["a"], "dimensions": 100000}'),
    ("/v1/embeddings", b'{"input": ["a"], "encoding_format": "base64", "precision": "int8"}'),
    ("/embed", b'{"inputs": ["a"], "model": "not-served"}'),
    ("/embed", b'{"inputs": ["a"], "ranges": [[0], [1]]}'),
    # TEI's routes, in TEI's shapes
    ("/tei/embed", b'{"inputs": "what TEI clients send", "normalize": false}'),
    ("/tei/embed", b'{"inputs": ["a", "b"], "dimensions": 32}'),
    ("/tei/embed", b'{"inputs": ["a"], "dimensions": 0}'),
    ("/tei/embed", b'{"inputs": ["1", "2", "3", "4", "5"]}'),
    ("/tei/v1/embeddings", b'{"input": ["through TEI\'s OpenAI route"], "model": "tei"}'),
    ("/tei/v1/embeddings", b'{"input": ["a"], "pooler": "tokens"}'),
]

FASTAPI = [  # (path, body, content type): handed to FastAPI by the direct path
    ("/v1/embeddings", b'{"model": "no input"}', "application/json"),
    ("/v1/embeddings", b'{"input": 3}', "application/json"),
    ("/v1/embeddings", b'{"input": ["a"], "encoding_format": "hex"}', "application/json"),
    ("/embed", b'{"inputs": ["a"], "unknown_field": 1}', "application/json"),
    ("/embed", b'{"inputs": ["a"', "application/json"),
    ("/embed", b'{"inputs": ["a"]}', "text/plain"),
    ("/v1/embeddings", b'{"input": ["a"]}', "application/vnd.api+json"),
    ("/v1/embeddings", b"", "application/json"),
    ("/tei/embed", b'{"inputs": 5}', "application/json"),
    ("/tei/v1/embeddings", b'{"input": ["a"', "application/json"),
]


def test_direct_answers_as_fastapi(served):
    url, calls = served
    with httpx.Client(base_url=url, timeout=60) as c:
        for path, body in DIRECT:
            calls[0] = 0
            direct, chunked = _both(c, path, body)
            assert calls[0] == 1, (path, body)  # the chunked one only
            _same(direct, chunked)
        for path, body, content_type in FASTAPI:
            _same(*_both(c, path, body, content_type))


def test_direct_answers_are_the_embeddings(served, embedder):
    """The direct path's vectors are the model's, its usage the tokens, and the metrics count
    its requests under the route's template."""
    url, calls = served
    texts = ["a sentence to embed", "another one"]
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/embeddings", json={"input": texts, "model": "x"})
        assert r.status_code == 200 and calls[0] == 0
        got = np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
        want = embedder.embed(texts)
        assert np.allclose(got, want.matrix(want.specs[0]), atol=1e-5)
        assert r.json()["usage"]["prompt_tokens"] == sum(len(embedder.encoder.tokenizer(t)["input_ids"])
                                                         for t in texts)
        metrics = c.get("/metrics").text
    assert re.search(r'embedpool_requests_total\{method="POST",route="/v1/embeddings",status="200"\} 1\.0', metrics)
