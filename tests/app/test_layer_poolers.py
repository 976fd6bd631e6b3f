"""The poolers over every hidden layer through what a person runs: the HTTP API (one request
with layer and last-layer poolers, a collection of layer-pooled vectors, /info), the evaluation
command on BEIR and STS slices. The real server and model (see conftest.py)."""

from __future__ import annotations

import json

import numpy as np

from embedpool.app import datasets
from embedpool.app import evaluation as ev

LAYER_POOLERS = ["layermean", "maxpoolbert", "multilayer", "multilayer:queries=2", "layermean:per_window=true"]
TEXTS = ["The cat sat on the mat.", "Stock markets fell sharply on Monday.", "A dog chased a red ball."]


def test_http_embed_and_a_collection_with_layer_poolers(client, embedder):
    r = client.post("/embed", json={"inputs": TEXTS, "poolers": ["mean", *LAYER_POOLERS]})
    assert r.status_code == 200, r.text
    results = {x["pooler"]: x for x in r.json()["results"]}
    want = embedder.embed(TEXTS, ["mean", *LAYER_POOLERS])
    for spec in ["mean", *LAYER_POOLERS]:
        spec_out = embedder.pooler(spec).spec
        assert results[spec_out]["multi_vector"] == embedder.pooler(spec).multi_vector
        for got, ref in zip(results[spec_out]["embeddings"], want.vectors[spec]):
            np.testing.assert_allclose(np.asarray(got, dtype=np.float32), ref, atol=1e-5)
    # untrained multilayer is mean, over HTTP too
    np.testing.assert_allclose(np.asarray(results["multilayer"]["embeddings"]),
                               np.asarray(results["mean"]["embeddings"]), atol=0)

    info = {p["name"]: p for p in client.get("/info").json()["poolers"]}
    assert {n for n, p in info.items() if p["all_layers"]} == {"layermean", "maxpoolbert", "multilayer"}
    learned = {n for n, p in info.items() if p["learned"]}
    # of the layer poolers only multilayer has trained weights (the other learned poolers are not
    # this file's business)
    assert "multilayer" in learned and not learned & {"layermean", "maxpoolbert"}

    assert client.post("/collections", json={"name": "layers", "pooler": "layermean"}).status_code == 201
    docs = [{"id": "cat", "text": "The cat sat on the mat and purred."},
            {"id": "stocks", "text": "Stock markets fell sharply as investors sold shares."},
            {"id": "rain", "text": "Heavy rain and storms are forecast for the weekend."}]
    assert client.post("/collections/layers/documents", json=docs).status_code == 200
    hits = client.post("/collections/layers/search", json={"query": "a kitten on a rug", "k": 3}).json()["hits"]
    assert hits[0]["id"] == "cat"
    stored = client.get("/collections/layers/documents/cat", params={"include_vector": True}).json()
    ref = embedder.embed([docs[0]["text"]], ["layermean"]).matrix("layermean")[0]
    np.testing.assert_allclose(np.asarray(stored["vector"], dtype=np.float32), ref, atol=1e-5)
    assert client.delete("/collections/layers").status_code == 200


def test_eval_scores_the_layer_poolers_on_beir_and_sts(embedder, data_dir, tmp_path, monkeypatch, capsys):
    from embedpool.app import cli
    from embedpool.app.commands import eval as eval_cmd

    monkeypatch.setattr(eval_cmd, "load_embedder", lambda settings: embedder)
    out = tmp_path / "report.json"
    assert cli.main(["eval", "--data", str(data_dir / "scifact"), "--max-docs", "30", "--seed", "3",
                     "--latency-queries", "2", "--pooler", "mean", "--pooler", "layermean", "--pooler", "maxpoolbert",
                     "--pooler", "multilayer", "--out", str(out), "--no-progress"]) == 0
    rows = {r["pooler"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"mean", "layermean", "maxpoolbert", "multilayer"}
    assert rows["multilayer"]["ndcg@10"] == rows["mean"]["ndcg@10"] and rows["multilayer"]["p_value"] == 1.0
    assert all(0 < r["ndcg@10"] <= 1 for r in rows.values())
    assert "maxpoolbert" in capsys.readouterr().out

    pairs = datasets.load_sts(data_dir / "stsb", "test")[:120]
    sts = {r["pooler"]: r for r in ev.evaluate_sts(embedder, pairs, ["mean", "layermean", "maxpoolbert"])["results"]}
    assert sts["layermean"]["spearman"] > 0.7 and 0 < sts["maxpoolbert"]["p_value"] <= 1
