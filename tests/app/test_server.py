"""Every route of the HTTP API, against a real uvicorn process (see conftest.py)."""

from __future__ import annotations

import asyncio
import base64
import re
import time

import httpx
import numpy as np
import pytest

SENTENCES = [
    "The cat sat on the mat.", "Stock markets fell sharply on Monday.", "A dog chased a red ball.",
    "Quantum computers use qubits.", "She baked bread for the neighbours.", "Rain is expected tomorrow.",
    "The violin was out of tune.", "Protein folding is hard to predict.",
]


def vec(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


# ---------------------------------------------------------------------- health, info, metrics, docs
def test_health_loading_then_ready(server, client):
    # While the model loaded, /health said 503 "loading" and /embed 503 not_ready.
    assert server.loading, "the server was ready before the first /health: loading was not observed"
    assert server.loading["health"]["status"] == "loading"
    status, body = server.loading["embed"]
    assert status == 503 and body["type"] == "not_ready"
    r = client.get("/health")
    assert r.status_code == 200
    body = r.json()
    assert body.pop("storage") == {"backend": "faiss", "status": "ok", "location": str(server.data_dir)}
    assert body == {"status": "ready", "model": "sentence-transformers/all-MiniLM-L6-v2"}


def test_info(client):
    info = client.get("/info").json()
    assert info["status"] == "ready"
    assert info["model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert info["dim"] == 384 and info["max_length"] == 256 and info["precision"] == "fp32"


def test_auto_precision_in_info_metrics_and_manifest(auto_server):
    """The default is auto, resolved at load from this CPU's features (the same pure decision)."""
    from embedpool.poolers.precision import cpu_features, resolve

    path, reason = resolve("auto")
    with auto_server.client() as c:
        info = c.get("/info").json()
        assert info["precision_requested"] == "auto" and info["precision"] == path
        assert info["precision_reason"] == reason and info["cpu"] in reason
        text = c.get("/metrics").text
        labels = re.search(r"^embedpool_encoder_info\{(.*)\} 1\.0$", text, re.M).group(1)
        assert f'precision="{path}"' in labels and 'requested="auto"' in labels
        assert f'isa="{cpu_features().isa}"' in labels
        r = c.post("/collections", json={"name": "auto-notes"})
        assert r.status_code == 201, r.text
        assert r.json()["encoder_precision"] == path  # recorded in the manifest
    assert info["default_pooler"] == "mean"
    names = {p["name"] for p in info["poolers"]}
    assert {"mean", "cls", "max", "landmark", "attention", "cluster", "tokens"} <= names
    assert isinstance(info["collections"], list)
    assert info["limits"]["max_client_batch"] == 512


def test_metrics(client):
    client.post("/embed", json={"inputs": ["metrics one", "metrics two"]})
    text = client.get("/metrics").text
    for name in ("embedpool_requests_total", "embedpool_request_duration_seconds_bucket",
                 "embedpool_queue_size", "embedpool_batch_size_bucket", "embedpool_batch_tokens_bucket",
                 "embedpool_tokens_total", "embedpool_model_loaded"):
        assert name in text, name
    assert re.search(r'embedpool_requests_total\{method="POST",route="/embed",status="200"\} [1-9]', text)
    assert re.search(r"^embedpool_model_loaded 1\.0$", text, re.M)
    assert 'embedpool_encoder_info{' in text and 'precision="fp32"' in text
    # where the worker's time goes, per stage
    stages = dict(re.findall(r'^embedpool_round_stage_seconds_total\{stage="(\w+)"\} (\S+)$', text, re.M))
    assert set(stages) == {"tokenize", "forward", "pool", "count", "deliver"} and float(stages["forward"]) > 0
    tokens = float(re.search(r"^embedpool_tokens_total (\S+)$", text, re.M).group(1))
    assert tokens > 0


def test_docs_and_openapi(client):
    r = client.get("/docs")
    assert r.status_code == 200 and "swagger" in r.text.lower()
    spec = client.get("/openapi.json").json()
    paths = set(spec["paths"])
    assert {"/health", "/info", "/metrics", "/embed", "/v1/embeddings", "/collections", "/collections/{name}",
            "/collections/{name}/documents", "/collections/{name}/documents/{doc_id}",
            "/collections/{name}/search"} <= paths


# ---------------------------------------------------------------------- /embed
def test_embed_single_string(client):
    r = client.post("/embed", json={"inputs": "A sentence to embed."})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert body["pooler"] == "mean" and body["multi_vector"] is False
    assert len(body["embeddings"]) == 1 and len(body["embeddings"][0]) == 384
    assert np.linalg.norm(vec(body["embeddings"][0])) == pytest.approx(1.0, abs=1e-5)
    assert body["usage"]["tokens"] == 8  # [CLS] a sentence to em ##bed ##d . [SEP]


def test_embed_options(client):
    base = client.post("/embed", json={"inputs": SENTENCES[:3]}).json()["embeddings"]
    dims = client.post("/embed", json={"inputs": SENTENCES[:3], "dimensions": 64}).json()["embeddings"]
    assert all(len(v) == 64 for v in dims)
    # Matryoshka: truncate, then normalize
    full = vec(base[0])
    expect = full[:64] / np.linalg.norm(full[:64])
    assert np.allclose(vec(dims[0]), expect, atol=1e-5)
    raw = client.post("/embed", json={"inputs": SENTENCES[:1], "normalize": False}).json()["embeddings"][0]
    assert np.linalg.norm(vec(raw)) != pytest.approx(1.0, abs=1e-3)
    assert np.allclose(vec(raw) / np.linalg.norm(vec(raw)), full, atol=1e-5)
    q = client.post("/embed", json={"inputs": SENTENCES[:1], "role": "query"}).json()["embeddings"][0]
    assert np.allclose(vec(q), full, atol=1e-5)  # MiniLM has no prompts
    cls = client.post("/embed", json={"inputs": SENTENCES[:1], "pooler": "cls"}).json()
    assert cls["pooler"] == "cls" and not np.allclose(vec(cls["embeddings"][0]), full, atol=1e-3)


def test_embed_multi_vector(client):
    r = client.post("/embed", json={"inputs": ["short one", "a slightly longer input text"], "pooler": "tokens"})
    body = r.json()
    assert body["multi_vector"] is True
    a, b = (np.asarray(e, dtype=np.float32) for e in body["embeddings"])
    assert a.ndim == 2 and a.shape[1] == 384 and b.shape[0] > a.shape[0]


def test_embed_several_poolers_one_pass(client):
    texts = SENTENCES[:3]
    r = client.post("/embed", json={"inputs": texts, "poolers": ["mean", "cls", "cluster:pool_factor=2"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [x["pooler"] for x in body["results"]] == ["mean", "cls", "cluster"]
    assert [x["multi_vector"] for x in body["results"]] == [False, False, True]
    # each result equals the same pooler asked alone
    for res in body["results"]:
        alone = client.post("/embed", json={"inputs": texts, "pooler": res["pooler"]}).json()["embeddings"]
        for got, want in zip(res["embeddings"], alone):
            assert np.allclose(vec(got), vec(want), atol=1e-5)
    # usage counts the inputs' tokens once, not once per pooler
    single = client.post("/embed", json={"inputs": texts}).json()["usage"]["tokens"]
    assert body["usage"]["tokens"] == single


def test_embed_landmark_and_truncate(client):
    long = "word " * 600
    r = client.post("/embed", json={"inputs": [long], "pooler": "landmark:g=32", "truncate": False})
    assert r.status_code == 200, r.text
    r = client.post("/embed", json={"inputs": [long]})
    assert r.status_code == 200 and r.json()["usage"]["tokens"] == 256


# ---------------------------------------------------------------------- /v1/embeddings
def test_openai_float_and_base64(client):
    r = client.post("/v1/embeddings", json={"input": ["hello world", "second"], "model": "anything"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert [d["index"] for d in body["data"]] == [0, 1] and body["data"][0]["object"] == "embedding"
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    r64 = client.post("/v1/embeddings", json={"input": "hello world", "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(r64["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, vec(body["data"][0]["embedding"]), atol=1e-6)
    small = client.post("/v1/embeddings", json={"input": "hello world", "dimensions": 32}).json()
    assert len(small["data"][0]["embedding"]) == 32


def test_openai_client_shape_errors(client):
    r = client.post("/v1/embeddings", json={"input": 12})
    assert r.status_code == 422
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == "input"


# ---------------------------------------------------------------------- collections
DOCS = [
    {"id": "cat", "text": "The cat sat on the mat and purred.", "metadata": {"topic": "pets"}},
    {"id": "stocks", "text": "Stock markets fell sharply as investors sold shares."},
    {"id": "dog", "text": "A dog chased a red ball across the park.", "metadata": {"topic": "pets"}},
    {"id": "rain", "text": "Heavy rain and storms are forecast for the weekend."},
]


def test_collections_crud_and_search(client):
    r = client.post("/collections", json={"name": "notes"})
    assert r.status_code == 201, r.text
    info = r.json()
    assert info["kind"] == "single" and info["pooler"] == "mean" and info["dim"] == 384 and info["documents"] == 0
    assert info["encoder_precision"] == "fp32"  # recorded in the manifest
    assert client.post("/collections", json={"name": "notes"}).status_code == 200  # same settings: fine
    conflict = client.post("/collections", json={"name": "notes", "pooler": "cls"})
    assert conflict.status_code == 409 and conflict.json()["type"] == "conflict"

    r = client.post("/collections/notes/documents", json=DOCS)
    assert r.status_code == 200, r.text
    assert r.json()["upserted"] == 4 and r.json()["documents"] == 4 and r.json()["usage"]["tokens"] > 0

    assert "notes" in [c["name"] for c in client.get("/collections").json()["collections"]]
    got = client.get("/collections/notes").json()
    assert got["documents"] == 4 and got["stats"]["documents"] == 4

    r = client.post("/collections/notes/search", json={"query": "a kitten on a rug", "k": 2})
    assert r.status_code == 200, r.text
    hits = r.json()["hits"]
    assert hits[0]["id"] == "cat" and hits[0]["metadata"] == {"topic": "pets"} and "purred" in hits[0]["text"]
    assert len(hits) == 2 and hits[0]["score"] >= hits[1]["score"]
    r = client.post("/collections/notes/search", json={"queries": ["finance news", "weather"], "k": 1,
                                                         "include_text": False})
    res = r.json()["results"]
    assert [h[0]["id"] for h in res] == ["stocks", "rain"] and "text" not in res[0][0]

    doc = client.get("/collections/notes/documents/dog").json()
    assert doc == {"id": "dog", "text": DOCS[2]["text"], "metadata": {"topic": "pets"}}
    with_vec = client.get("/collections/notes/documents/dog", params={"include_vector": True}).json()
    assert len(with_vec["vector"]) == 384

    # upsert replaces by id
    client.post("/collections/notes/documents", json={"documents": [{"id": "dog", "text": "Dogs love long walks."}]})
    assert client.get("/collections/notes/documents/dog").json()["text"] == "Dogs love long walks."
    assert client.get("/collections/notes").json()["documents"] == 4

    assert client.delete("/collections/notes/documents/rain").json() == {"deleted": "rain"}
    assert client.get("/collections/notes/documents/rain").status_code == 404
    assert client.delete("/collections/notes/documents/rain").status_code == 404
    assert client.get("/collections/notes").json()["documents"] == 3

    assert client.delete("/collections/notes").json() == {"deleted": "notes"}
    assert client.get("/collections/notes").status_code == 404
    assert "notes" not in client.get("/info").json()["collections"]


def test_multi_vector_collection_two_stage(client):
    r = client.post("/collections", json={"name": "mv", "pooler": "tokens", "precision": "float16",
                                          "companion_pooler": "mean"})
    assert r.status_code == 201, r.text
    assert (r.json()["kind"], r.json()["companion_pooler"]) == ("multi", "mean")
    assert client.post("/collections/mv/documents", json=DOCS).status_code == 200
    assert client.get("/collections/mv").json()["stats"]["companion_rows"] == len(DOCS)
    for mode in ("exhaustive", "tokens", "two_stage"):
        r = client.post("/collections/mv/search", json={"query": "a kitten on a rug", "k": 2, "mode": mode})
        assert r.status_code == 200, (mode, r.text)
        assert r.json()["hits"][0]["id"] == "cat", mode
    vecs = client.get("/collections/mv/documents/cat", params={"include_vector": True}).json()["vector"]
    assert np.asarray(vecs).shape[1] == 384
    # a single-vector pooler cannot make a multi-vector collection
    r = client.post("/collections", json={"name": "bad", "pooler": "mean", "kind": "multi"})
    assert r.status_code == 422 and "kind" in r.json()["error"]


def test_collection_matryoshka_dimensions(client):
    r = client.post("/collections", params={"dimensions": 128}, json={"name": "small"})
    assert r.status_code == 201 and r.json()["dim"] == 128
    client.post("/collections/small/documents", json=DOCS)
    assert client.post("/collections/small/search", json={"query": "stock market crash"}).json()["hits"][0]["id"] == "stocks"


# ---------------------------------------------------------------------- batching
def test_concurrent_requests_get_their_own_results(server, client):
    """Mixed requests (poolers, dimensions, normalize, role) sent at once: each gets exactly
    what it gets alone."""
    requests = []
    for i in range(24):
        body = {"inputs": [f"{SENTENCES[i % 8]} (variant {i})", SENTENCES[(i * 3) % 8]][: 1 + i % 2]}
        if i % 4 == 1:
            body["pooler"] = "cls"
            body["dimensions"] = 64
        elif i % 4 == 2:
            body["poolers"] = ["mean", "tokens"]
        elif i % 4 == 3:
            body["normalize"] = False
            body["role"] = "query"
        requests.append(body)
    alone = [client.post("/embed", json=b).json() for b in requests]

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as ac:
            return await asyncio.gather(*(ac.post("/embed", json=b) for b in requests))

    together = asyncio.run(burst())
    for want, got in zip(alone, together):
        assert got.status_code == 200, got.text
        got = got.json()
        assert got["usage"] == want["usage"]
        pairs = ([(got["embeddings"], want["embeddings"])] if "embeddings" in want else
                 [(g["embeddings"], w["embeddings"]) for g, w in zip(got["results"], want["results"])])
        for g_list, w_list in pairs:
            assert len(g_list) == len(w_list)
            for g, w in zip(g_list, w_list):
                assert np.asarray(g).shape == np.asarray(w).shape
                assert np.allclose(np.asarray(g), np.asarray(w), atol=1e-5)


def test_health_stays_fast_under_load(server):
    """The encoder runs off the event loop: /health answers quickly while batches encode."""
    texts = [f"{s} " * 6 for s in SENTENCES]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as ac:
            load = [asyncio.ensure_future(ac.post("/embed", json={"inputs": texts})) for _ in range(12)]
            await asyncio.sleep(0.2)
            lat = []
            while not all(t.done() for t in load):
                t0 = time.perf_counter()
                r = await ac.get("/health")
                lat.append(time.perf_counter() - t0)
                assert r.status_code == 200
                await asyncio.sleep(0.05)
            return lat, [t.result().status_code for t in load]

    lat, statuses = asyncio.run(run())
    assert statuses == [200] * 12
    assert lat, "load finished before /health was probed"
    assert float(np.median(lat)) < 0.3 and max(lat) < 3.0, lat


def test_sees_commits_of_another_process(server, client):
    """`embedpool index` (another process) writing while the server runs: the server sees it."""
    from embedpool.index import FaissCollection

    assert client.post("/collections", json={"name": "shared"}).status_code == 201
    assert client.post("/collections/shared/documents", json=DOCS[:2]).status_code == 200
    assert client.get("/collections/shared").json()["documents"] == 2
    other = FaissCollection.open(server.data_dir, "shared")
    v = np.zeros((1, 384), dtype=np.float32)
    v[0, 0] = 1
    other.add(["external"], v, ["written by another process"])
    other.commit()
    other.close()
    assert client.get("/collections/shared").json()["documents"] == 3
    assert client.get("/collections/shared/documents/external").json()["text"] == "written by another process"
    # and the server can still write after the other writer
    assert client.post("/collections/shared/documents", json=DOCS[2:]).json()["documents"] == 5
