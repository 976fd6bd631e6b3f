"""The collection recipe (app/recipe.py), the one builder of a collection's spec: the HTTP create
route and the indexing job make the same collection of the same model, pooler and options, for
every pooler kind (issue 48); a SPLADE collection made over HTTP with default fields stores its
weights as they are, takes documents and finds them (issue 49); a cluster collection made over HTTP
keeps the job's default companion, so ``two_stage`` searches it. Real servers (conftest.py), the
default model and the tiny random-weight SPLADE model (splade_testutil.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from embedpool.app.indexing import IndexJob
from embedpool.errors import InvalidError
from embedpool.index import CollectionSpec

POOLERS = ["mean", "cls", "max", "landmark", "tokens", "cluster:pool_factor=4", "layermean"]
#: (HTTP request fields and query, the IndexJob keywords of the same options)
OPTIONS = {
    "defaults": ({}, {}, {}),
    "chosen": ({"factory": "HNSW32", "companion_factory": "HNSW32", "precision": "int8", "token_factory": "HNSW16",
                "analyzer": "german", "normalized": False},
               {"dimensions": 128},
               {"factory": "HNSW32", "storage_precision": "int8", "token_factory": "HNSW16", "analyzer": "german",
                "normalize": False, "dimensions": 128}),
}


def _manifest_spec(folder: Path) -> dict:
    """The collection's spec as its manifest records it (names and timestamps left out)."""
    return dataclasses.asdict(CollectionSpec.from_dict(json.loads((folder / "manifest.json").read_text())))


def _http_spec(srv, name: str, pooler: str, body: dict, params: dict) -> dict:
    with srv.client() as c:
        r = c.post("/collections", params=params, json={"name": name, "pooler": pooler, **body})
        assert r.status_code == 201, r.text
        try:
            return _manifest_spec(srv.data_dir / name)
        finally:
            c.delete(f"/collections/{name}")


def _job_spec(embedder, folder: Path, name: str, pooler: str, options: dict) -> dict:
    with IndexJob(embedder, folder, name, [pooler], progress=False, **options):
        pass  # opening the job creates its collection
    return _manifest_spec(folder / name)


@pytest.mark.parametrize("options", sorted(OPTIONS))
def test_http_and_job_make_the_same_collection_for_every_pooler(server, embedder, tmp_path, options):
    body, params, job = OPTIONS[options]
    for i, pooler in enumerate(POOLERS):
        name = f"recipe-{options}-{i}"
        http = _http_spec(server, name, pooler, body, params)
        assert http == _job_spec(embedder, tmp_path, name, pooler, job), pooler
        assert http["kind"] == ("multi" if embedder.pooler(pooler).multi_vector else "single")
        if http["kind"] == "multi":  # the job's default companion, over HTTP too
            assert (http["companion_pooler"], http["companion_rows"]) == ("mean", "document"), pooler


@pytest.fixture(scope="module")
def splade_embedder(splade_server):
    from embedpool.poolers import Embedder, FrozenEncoder

    return Embedder(FrozenEncoder(splade_server.model_path, precision="fp32"))


def test_http_and_job_make_the_same_splade_collection(splade_server, splade_embedder, tmp_path):
    """Sparse weights are stored as they are, under the inner product, on either path; asking
    HTTP for normalized vectors or L2 for them is a 422 naming the field."""
    for i, (body, job) in enumerate((({}, {}), ({"normalized": False, "analyzer": "none"},
                                                 {"normalize": False, "analyzer": "none"}))):
        http = _http_spec(splade_server, f"recipe-sp-{i}", "splade", body, {})
        assert http == _job_spec(splade_embedder, tmp_path, f"recipe-sp-{i}", "splade", job)
        assert (http["normalized"], http["metric"], http["dim"]) == (False, "ip", splade_embedder.output_dim("splade"))
    with splade_server.client() as c:
        for field, value in (("normalized", True), ("metric", "l2")):
            r = c.post("/collections", json={"name": "recipe-sp-bad", "pooler": "splade", field: value})
            assert r.status_code == 422 and r.json()["param"] == field, r.text
            assert "sparse" in r.json()["error"] and "dot product" in r.json()["error"]
        assert c.get("/collections/recipe-sp-bad").status_code == 404


