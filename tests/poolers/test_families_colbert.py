"""ColBERT-family models at parity with PyLate: a tiny BERT wrapped and saved by PyLate itself
(in PyLate's own venv, ``make pylate``: it pins sentence-transformers < 6), loaded by embedpool
from the folder. ``tokens`` (and ``auto``) must be PyLate's ``encode(is_query=...)`` token by token
-- the [Q]/[D] prefixes, query expansion with [MASK] up to ``query_length`` (not attended), the
document skiplist and ``document_length``, the per-token Dense projection, normalization -- and
``cluster`` PyLate's ``pool_embeddings_hierarchical`` of those vectors."""

from __future__ import annotations

import numpy as np
import pytest

from embedpool.errors import InvalidError
from embedpool.poolers import Embedder, FrozenEncoder
from embedpool.poolers.encoder import WINDOWED
from family_models import COLBERT, DOCUMENTS, QUERIES


@pytest.fixture(scope="module")
def colbert(colbert_reference):
    return colbert_reference, Embedder(FrozenEncoder(str(colbert_reference["path"]), precision="fp32"))


def _same_tokens(ours: list[np.ndarray], theirs: list[np.ndarray]) -> None:
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape, (i, a.shape, b.shape)
        cos = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
        assert cos.min() >= 0.99999, (i, cos)


@pytest.mark.parametrize("spec", ["tokens", "auto"])
def test_tokens_equal_pylate_encode(colbert, spec):
    ref, emb = colbert
    _same_tokens(emb.embed(QUERIES, [spec], role="query").vectors[spec], ref["queries"])
    _same_tokens(emb.embed(DOCUMENTS, [spec], role="document").vectors[spec], ref["documents"])


def test_pylate_layout_is_what_the_texts_exercise(colbert):
    """Queries are padded (expanded) to query_length, long documents cut at document_length and
    punctuation skipped: the parity above is not on a degenerate case."""
    ref, emb = colbert
    assert {len(q) for q in ref["queries"]} == {COLBERT["query_length"]}
    doc_rows = emb.encoder.tokenize(DOCUMENTS, role="document")
    assert max(len(r.ids) for r in doc_rows) == COLBERT["document_length"]
    assert any(len(v) < len(r.ids) for v, r in zip(ref["documents"], doc_rows))  # skiplist at work
    query_rows = emb.encoder.tokenize(QUERIES, role="query")
    assert all(r.expansion is not None and r.expansion.sum() > 0 for r in query_rows[:2])


def test_cluster_equals_pylate_token_pooling(colbert):
    ref, emb = colbert
    spec = "cluster:pool_factor=2"
    ours = emb.embed(DOCUMENTS, [spec], role="document", normalize=False).vectors[spec]
    for i, (a, b) in enumerate(zip(ours, ref["pooled"][2])):
        assert a.shape == b.shape, (i, a.shape, b.shape)
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=f"document {i}")


def test_colbert_dimensions_and_poolers(colbert):
    _, emb = colbert
    assert emb.canonical("auto") == "tokens"
    assert emb.dim == emb.output_dim("tokens") == emb.output_dim("mean") == COLBERT["embedding_size"]
    # a single vector pools the model's own (projected) token vectors
    mean = emb.embed(DOCUMENTS[:2], ["mean"]).matrix("mean")
    assert mean.shape == (2, COLBERT["embedding_size"])
    with pytest.raises(InvalidError, match="ColBERT"):
        emb.embed(["x"], ["layermean"])


def test_a_hub_id_in_the_local_cache_loads_as_colbert(colbert_reference, tmp_path):
    """A PyLate model known by its Hugging Face id, present only in the local cache (the hub's
    layout: models--ORG--NAME/snapshots/REV + refs/main), loads as a ColBERT model, offline."""
    import shutil
    import subprocess
    import sys

    repo = tmp_path / "hub" / "models--someone--tiny-colbert"
    shutil.copytree(colbert_reference["path"], repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    code = ("from embedpool.poolers import Embedder, FrozenEncoder\n"
            "e = Embedder(FrozenEncoder('someone/tiny-colbert', precision='fp32'))\n"
            "v = e.embed(['what reduces stroke risk?'], ['auto'], role='query').vectors['auto'][0]\n"
            "print(e.canonical('auto'), e.encoder.multi_vector, v.shape[0], v.shape[1])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "HF_HUB_CACHE": str(tmp_path / "hub"),
                              "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["tokens", "True", str(COLBERT["query_length"]), str(COLBERT["embedding_size"])]


def test_every_window_of_a_long_document_opens_with_the_document_marker(colbert):
    """tokens:window=true keeps every window of a long document, each [CLS] [D] ... [SEP] as the
    model was trained on; the first window's vectors are PyLate's (its document_length cut)."""
    ref, emb = colbert
    enc = emb.encoder
    marker = enc.tokenizer("[D] ", add_special_tokens=False)["input_ids"]
    assert len(marker) == 1
    long_docs = [d for d, v in zip(DOCUMENTS, ref["documents"]) if len(v) and len(
        enc.tokenizer(d)["input_ids"]) > COLBERT["document_length"]]
    assert long_docs
    windows = enc.windows(long_docs, WINDOWED, role="document")
    for doc_windows in windows:
        assert len(doc_windows) > 1
        for w in doc_windows:
            assert w.ids[:2] == [enc.tokenizer.cls_token_id, marker[0]] and w.ids[-1] == enc.tokenizer.sep_token_id
            assert len(w.ids) <= COLBERT["document_length"]
    got = emb.embed(long_docs, ["tokens:window=true"], role="document").vectors["tokens:window=true"]
    truncated = emb.embed(long_docs, ["tokens"], role="document").vectors["tokens"]
    for g, t in zip(got, truncated):
        assert len(g) > len(t)
        np.testing.assert_allclose(g[: len(t)], t, atol=1e-5)
