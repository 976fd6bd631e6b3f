"""The error taxonomy: bad inputs each get their specific 4xx and the server keeps serving;
auth on and off; 429 with Retry-After; payload limits; dropped work of disconnected clients."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

LONG = "word " * 600  # ~600 tokens, over MiniLM's 256


def _setup_collections(client) -> None:
    client.post("/collections", json={"name": "errs"})
    client.post("/collections/errs/documents", json=[{"id": "d1", "text": "a stored document"}])


# (id, method, path, body or raw bytes, status, type, words the message must contain)
CASES = [
    ("empty inputs", "POST", "/embed", {"inputs": []}, 422, "validation_error", ["inputs", "at least one"]),
    ("missing inputs", "POST", "/embed", {}, 422, "validation_error", ["inputs", "required"]),
    ("10,000 inputs", "POST", "/embed", {"inputs": ["x"] * 10_000}, 413, "payload_too_large", ["max_client_batch", "10000"]),
    ("1 MB string", "POST", "/embed", {"inputs": "a" * 1_000_000}, 413, "payload_too_large", ["max_input_chars"]),
    ("body over max_payload_bytes", "POST", "/embed", {"inputs": ["b" * 90_000] * 100}, 413, "payload_too_large", ["max_payload_bytes"]),
    ("inputs a number", "POST", "/embed", {"inputs": 5}, 422, "validation_error", ["inputs", "string"]),
    ("inputs item a number", "POST", "/embed", {"inputs": ["ok", 3]}, 422, "validation_error", ["inputs[1]", "string"]),
    ("inputs null", "POST", "/embed", {"inputs": None}, 422, "validation_error", ["inputs"]),
    ("normalize a string", "POST", "/embed", {"inputs": "x", "normalize": "yes"}, 422, "validation_error", ["normalize", "boolean"]),
    ("dimensions a string", "POST", "/embed", {"inputs": "x", "dimensions": "64"}, 422, "validation_error", ["dimensions", "integer"]),
    ("dimensions zero", "POST", "/embed", {"inputs": "x", "dimensions": 0}, 422, "validation_error", ["dimensions", "greater than or equal to 1"]),
    ("dimensions too large", "POST", "/embed", {"inputs": "x", "dimensions": 1000}, 422, "validation_error", ["dimensions", "384"]),
    ("unknown pooler", "POST", "/embed", {"inputs": "x", "pooler": "median"}, 422, "validation_error", ["unknown pooler", "mean"]),
    ("unknown pooler option", "POST", "/embed", {"inputs": "x", "pooler": "mean:foo=1"}, 422, "validation_error", ["no option", "foo"]),
    ("bad pooler option value", "POST", "/embed", {"inputs": "x", "pooler": "landmark:g=abc"}, 422, "validation_error", ["g"]),
    ("landmark g=0", "POST", "/embed", {"inputs": "x", "pooler": "landmark:g=0"}, 422, "validation_error", ["g"]),
    ("huge attention queries", "POST", "/embed", {"inputs": "x", "pooler": "attention:queries=1000000"}, 422, "validation_error", ["out of range"]),
    ("weights path from a request", "POST", "/embed", {"inputs": "x", "pooler": "attention:weights=/etc"}, 422, "validation_error", ["disabled"]),
    ("pooler and poolers", "POST", "/embed", {"inputs": "x", "pooler": "mean", "poolers": ["cls"]}, 422, "validation_error", ["either"]),
    ("unknown role", "POST", "/embed", {"inputs": "x", "role": "passage"}, 422, "validation_error", ["role", "query"]),
    ("unknown field", "POST", "/embed", {"inputs": "x", "input_text": "y"}, 422, "validation_error", ["input_text", "unknown field"]),
    ("too long with truncate=false", "POST", "/embed", {"inputs": ["ok", LONG], "truncate": False}, 422, "validation_error", ["input 1", "truncate"]),
    ("bad JSON", "POST", "/embed", b'{"inputs": "x",', 422, "validation_error", ["JSON"]),
    ("not UTF-8", "POST", "/embed", b"\xff\xfe\x00", 422, "validation_error", ["JSON"]),
    ("JSON array body", "POST", "/embed", [1, 2], 422, "validation_error", ["body"]),
    ("unknown route", "GET", "/nope", None, 404, "not_found", ["route"]),
    ("wrong method", "GET", "/embed", None, 405, "method_not_allowed", ["method"]),
    ("unknown collection: search", "POST", "/collections/nope/search", {"query": "x"}, 404, "not_found", ["nope"]),
    ("unknown collection: get", "GET", "/collections/nope", None, 404, "not_found", ["nope"]),
    ("unknown collection: delete", "DELETE", "/collections/nope", None, 404, "not_found", ["nope"]),
    ("unknown collection: add", "POST", "/collections/nope/documents", [{"id": "a", "text": "t"}], 404, "not_found", ["nope"]),
    ("unknown document", "GET", "/collections/errs/documents/zzz", None, 404, "not_found", ["zzz"]),
    ("delete unknown document", "DELETE", "/collections/errs/documents/zzz", None, 404, "not_found", ["zzz"]),
    ("bad collection name", "GET", "/collections/bad%20name", None, 422, "validation_error", ["name"]),
    ("create: bad name", "POST", "/collections", {"name": "../x"}, 422, "validation_error", ["name"]),
    ("create: other settings", "POST", "/collections", {"name": "errs", "pooler": "cls"}, 409, "conflict", ["pooler", "mean", "cls"]),
    ("create: bad factory", "POST", "/collections", {"name": "bf", "factory": "NotAnIndex"}, 422, "validation_error", ["factory"]),
    ("create: multi pooler in single", "POST", "/collections", {"name": "mk", "pooler": "tokens", "kind": "single"}, 422, "validation_error", ["kind"]),
    ("documents: empty list", "POST", "/collections/errs/documents", [], 422, "validation_error", ["documents"]),
    ("documents: missing text", "POST", "/collections/errs/documents", [{"id": "a"}], 422, "validation_error", ["text"]),
    ("documents: duplicate ids", "POST", "/collections/errs/documents", [{"id": "a", "text": "1"}, {"id": "a", "text": "2"}], 422, "validation_error", ["a"]),
    ("search: no query", "POST", "/collections/errs/search", {"k": 3}, 422, "validation_error", ["query"]),
    ("search: k zero", "POST", "/collections/errs/search", {"query": "x", "k": 0}, 422, "validation_error", ["k"]),
    ("search: k huge", "POST", "/collections/errs/search", {"query": "x", "k": 10**9}, 422, "validation_error", ["k"]),
    ("openai: empty input", "POST", "/v1/embeddings", {"input": []}, 422, "invalid_request_error", ["input"]),
    ("openai: token arrays", "POST", "/v1/embeddings", {"input": [[1, 2, 3]]}, 422, "invalid_request_error", ["input"]),
    ("openai: bad encoding_format", "POST", "/v1/embeddings", {"input": "x", "encoding_format": "int8"}, 422, "invalid_request_error", ["encoding_format"]),
    ("openai: multi-vector pooler", "POST", "/v1/embeddings", {"input": "x", "pooler": "tokens"}, 422, "invalid_request_error", ["pooler"]),
    ("openai: 10,000 inputs", "POST", "/v1/embeddings", {"input": ["x"] * 10_000}, 413, "invalid_request_error", ["max_client_batch"]),
]


@pytest.fixture(scope="module")
def errs_collection(server):
    with server.client() as c:
        _setup_collections(c)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_table(server, client, errs_collection, case):
    _, method, path, body, status, kind, words = case
    if isinstance(body, bytes):
        r = client.request(method, path, content=body, headers={"Content-Type": "application/json"})
    elif body is None:
        r = client.request(method, path)
    else:
        r = client.request(method, path, json=body)
    assert r.status_code == status, r.text
    payload = r.json()
    if path.startswith("/v1/"):
        assert set(payload) == {"error"}
        err = payload["error"]
        assert err["type"] == kind and err["code"] in ("validation_error", "payload_too_large")
        message = err["message"]
    else:
        assert set(payload) - {"param"} == {"error", "type"}, payload
        assert payload["type"] == kind
        message = payload["error"]
    for w in words:
        assert w.lower() in message.lower(), (w, message)
    server.alive()


# (method, path, body, status, the parameter the error body names)
PARAMS = [
    ("POST", "/embed", {"inputs": ["ok", 3]}, 422, "inputs[1]"),
    ("POST", "/embed", {"inputs": ["x"] * 10_000}, 413, "inputs"),
    ("POST", "/embed", {"inputs": "x", "dimensions": 1000}, 422, "dimensions"),
    ("POST", "/embed", {"inputs": "x", "pooler": "landmark:g=0"}, 422, "pooler"),
    ("POST", "/embed", {"inputs": "x", "model": "nope"}, 404, "model"),
    ("POST", "/collections/nope/search", {"query": "x"}, 404, "name"),
    ("POST", "/collections/errs/search", {"query": "x", "filter": {"$foo": 1}}, 422, "filter"),
    ("POST", "/collections", {"name": "bf", "factory": "NotAnIndex"}, 422, "factory"),
    ("POST", "/v1/embeddings", {"input": "x", "pooler": "attention:weights=/etc"}, 422, "pooler"),
    ("POST", "/v1/rerank", {"query": "q", "documents": ["a"] * 10_000}, 413, "documents"),
]


@pytest.mark.parametrize("case", PARAMS, ids=[f"{c[1]} {c[4]}" for c in PARAMS])
def test_an_error_body_names_its_parameter(client, errs_collection, case):
    """An error raised with the parameter it concerns names it in the JSON body: ``param`` on
    embedpool's routes and in OpenAI's error object under ``/v1/``."""
    method, path, body, status, param = case
    r = client.request(method, path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"] if path.startswith("/v1/") else r.json()
    assert err["param"] == param, err


def test_an_error_without_a_parameter_has_no_param_key(client):
    r = client.get("/nope")
    assert r.status_code == 404 and set(r.json()) == {"error", "type"}


def test_payload_limit_chunked_body(limited_server):
    """A body without Content-Length is counted as it streams (limit 64 KiB on this server)."""
    def chunks():
        yield b'{"inputs": ["'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"]}'

    with limited_server.client() as c:
        r = c.post("/embed", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["type"] == "payload_too_large"
        big = c.post("/embed", json={"inputs": ["y" * 70_000]})
        assert big.status_code == 413 and "max_payload_bytes" in big.json()["error"]
    limited_server.alive()


# ---------------------------------------------------------------------- auth
def test_auth_off_by_default(server):
    with server.client(auth=False) as c:
        assert c.post("/embed", json={"inputs": "no key needed"}).status_code == 200
        assert c.get("/info").status_code == 200


PROTECTED = [("GET", "/info", None), ("POST", "/embed", {"inputs": "x"}),
             ("POST", "/v1/embeddings", {"input": "x"}), ("GET", "/collections", None),
             ("POST", "/collections", {"name": "authc"}), ("GET", "/collections/authc", None),
             ("DELETE", "/collections/authc", None), ("POST", "/collections/authc/documents", [{"id": "a", "text": "t"}]),
             ("GET", "/collections/authc/documents/a", None), ("DELETE", "/collections/authc/documents/a", None),
             ("POST", "/collections/authc/search", {"query": "x"}), ("GET", "/not-a-route", None),
             ("POST", "/v1/rerank", {"query": "q", "documents": ["x"]}), ("GET", "/v1/models", None),
             ("POST", "/tei", {"inputs": "x"}), ("POST", "/tei/embed", {"inputs": "x"}), ("GET", "/tei/info", None),
             ("POST", "/tei/v1/embeddings", {"input": "x"})]


def test_auth_on(limited_server):
    with limited_server.client(auth=False) as anon, limited_server.client() as authed:
        for path in ("/health", "/metrics", "/docs", "/openapi.json", "/tei/health", "/tei"):
            assert anon.get(path).status_code == 200, path
        for method, path, body in PROTECTED:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic czNjcmV0"}):
                r = anon.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
                if path.startswith("/v1/"):
                    assert r.json()["error"]["type"] == "authentication_error"
                elif path.startswith("/tei/v1/"):  # TEI's OpenAI error shape
                    assert r.json()["type"] == "Unauthorized" and r.json()["code"] == 401
                elif path.startswith("/tei"):  # TEI's error shape
                    assert r.json()["error_type"] == "Unauthorized"
                else:
                    assert r.json()["type"] == "unauthorized"
        # ... and bad JSON from a client without the key is still a 401 (checked before the body)
        r = anon.post("/embed", content=b"{", headers={"Content-Type": "application/json"})
        assert r.status_code == 401
        assert authed.post("/embed", json={"inputs": "with the key"}).status_code == 200
        assert authed.post("/collections", json={"name": "authc"}).status_code == 201
        assert authed.delete("/collections/authc").status_code == 200
        spec = anon.get("/openapi.json").json()
        assert "HTTPBearer" in json.dumps(spec["components"]["securitySchemes"])


# ---------------------------------------------------------------------- overload, disconnects
def test_full_queue_answers_429_with_retry_after(limited_server):
    """max_queue=64 inputs, 64-token forward batches: 16 requests of 16 inputs at once overflow it."""
    texts = [f"sentence number {i} about nothing in particular" for i in range(16)]

    async def burst():
        async with httpx.AsyncClient(base_url=limited_server.url, headers=limited_server.headers,
                                     timeout=120) as ac:
            return await asyncio.gather(*(ac.post("/embed", json={"inputs": texts}) for _ in range(16)))

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}, statuses
    assert 429 in statuses and 200 in statuses, statuses
    r429 = next(r for r in responses if r.status_code == 429)
    assert r429.json()["type"] == "overloaded"
    assert int(r429.headers["retry-after"]) >= 1
    metrics = limited_server.client().get("/metrics").text
    assert float(re.search(r"^embedpool_rejected_requests_total (\S+)$", metrics, re.M).group(1)) >= 1
    limited_server.alive()


def _metric(server, name: str) -> float:
    with server.client() as c:
        m = re.search(rf"^{name} (\S+)$", c.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def test_disconnected_client_work_is_dropped(limited_server):
    """A client that gives up while its request waits in the queue: its inputs are never encoded."""
    before = _metric(limited_server, "embedpool_dropped_inputs_total")
    # 60 inputs of ~100 tokens, one per round (the limited server's budget is 64 tokens): well
    # over a second of fp32 rounds on a fast CPU, so the second request is still queued at 0.3 s
    slow = [f"{i} " + "a fairly long sentence that keeps the encoder busy for a while " * 8 for i in range(60)]

    async def run():
        async with httpx.AsyncClient(base_url=limited_server.url, headers=limited_server.headers,
                                     timeout=120) as ac:
            busy = asyncio.ensure_future(ac.post("/embed", json={"inputs": slow}))
            await asyncio.sleep(0.3)
            with pytest.raises(httpx.ReadTimeout):
                await ac.post("/embed", json={"inputs": ["dropped one", "dropped two"]},
                              timeout=httpx.Timeout(120, read=0.3))
            return await busy

    busy = asyncio.run(run())
    assert busy.status_code == 200
    deadline = time.monotonic() + 20
    while _metric(limited_server, "embedpool_dropped_inputs_total") < before + 2:
        assert time.monotonic() < deadline, "the disconnected request was not dropped"
        time.sleep(0.2)
    limited_server.alive()