def test_splade_collection_made_over_http_takes_and_finds_documents(splade_server):
    """Issue 49: ``POST /collections {"name": "sp", "pooler": "splade"}`` then an upsert answered
    409 (the collection said normalized, the weights are not); now both succeed and a search
    ranks by the exact dot product of the weights."""
    docs = {"cat": "the cat sat on the mat", "market": "stock market fell and investors sold shares"}
    queries = {"market fell": "market", "the cat sat": "cat"}
    ref = splade_server.reference
    D = ref.encode(list(docs.values()), convert_to_tensor=True).to_dense().numpy().astype(np.float64)
    Q = ref.encode(list(queries), convert_to_tensor=True).to_dense().numpy().astype(np.float64)
    exact = Q @ D.T
    assert [list(docs)[j] for j in exact.argmax(1)] == list(queries.values())  # the data tells them apart
    with splade_server.client() as c:
        r = c.post("/collections", json={"name": "sp", "pooler": "splade"})
        assert r.status_code == 201, r.text
        assert (r.json()["normalized"], r.json()["metric"]) == (False, "ip")
        r = c.post("/collections/sp/documents", json=[{"id": k, "text": t} for k, t in docs.items()])
        assert r.status_code == 200, r.text
        assert r.json()["documents"] == 2
        r = c.post("/collections/sp/search", json={"queries": list(queries), "k": 2})
        assert r.status_code == 200, r.text
        for i, (hits, want) in enumerate(zip(r.json()["results"], queries.values())):
            assert hits[0]["id"] == want
            got = {h["id"]: h["score"] for h in hits}
            np.testing.assert_allclose([got[k] for k in docs], exact[i], rtol=1e-4)
        assert c.delete("/collections/sp").status_code == 200


def test_cluster_collection_made_over_http_searches_two_stage(client):
    """``cluster:pool_factor=4`` made over HTTP keeps the job's ``mean`` companion, so two_stage
    (companion candidates, then exact MaxSim) answers, and with every document a candidate it
    ranks as exhaustive MaxSim does."""
    docs = ["The cat sat on the mat and purred.", "Stock markets fell sharply on Monday.",
            "Heavy rain is expected over the weekend.", "A dog chased a red ball in the park."]
    r = client.post("/collections", json={"name": "recipe-cluster", "pooler": "cluster:pool_factor=4"})
    assert r.status_code == 201, r.text
    assert (r.json()["kind"], r.json()["companion_pooler"]) == ("multi", "mean")
    r = client.post("/collections/recipe-cluster/documents", json=[{"id": f"d{i}", "text": t} for i, t in enumerate(docs)])
    assert r.status_code == 200, r.text
    assert client.get("/collections/recipe-cluster").json()["stats"]["companion_rows"] == len(docs)
    ranked = {}
    for mode in ("two_stage", "exhaustive"):
        r = client.post("/collections/recipe-cluster/search",
                        json={"queries": ["a kitten on a rug", "stock prices dropped"], "k": 4, "mode": mode,
                              "candidates": len(docs)})
        assert r.status_code == 200, r.text
        ranked[mode] = [[h["id"] for h in hits] for hits in r.json()["results"]]
    assert ranked["two_stage"] == ranked["exhaustive"]
    assert [ids[0] for ids in ranked["two_stage"]] == ["d0", "d1"]
    client.delete("/collections/recipe-cluster")


def test_job_errors_name_its_flags(embedder, tmp_path):
    """The recipe names an option by its HTTP field; the job names its flag."""
    with pytest.raises(InvalidError, match="^--companion-pooler: companion pooler 'cluster' gives several") as e:
        IndexJob(embedder, tmp_path, "bad", ["tokens"], companion_pooler="cluster", progress=False)
    assert e.value.param == "--companion-pooler"
    with pytest.raises(InvalidError, match="^--companion-pooler: ") as e:
        IndexJob(embedder, tmp_path, "bad", ["tokens"], companion_pooler="no-such-pooler", progress=False)
    assert not (tmp_path / "bad").exists()
