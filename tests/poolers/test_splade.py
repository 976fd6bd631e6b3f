"""splade against sentence-transformers' SparseEncoder (MLMTransformer + SpladePooling) on a tiny
random-weight BertForMaskedLM built here, its sparse options, padding invariance, and the refusal
of a model without an MLM head (the packaged all-MiniLM-L6-v2)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedpool.poolers import Embedder, FrozenEncoder, build_pooler
from splade_testutil import make_splade_model  # noqa: E402  (tests/ is on sys.path)

TEXTS = ["the cat sat on the mat", "stock market fell", "heavy rain and storm for the weekend, the investors sold",
         "a", "dog"]


@pytest.fixture(scope="module")
def splade_model(tmp_path_factory):
    """A SparseEncoder saved by sentence-transformers itself around a tiny random BertForMaskedLM."""
    return make_splade_model(tmp_path_factory.mktemp("splade"))


@pytest.fixture(scope="module")
def splade_embedder(splade_model):
    return Embedder(FrozenEncoder(splade_model[0], precision="fp32"))


def test_splade_equals_sentence_transformers_sparse_encoder(splade_model, splade_embedder):
    _, st = splade_model
    want = st.encode(TEXTS, convert_to_tensor=True).to_dense().numpy()
    got = splade_embedder.embed(TEXTS, ["splade"]).matrix("splade")  # normalize=True is ignored: dot-product weights
    assert got.shape == want.shape == (len(TEXTS), st.get_embedding_dimension())
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # not a degenerate case: every vector has weights and the matrix has zeros (a random tiny
    # model's longest text may light up its whole 85-entry vocabulary, so not per row)
    assert (got > 0).any(1).all() and (got == 0).any()
    assert splade_embedder.output_dim("splade") == st.get_embedding_dimension()
    # each text alone: padding never changes a vector
    for i, text in enumerate(TEXTS):
        np.testing.assert_allclose(splade_embedder.embed([text], ["splade"]).matrix("splade")[0], got[i], atol=1e-5)


def test_auto_on_a_sparse_encoder_folder_is_splade(splade_model, splade_embedder):
    """The model's own pooling (`auto`, the server's default) of a SparseEncoder folder is splade."""
    assert splade_embedder.canonical("auto") == "splade"
    want = splade_model[1].encode(TEXTS[:2], convert_to_tensor=True).to_dense().numpy()
    np.testing.assert_allclose(splade_embedder.embed(TEXTS[:2]).matrix("auto"), want, atol=1e-5, rtol=1e-5)


def test_top_k_and_threshold(splade_embedder):
    full = splade_embedder.embed(TEXTS, ["splade"]).matrix("splade")
    top = splade_embedder.embed(TEXTS, ["splade:top_k=3"]).matrix("splade:top_k=3")
    for f, t in zip(full, top):
        kept = np.flatnonzero(t)
        assert len(kept) == min(3, int((f > 0).sum()))
        np.testing.assert_array_equal(t[kept], f[kept])
        assert t[kept].min() >= np.sort(f)[-3]
    cut = float(np.median(full[full > 0]))
    th = splade_embedder.embed(TEXTS, [f"splade:threshold={cut}"]).matrix(f"splade:threshold={cut}")
    np.testing.assert_array_equal(th, np.where(full > cut, full, 0))
    with pytest.raises(ValueError, match="must be >= 0"):
        build_pooler("splade:top_k=-1")


def test_splade_refuses_a_model_without_an_mlm_head(embedder):
    with pytest.raises(ValueError, match="needs a model with a masked-language-model head.*lacks the head's weights"):
        embedder.pooler("splade")


def test_eval_scores_sparse_retrieval_exactly(splade_embedder):
    """`embedpool eval`'s retrieval path (a collection of the raw weights, inner product) ranks
    as the exact dot products of the sparse vectors do."""
    from embedpool.app import evaluation as ev
    from embedpool.app.datasets import BeirData, Record

    docs = ["the cat sat on the mat", "stock market fell", "heavy rain and storm for the weekend", "the dog sat",
            "investors sold shares", "a mat for the cat", "rain on the market"]
    queries = {"q0": "cat mat", "q1": "market shares", "q2": "storm rain", "q3": "dog"}
    qrels = {"q0": {"d0": 1, "d5": 1}, "q1": {"d1": 1, "d4": 1}, "q2": {"d2": 1}, "q3": {"d3": 1}}
    data = BeirData([Record(f"d{i}", t) for i, t in enumerate(docs)], queries, qrels, "tiny", {})
    report = ev.evaluate_retrieval(splade_embedder, data, ["splade"], progress=False, latency_queries=0)
    D = splade_embedder.embed(docs, ["splade"]).matrix("splade")
    Q = splade_embedder.embed(list(queries.values()), ["splade"], role="query").matrix("splade")
    scores = Q.astype(np.float64) @ D.T.astype(np.float64)
    assert len({round(x, 4) for x in scores.ravel()}) == scores.size  # no ties: one exact order
    run = {q: {f"d{j}": float(scores[i, j]) for j in range(len(docs))} for i, q in enumerate(queries)}
    exact = ev.score_runs(qrels, {"exact": run})["exact"]["per_query"]["ndcg@10"]
    assert report["per_query"]["splade"] == pytest.approx(exact, abs=1e-12)
    assert report["results"][0]["bytes_per_doc"] >= 4 * D.shape[1]  # stored dense: exact, not compact


def test_models_loaded_in_parallel_threads_keep_their_tied_heads(splade_model):
    """A server loads its models in threads at once. transformers swaps
    ``PreTrainedModel.tie_weights`` for a no-op while it loads and puts back what it found, so two
    overlapping loads could leave the no-op for good, and every later MLM head (SPLADE's tied
    decoder) loaded as missing: loads hold ``poolers.stack.LOADING``."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import PreTrainedModel

    from embedpool.poolers.splade import _load_head
    from embedpool.poolers.stack import ModelStack

    path = splade_model[0]
    original = PreTrainedModel.tie_weights

    def load(i: int) -> int:
        if i % 2:
            ModelStack.load(path)
            return 0
        return _load_head(path, "tiny")[1]  # refuses a head whose decoder weights are missing

    with ThreadPoolExecutor(3) as pool:
        assert set(pool.map(load, range(6))) == {0, splade_model[1][0].auto_model.config.vocab_size}
    assert PreTrainedModel.tie_weights is original
