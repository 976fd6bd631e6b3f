"""The drop-in surfaces for TEI / Infinity users, over HTTP against the real server: TEI's routes
under ``/tei`` (bare-array answers, TEI's error bodies and status codes), Cohere-style
``/v1/rerank``, OpenAI's ``/v1/models``; and the two fixes found on the way (ragged int8 ranges,
error messages that named the server's folders). Clients of these routes: test_integrations.py."""

from __future__ import annotations

import numpy as np
import pytest

TEXTS = ["The cat sat on the mat.", "Stock markets fell sharply on Monday.", "Quantum computers use qubits."]
QUERY = "What do cats do?"
LONG = "word " * 400  # ~400 tokens: over the model's 256-token window


def post(client, path, body, status=200):
    r = client.post(path, json=body)
    assert r.status_code == status, (path, r.status_code, r.text)
    return r.json()


def own_embed(client, texts, **extra) -> np.ndarray:
    return np.asarray(post(client, "/embed", {"inputs": texts, **extra})["embeddings"], dtype=np.float32)


def tei_error(r, status: int, error_type: str) -> str:
    """TEI's error body, exactly: ``{"error": str, "error_type": str}``; returns the message."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error", "error_type"} and isinstance(body["error"], str), body
    assert body["error_type"] == error_type, body
    return body["error"]


# ---------------------------------------------------------------------- TEI's shapes
def test_tei_embed_answers_bare_vectors_equal_to_embed(client):
    want = own_embed(client, TEXTS)
    for path in ("/tei/embed", "/tei"):  # POST /tei: the model's default task (feature extraction)
        got = post(client, path, {"inputs": TEXTS})
        assert isinstance(got, list) and len(got) == 3 and isinstance(got[0][0], float)
        assert np.allclose(got, want, atol=1e-6)
    single = post(client, "/tei/embed", {"inputs": TEXTS[0]})
    assert np.asarray(single).shape == (1, 384) and np.allclose(single, want[:1], atol=1e-6)
    # TEI's options, and the pooler extension
    small = post(client, "/tei/embed", {"inputs": TEXTS, "dimensions": 64, "truncation_direction": "Left"})
    assert np.allclose(small, own_embed(client, TEXTS, dimensions=64, truncation_direction="left"), atol=1e-6)
    raw = post(client, "/tei/embed", {"inputs": TEXTS, "normalize": False, "unknown_field": 1})  # ignored, as TEI
    assert np.allclose(raw, own_embed(client, TEXTS, normalize=False), atol=1e-5)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)
    cls = post(client, "/tei/embed", {"inputs": TEXTS, "pooler": "cls"})
    assert np.allclose(cls, own_embed(client, TEXTS, pooler="cls"), atol=1e-6)
    # TEI truncates by default (auto_truncate): an over-long input is cut, not refused
    assert np.allclose(post(client, "/tei/embed", {"inputs": [LONG]}), own_embed(client, [LONG]), atol=1e-6)
    msg = tei_error(client.post("/tei/embed", json={"inputs": TEXTS, "pooler": "tokens"}), 422, "Validation")
    assert "/tei/embed_all" in msg


def test_tei_embed_all_is_the_tokens_pooler(client):
    got = post(client, "/tei/embed_all", {"inputs": TEXTS})
    want = post(client, "/embed", {"inputs": TEXTS, "pooler": "tokens"})["embeddings"]
    assert len(got) == 3 and [len(g) for g in got] == [len(w) for w in want]
    for g, w in zip(got, want):
        assert np.allclose(g, w, atol=1e-6)
    clustered = post(client, "/tei/embed_all", {"inputs": TEXTS, "pooler": "cluster:pool_factor=2"})
    want = post(client, "/embed", {"inputs": TEXTS, "pooler": "cluster:pool_factor=2"})["embeddings"]
    assert [len(c) for c in clustered] == [len(w) for w in want] and len(want[0]) < len(got[0])
    msg = tei_error(client.post("/tei/embed_all", json={"inputs": TEXTS, "pooler": "mean"}), 422, "Validation")
    assert "multi-vector" in msg


def test_tei_rerank_tokenize_info_health(client):
    got = post(client, "/tei/rerank", {"query": QUERY, "texts": TEXTS, "return_text": True})
    want = post(client, "/rerank", {"query": QUERY, "texts": TEXTS, "return_text": True})
    assert [g["index"] for g in got] == [w["index"] for w in want] and got[0]["text"] == TEXTS[got[0]["index"]]
    assert np.allclose([g["score"] for g in got], [w["score"] for w in want], atol=1e-6)
    assert set(post(client, "/tei/rerank", {"query": QUERY, "texts": TEXTS})[0]) == {"index", "score"}
    assert post(client, "/tei/tokenize", {"inputs": TEXTS[0]}) == post(client, "/tokenize", {"inputs": TEXTS[0]})
    info = client.get("/tei/info").json()
    assert info["model_id"] == "sentence-transformers/all-MiniLM-L6-v2" and info["max_input_length"] == 256
    assert info["model_type"] == {"embedding": {"pooling": "mean"}} and info["model_dtype"] == "float32"
    assert info["auto_truncate"] is True and info["max_client_batch_size"] == 512
    for path in ("/tei/health", "/tei"):
        r = client.get(path)
        assert r.status_code == 200 and r.content == b""
    openai = post(client, "/tei/v1/embeddings", {"input": TEXTS, "model": "x"})
    assert openai["object"] == "list" and np.allclose([d["embedding"] for d in openai["data"]],
                                                      own_embed(client, TEXTS), atol=1e-6)
    # embedpool's own routes at the root keep their shapes
    assert set(post(client, "/embed", {"inputs": TEXTS[0]})) >= {"embeddings", "pooler", "usage"}
    assert client.get("/health").json()["status"] == "ready"


# ---------------------------------------------------------------------- TEI's errors
def test_tei_error_bodies_and_status_codes(server, client, limited_server):
    # an empty input list: TEI's 400 Empty, with TEI's message
    assert tei_error(client.post("/tei/embed", json={"inputs": []}), 400, "Empty") == "`inputs` cannot be empty"
    assert tei_error(client.post("/tei/rerank", json={"query": "q", "texts": []}), 400, "Empty") == \
        "`texts` cannot be empty"
    # an empty text is an input like any other (TEI embeds it)
    assert len(post(client, "/tei/embed", {"inputs": [""]})) == 1
    # over the model's window with truncate=false: 422 Validation naming the length
    msg = tei_error(client.post("/tei/embed", json={"inputs": [LONG], "truncate": False}), 422, "Validation")
    assert "256" in msg and "tokens" in msg
    tei_error(client.post("/tei/rerank", json={"query": "q", "texts": [LONG], "truncate": False}), 422, "Validation")
    # over a size limit: 413 Validation (TEI's documented batch-size error)
    msg = tei_error(client.post("/tei/embed", json={"inputs": ["x" * 100_001]}), 413, "Validation")
    assert "max_input_chars" in msg
    # a field of the wrong type: 422 Validation
    tei_error(client.post("/tei/embed", json={"inputs": 5}), 422, "Validation")
    tei_error(client.post("/tei/embed", json={"inputs": "x", "dimensions": 0}), 422, "Validation")
    with limited_server.client(auth=False) as anon:
        # a wrong or missing key: 401 in TEI's body shape (TEI itself answers a bare 401)
        for headers in ({"Authorization": "Bearer wrong"}, {}):
            msg = tei_error(anon.post("/tei/embed", json={"inputs": "x"}, headers=headers), 401, "Unauthorized")
            assert "API key" in msg
        tei_error(anon.post("/tei", json={"inputs": "x"}), 401, "Unauthorized")
        assert anon.get("/tei/health").status_code == 200 and anon.get("/tei").status_code == 200  # public
        # TEI's OpenAI route answers TEI's OpenAI error shape
        r = anon.post("/tei/v1/embeddings", json={"input": "x"})
        assert r.status_code == 401 and set(r.json()) == {"message", "code", "type"} and r.json()["code"] == 401
    with limited_server.client() as c:
        msg = tei_error(c.post("/tei/embed", json={"inputs": ["x"] * 101}), 413, "Validation")
        assert "101 inputs" in msg
        r = c.post("/tei/v1/embeddings", json={"input": []})
        assert r.status_code == 422 and r.json()["type"] == "Validation" and r.json()["code"] == 422
    tei_error(client.post("/tei/nope", json={}), 404, "NotFound")
    # embedpool's root routes keep embedpool's error shape
    r = client.post("/embed", json={"inputs": []})
    assert r.status_code == 422 and r.json()["type"] == "validation_error"


# ---------------------------------------------------------------------- /v1/rerank, /v1/models
def test_cohere_rerank_scores_as_rerank(client, limited_server):
    want = post(client, "/rerank", {"query": QUERY, "texts": TEXTS, "truncate": True})
    docs = [TEXTS[0], {"text": TEXTS[1], "title": "ignored"}, TEXTS[2]]
    got = post(client, "/v1/rerank", {"model": "rerank-english-v3.0", "query": QUERY, "documents": docs,
                                      "return_documents": True, "rank_fields": ["text"]})
    assert got["model"] == "sentence-transformers/all-MiniLM-L6-v2" and got["id"]
    assert [r["index"] for r in got["results"]] == [w["index"] for w in want]
    assert np.allclose([r["relevance_score"] for r in got["results"]], [w["score"] for w in want], atol=1e-6)
    assert all(r["document"] == {"text": TEXTS[r["index"]]} for r in got["results"])
    assert got["usage"]["total_tokens"] > 0
    top = post(client, "/v2/rerank", {"model": "m", "query": QUERY, "documents": TEXTS, "top_n": 1,
                                      "max_tokens_per_doc": None})
    assert [set(r) for r in top["results"]] == [{"index", "relevance_score"}]
    assert top["results"][0]["index"] == want[0]["index"]
    cosine = post(client, "/v1/rerank", {"query": QUERY, "documents": TEXTS, "pooler": "mean"})
    assert cosine["results"][0]["index"] == post(client, "/rerank", {"query": QUERY, "texts": TEXTS,
                                                                     "pooler": "mean"})[0]["index"]
    r = client.post("/v1/rerank", json={"query": QUERY, "documents": []})
    assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request_error"
    assert "documents" in r.json()["error"]["message"]
    with limited_server.client(auth=False) as anon:
        r = anon.post("/v1/rerank", json={"query": QUERY, "documents": TEXTS})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_v1_models_names_the_model_and_its_aliases(client):
    listed = client.get("/v1/models").json()
    assert listed["object"] == "list"
    ids = [m["id"] for m in listed["data"]]
    assert ids == ["sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2"]
    assert all(m["object"] == "model" and m["root"] == ids[0] and m["created"] > 0 for m in listed["data"])
    assert client.get("/v1/models/all-MiniLM-L6-v2").json()["root"] == ids[0]
    assert client.get(f"/v1/models/{ids[0]}").json()["id"] == ids[0]  # an id with a slash
    r = client.get("/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    assert "gpt-4" in r.json()["error"]["message"] and ids[0] in r.json()["error"]["message"]


def test_openapi_lists_the_new_routes(client):
    paths = client.get("/openapi.json").json()["paths"]
    for path, method in [("/tei", "post"), ("/tei/embed", "post"), ("/tei/embed_all", "post"),
                         ("/tei/rerank", "post"), ("/tei/tokenize", "post"), ("/tei/info", "get"),
                         ("/tei/health", "get"), ("/tei/v1/embeddings", "post"), ("/v1/rerank", "post"),
                         ("/v1/models", "get"), ("/v1/models/{model_id}", "get")]:
        assert method in paths.get(path, {}), path
    assert "/embed" in paths and "/rerank" in paths  # embedpool's own are still there


# ---------------------------------------------------------------------- found on the way
@pytest.mark.parametrize("path,field", [("/embed", "inputs"), ("/v1/embeddings", "input")])
def test_ragged_ranges_are_a_422(client, path, field):
    r = client.post(path, json={field: "x", "precision": "uint8", "ranges": [[1.0, 2.0], [3.0]],
                                "encoding_format": "float"})
    assert r.status_code == 422, r.text
    message = r.json()["error"] if path == "/embed" else r.json()["error"]["message"]
    assert "ranges" in message and "384" in message and "2, 1" in message


def test_error_messages_name_no_server_folders(server, client):
    r = client.get("/collections/nope")
    assert r.status_code == 404 and "nope" in r.json()["error"]
    assert str(server.data_dir) not in r.text and "/" not in r.json()["error"]
    # a collection whose committed FAISS file is damaged, written outside the server
    from embedpool import index

    spec = index.CollectionSpec(kind="single", dim=384)
    with index.open_collection(server.data_dir, "damaged", spec) as coll:
        coll.add(["a", "b"], np.eye(2, 384, dtype=np.float32), ["one", "two"])
        coll.commit()
    files = list((server.data_dir / "damaged").glob("*.faiss"))
    assert files
    for f in files:
        f.write_bytes(b"not a faiss index")
    r = client.post("/collections/damaged/search", json={"query": "one"})
    assert r.status_code == 500, r.text
    message = r.json()["error"]
    assert "'damaged'" in message and "delete the collection" in message and files[0].name in message
    assert str(server.data_dir) not in r.text and ".cpp" not in r.text and "faiss/" not in r.text
    assert client.delete("/collections/damaged").status_code == 200  # what the message says to do works
