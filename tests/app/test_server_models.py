"""Several models in one server (issue 31 part 4): a real uvicorn server holding the packaged
all-MiniLM-L6-v2 and a tiny random-weight sentence-transformers model with a Dense head (built
here, tests/family_models.py), each loaded by the server from ``--model NAME=PATH_OR_ID``
entries. Each answers with its own vectors and dimensions (against sentence-transformers'
``encode`` of each), requests pick one by ``model`` (TEI clients by ``/models/NAME/tei``), an
unknown model is a 404 naming the served ones, and a collection is embedded and searched with
the model it was created on only."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest

from embedpool.app.cli import build_parser
from embedpool.app.server import create_app
from embedpool.app.settings import Settings, from_args, model_entries
from family_models import FAMILIES, build, reference
from server_testutil import Uvicorn

TEXTS = ["Aspirin lowers the risk of stroke.", "The control group reported more headaches."]
MINILM = "sentence-transformers/all-MiniLM-L6-v2"  # the packaged weights


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    family = FAMILIES["bert-dense"]  # mean pooling, then Dense 32 -> 16 (tanh), then Normalize
    path = build(family, tmp_path_factory.mktemp("tiny"))
    return path, reference(path, family)


@pytest.fixture(scope="module")
def two_models(tiny, tmp_path_factory):
    settings = Settings(model=f"minilm={MINILM},tiny={tiny[0]}", precision="fp32",
                        data_dir=str(tmp_path_factory.mktemp("data")))
    with Uvicorn(create_app(settings)) as url, httpx.Client(base_url=url, timeout=120) as client:
        deadline = time.monotonic() + 240
        while (r := client.get("/health")).status_code != 200:
            assert time.monotonic() < deadline and r.json()["status"] == "loading", r.text
            time.sleep(0.2)
        assert r.json()["models"] == {"minilm": "ready", "tiny": "ready"}
        yield client


def test_serve_takes_repeated_model_entries():
    args = build_parser().parse_args(["serve", "--model", "minilm=" + MINILM, "--model", "tiny=/models/tiny"])
    settings = from_args(args)
    assert model_entries(settings.model) == [("minilm", MINILM), ("tiny", "/models/tiny")]
    assert model_entries(from_args(build_parser().parse_args(["serve"])).model) == [("all-MiniLM-L6-v2", None)]


def test_each_model_answers_with_its_own_vectors(two_models, tiny, st_model):
    c = two_models
    info = c.get("/info").json()
    assert [(m["name"], m["model"], m["dim"]) for m in info["models"]] == [
        ("minilm", MINILM, 384), ("tiny", str(tiny[0]), 16)]
    assert info["model"] == MINILM and info["dim"] == 384  # the default at the top level
    ids = {m["id"]: m["root"] for m in c.get("/v1/models").json()["data"]}
    assert ids["minilm"] == ids[MINILM] == MINILM and ids["tiny"] == str(tiny[0])

    want_minilm = st_model.encode(TEXTS, normalize_embeddings=True)
    want_tiny = tiny[1].encode(TEXTS)
    assert want_tiny.shape == (2, 16)

    def cos(got, want):
        got = np.asarray(got, dtype=np.float32)
        assert got.shape == want.shape
        return (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)

    default = c.post("/embed", json={"inputs": TEXTS}).json()
    assert default["model"] == MINILM and cos(default["embeddings"], want_minilm).min() >= 0.99999
    small = c.post("/embed", json={"inputs": TEXTS, "model": "tiny"}).json()
    assert small["model"] == str(tiny[0]) and cos(small["embeddings"], want_tiny).min() >= 0.99999
    openai = c.post("/v1/embeddings", json={"input": TEXTS, "model": "tiny"}).json()
    assert cos([d["embedding"] for d in openai["data"]], want_tiny).min() >= 0.99999
    tei = c.post("/models/tiny/tei/embed", json={"inputs": TEXTS}).json()  # a TEI client's base URL per model
    assert cos(tei, want_tiny).min() >= 0.99999
    assert len(c.post("/tei/embed", json={"inputs": TEXTS}).json()[0]) == 384  # /tei: the default
    assert c.get("/models/tiny/tei/info").json()["served_model_name"] == "tiny"
    # rerank on each model: the tiny model's cosine ranking is its own vectors'
    r = c.post("/rerank", json={"query": TEXTS[0], "texts": TEXTS, "pooler": "auto", "model": "tiny"}).json()
    q = tiny[1].encode([TEXTS[0]], prompt_name=None)[0]
    assert np.allclose(sorted(x["score"] for x in r), sorted(want_tiny @ q), atol=1e-5)
    assert c.post("/v1/rerank", json={"query": "q", "documents": TEXTS, "model": "minilm"}).status_code == 200


def test_an_unknown_model_is_a_404_naming_the_served_ones(two_models):
    c = two_models
    for path, body in (("/embed", {"inputs": "x", "model": "nope"}), ("/v1/embeddings", {"input": "x", "model": "nope"}),
                       ("/rerank", {"query": "q", "texts": ["t"], "model": "nope"}),
                       ("/collections", {"name": "c", "model": "nope"})):
        r = c.post(path, json=body)
        assert r.status_code == 404, (path, r.text)
        assert "'minilm', 'tiny'" in r.text and "nope" in r.text
    r = c.post("/models/nope/tei/embed", json={"inputs": "x"})
    assert r.status_code == 404 and r.json()["error_type"] == "NotFound" and "'tiny'" in r.json()["error"]


def test_a_collection_is_embedded_and_searched_with_its_own_model(two_models):
    c = two_models
    made = c.post("/collections", json={"name": "small", "model": "tiny"}).json()
    assert made["dim"] == 16 and made["model"] != MINILM
    assert c.post("/collections", json={"name": "large"}).json()["dim"] == 384  # the default model
    docs = [{"id": str(i), "text": t} for i, t in enumerate(TEXTS)]
    for name in ("small", "large"):
        assert c.post(f"/collections/{name}/documents", json=docs).status_code == 200
        hits = c.post(f"/collections/{name}/search", json={"query": TEXTS[1], "k": 1}).json()["hits"]
        assert hits[0]["id"] == "1"
    # searching a collection through another model's embedding is refused, naming both
    r = c.post("/collections/small/search", json={"query": "q", "model": "minilm"})
    assert r.status_code == 409 and "'tiny'" in r.text and "minilm" in r.text
    r = c.post("/collections/large/search", json={"query": "q", "model": "tiny"})
    assert r.status_code == 409
    assert c.post("/collections/small/search", json={"query": "q", "model": "tiny"}).status_code == 200


def test_the_queue_gauges_count_every_models_queue():
    """Each model's batcher reports its own queue; /metrics' gauges hold the sum, not the last report."""
    from embedpool.app.server.metrics import Metrics

    m = Metrics()
    a, b = m.for_model("a"), m.for_model("b")
    a.on_queue(3, 1)
    b.on_queue(5, 2)
    a.on_queue(0, 0)
    text = m.render().decode()
    assert "embedpool_queue_size 5.0" in text and "embedpool_queue_requests 2.0" in text
