"""Errors through the HTTP layer, by kind, from the one table: a lone surrogate is a 422 naming
its field on every text route (it was a 500), an internal error answers 500 and keeps the
client's keep-alive connection open, and a storage backend failure is a 503 with its message
(it was a 422)."""

from __future__ import annotations

import json
import logging
import sys

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request

from embedpool.app.server import errors as http_errors
from server_testutil import Uvicorn

LONE = "\\ud800"  # JSON's escape of a lone (high) surrogate: valid JSON, not valid Unicode

# (route, raw JSON body, the field the message must name)
SURROGATES = [
    ("/embed", '{"inputs": "%s"}' % LONE, "inputs"),
    ("/embed", '{"inputs": ["ok", "x%sy"]}' % LONE, "inputs[1]"),
    ("/v1/embeddings", '{"input": "%s"}' % LONE, "input"),
    ("/v1/embeddings", '{"input": ["ok", "%s"]}' % LONE, "input[1]"),
    ("/collections/surr/documents", '[{"id": "a", "text": "%s"}]' % LONE, "[0].text"),
    ("/collections/surr/documents", '{"documents": [{"id": "a%s", "text": "t"}]}' % LONE, "documents[0].id"),
    ("/collections/surr/documents", '[{"id": "a", "text": "t", "metadata": {"k": ["%s"]}}]' % LONE, "metadata"),
    ("/collections/surr/search", '{"query": "%s"}' % LONE, "query"),
    ("/collections/surr/search", '{"queries": ["ok", "%s"]}' % LONE, "queries[1]"),
    ("/rerank", '{"query": "%s", "texts": ["ok"]}' % LONE, "query"),
    ("/rerank", '{"query": "ok", "texts": ["ok", "%s"]}' % LONE, "texts[1]"),
    ("/tokenize", '{"inputs": ["ok", "%s"]}' % LONE, "inputs[1]"),
]


@pytest.fixture(scope="module")
def surr_collection(server):
    with server.client() as c:
        assert c.post("/collections", json={"name": "surr"}).status_code in (200, 201)
        assert c.post("/collections/surr/documents", json=[{"id": "d", "text": "kept"}]).status_code == 200


