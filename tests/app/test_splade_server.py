"""Sparse output over HTTP: a real server on a tiny SPLADE model answers `/embed` with
`{indices, values}` and TEI's `/tei/embed_sparse` with `[{index, value}]`, both equal to
sentence-transformers' SparseEncoder; the default model (no MLM head) is refused with a 422."""

from __future__ import annotations

import numpy as np
import pytest

TEXTS = ["the cat sat on the mat", "stock market fell", "heavy rain and storm for the weekend"]


@pytest.fixture(scope="module")
def splade(splade_server):
    return splade_server, splade_server.reference.encode(TEXTS, convert_to_tensor=True).to_dense().numpy()


def test_embed_answers_indices_and_values(splade):
    srv, want = splade
    with srv.client() as c:
        r = c.post("/embed", json={"inputs": TEXTS, "pooler": "splade"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["pooler"] == "splade" and not body["multi_vector"]
        for row, w in zip(body["embeddings"], want):
            assert row["indices"] == np.flatnonzero(w).tolist()
            np.testing.assert_allclose(row["values"], w[w != 0], atol=1e-5)
        top = c.post("/embed", json={"inputs": TEXTS, "pooler": "splade:top_k=2"}).json()["embeddings"]
        for row, w in zip(top, want):
            assert row["indices"] == sorted(np.argsort(w)[-2:].tolist())
        r = c.post("/embed", json={"inputs": TEXTS, "pooler": "splade", "precision": "int8"})
        assert r.status_code == 422 and "float32" in r.text


def test_tei_embed_sparse_has_tei_shape(splade):
    srv, want = splade
    with srv.client() as c:
        r = c.post("/tei/embed_sparse", json={"inputs": TEXTS})
        assert r.status_code == 200, r.text
        for row, w in zip(r.json(), want):
            assert [x["index"] for x in row] == np.flatnonzero(w).tolist()
            np.testing.assert_allclose([x["value"] for x in row], w[w != 0], atol=1e-5)
        r = c.post("/tei/embed_sparse", json={"inputs": "x", "pooler": "mean"})
        assert r.status_code == 422 and "not sparse" in r.json()["error"]


def test_default_model_refuses_splade(server):
    with server.client() as c:
        r = c.post("/embed", json={"inputs": "a text", "pooler": "splade"})
        assert r.status_code == 422 and "masked-language-model head" in r.text
        r = c.post("/tei/embed_sparse", json={"inputs": "a text"})
        assert r.status_code == 422 and "masked-language-model head" in r.json()["error"]