@pytest.mark.parametrize("route,body,field", SURROGATES, ids=[f"{r} {f}" for r, _, f in SURROGATES])
def test_lone_surrogate_is_a_422_naming_the_field(server, client, surr_collection, route, body, field):
    r = client.post(route, content=body.encode("ascii"), headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    if route.startswith("/v1/"):
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "validation_error"
        message, param = err["message"], err["param"]
        assert param == field
    else:
        assert r.json()["type"] == "validation_error"
        message = r.json()["error"]
    assert field in message and "not valid Unicode" in message and "surrogate" in message, message
    assert "Input should be" not in message  # the other member of the str | list union is not relevant
    if "collections" in route:  # the collection is unchanged
        assert client.get("/collections/surr").json()["documents"] == 1


def test_keep_alive_connection_survives_a_bad_request(server):
    """Bad request then good request on one keep-alive connection, several times: every
    request is answered (the 500 of a lone surrogate used to reset the connection)."""
    with server.client() as c:
        for i in range(8):
            bad = c.post("/embed", content=('{"inputs": ["%s %d"]}' % (LONE, i)).encode(),
                         headers={"Content-Type": "application/json"})
            assert bad.status_code == 422, bad.text
            good = c.post("/embed", json={"inputs": f"fine {i}"})
            assert good.status_code == 200, good.text
    server.alive()


# ---------------------------------------------------------------------- the HTTP layer on its own
def _app(**routes) -> FastAPI:
    app = FastAPI()

    @app.get("/port")
    async def port(request: Request) -> dict:
        return {"port": request.client.port}

    for path, fn in routes.items():
        app.add_api_route(f"/{path}", fn, methods=["GET"])
        app.add_api_route(f"/v1/{path}", fn, methods=["GET"])
    http_errors.install(app)
    return app


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_internal_error_is_a_500_and_keeps_the_connection(http, caplog):
    def bug():
        return {}["missing"]  # a KeyError: a bug, not a request error

    caplog.set_level(logging.ERROR, logger="embedpool.server")
    with Uvicorn(_app(bug=bug), http) as url, httpx.Client(base_url=url, timeout=30) as c:
        ports = {c.get("/port").json()["port"]}
        for _ in range(6):
            r = c.get("/bug")
            assert r.status_code == 500 and r.json() == {"error": http_errors.INTERNAL_MESSAGE, "type": "internal_error"}
            o = c.get("/v1/bug").json()["error"]
            assert o["type"] == "server_error" and o["code"] == "internal_error"
            ports.add(c.get("/port").json()["port"])
        assert len(ports) == 1, f"the connection was closed after a 500 (client ports {ports})"
    logged = [r for r in caplog.records if r.name == "embedpool.server" and r.exc_info]
    assert logged and isinstance(logged[0].exc_info[1], KeyError)  # the traceback is in the log


def test_backend_failure_is_a_503_with_its_message(tmp_path):
    """A Milvus Lite backend stopped under an open collection: the real UnavailableError answers
    503 (``not_ready``) with Milvus' message, not 422."""
    from embedpool.errors import UnavailableError
    from embedpool.index import CollectionSpec, open_collection

    uri = str(tmp_path / "milvus.db")
    coll = open_collection(tmp_path, "down", CollectionSpec(kind="single", dim=4), backend="milvus", milvus_uri=uri)
    v = np.eye(4, dtype=np.float32)[:2]
    coll.add(["a", "b"], v, ["x", "y"])
    coll.commit()
    assert coll.search(v[:1], k=1)[0][0].id == "a"

    def search():
        # the backend goes away under each request (after an outage embedpool starts a new
        # Milvus Lite engine for the file by itself, so the outage is made again each time)
        coll.search(v[:1], k=1)
        sys.modules["milvus_lite.server_manager"].server_manager_instance.release_server(uri)
        return {"hits": [h.id for h in coll.search(v[:1], k=1)[0]]}

    with pytest.raises(UnavailableError) as caught:
        search()
    assert not isinstance(caught.value, ValueError)
    err = http_errors.from_exception(caught.value)
    assert (err.status, err.type, err.message) == (503, "not_ready", str(caught.value))
    try:
        with Uvicorn(_app(search=search)) as url, httpx.Client(base_url=url, timeout=60) as c:
            r = c.get("/search")
            assert r.status_code == 503, r.text
            assert r.json()["type"] == "not_ready" and "Milvus search of 'down' failed" in r.json()["error"]
            o = c.get("/v1/search")
            assert o.status_code == 503 and o.json()["error"]["type"] == "server_error"
    finally:
        try:
            coll.close()
        except UnavailableError:
            pass


def test_every_kind_and_http_only_reason_renders_its_status():
    """Literal statuses and types on the three surfaces (embedpool, OpenAI's, TEI's): one
    instance of each kind's class, and the HTTP-only reasons (``code``) that override a status."""
    from embedpool import errors
    from embedpool.errors import Kind

    cases = {errors.InvalidError: (422, "validation_error", "invalid_request_error", 422, "Validation"),
             errors.TooLargeError: (413, "payload_too_large", "invalid_request_error", 413, "Validation"),
             errors.UnauthorizedError: (401, "unauthorized", "authentication_error", 401, "Unauthorized"),
             errors.NotFoundError: (404, "not_found", "invalid_request_error", 404, "NotFound"),
             errors.ConflictError: (409, "conflict", "invalid_request_error", 409, "Conflict"),
             errors.OverloadedError: (429, "overloaded", "rate_limit_error", 429, "Overloaded"),
             errors.UnavailableError: (503, "not_ready", "server_error", 503, "Unhealthy"),
             errors.InternalError: (500, "internal_error", "server_error", 424, "Backend")}
    assert {c.kind for c in cases} == set(Kind)
    for cls, (status, type_, openai_type, tei_status, tei_type) in cases.items():
        r = http_errors.from_exception(cls("m", param="p"))
        assert (r.status, r.type, r.param) == (status, type_, "p"), cls
        o = http_errors.render("/v1/embeddings", r)
        assert o.status_code == status and json.loads(o.body)["error"]["type"] == openai_type, cls
        t = http_errors.render("/tei/embed", r)
        assert (t.status_code, json.loads(t.body)["error_type"]) == (tei_status, tei_type), cls
    reasons = {code: http_errors.from_exception(errors.InvalidError("m", code=code))
               for code in ("method_not_allowed", "client_closed", "empty")}
    assert {c: (r.status, r.type) for c, r in reasons.items()} == {
        "method_not_allowed": (405, "method_not_allowed"), "client_closed": (499, "client_closed"),
        "empty": (400, "empty")}
    assert http_errors.tei(reasons["empty"]) == (400, "Empty")

    busy = http_errors.from_exception(errors.OverloadedError("queue full", retry_after=3))
    assert (busy.status, busy.headers["Retry-After"]) == (429, "3")
    assert json.loads(http_errors.render("/x", busy).body) == {"error": "queue full", "type": "overloaded"}
    assert json.loads(http_errors.render("/tei/embed", busy).body) == {"error": "queue full", "error_type": "Overloaded"}
    assert json.loads(http_errors.render("/tei/v1/embeddings", busy).body) == {
        "message": "queue full", "code": 429, "type": "Overloaded"}
