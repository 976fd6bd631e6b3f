"""The poolers against sentence-transformers' own implementations, on the real default model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.multi_vector_encoder.modules.token_pooling import HierarchicalTokenPooling
from sentence_transformers.sentence_transformer.modules import Pooling


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=-1, keepdims=True)
    b = b / np.linalg.norm(b, axis=-1, keepdims=True)
    return (a * b).sum(-1)


@pytest.mark.parametrize("mode", ["mean", "cls", "max"])
def test_single_vector_poolers_match_sentence_transformers(mode, embedder, st_model, varied_texts):
    assert len(varied_texts) >= 100
    reference = SentenceTransformer(modules=[st_model[0], Pooling(384, pooling_mode=mode)], device="cpu")
    ref = reference.encode(varied_texts, batch_size=16, convert_to_numpy=True, normalize_embeddings=False)
    ours = embedder.embed(varied_texts, [mode], normalize=False).matrix(mode)
    assert ours.shape == ref.shape
    cos = _cos(ours, ref)
    assert cos.min() >= 0.99999, (mode, float(cos.min()), varied_texts[int(cos.argmin())][:80])
    # and not only the direction: the unnormalized vectors agree too
    np.testing.assert_allclose(ours, ref, atol=2e-4)


def test_default_pooling_matches_encode(embedder, st_model, varied_texts):
    """`auto` on the default model is mean + normalize: exactly what encode() returns."""
    ref = st_model.encode(varied_texts, batch_size=16)
    ours = embedder.embed(varied_texts, ["auto"]).matrix("auto")
    assert _cos(ours, ref).min() >= 0.99999


def test_cluster_matches_hierarchical_token_pooling(embedder, st_model, scifact_docs):
    texts = scifact_docs[:12] + ["short one", "", "a b c d e f g h"]
    tokens = st_model.encode(texts, output_value="token_embeddings", batch_size=8)
    normed = [torch.nn.functional.normalize(t.float(), dim=-1) for t in tokens]
    for pf in (2, 3):
        ref = HierarchicalTokenPooling(pool_factor=pf, num_protected_tokens=1,
                                       normalize_embeddings=True).pool(normed)
        spec = f"cluster:pool_factor={pf}"
        ours = embedder.embed(texts, [spec]).vectors[spec]
        for i, (o, r) in enumerate(zip(ours, ref)):
            assert o.shape == tuple(r.shape), (pf, i)
            np.testing.assert_allclose(o, r.numpy(), atol=1e-4, err_msg=f"pf={pf} text {i}")
        lengths = [len(t) for t in tokens]
        # max(n // pool_factor, 1) clusters after the protected [CLS]
        assert [len(o) for o in ours] == [min(n, 1 + max((n - 1) // pf, 1)) for n in lengths]


def test_cluster_without_normalize_matches_plain_means(embedder, st_model):
    texts = ["the cat sat on the mat while the dog slept by the fire"]
    tokens = st_model.encode(texts, output_value="token_embeddings")
    normed = [torch.nn.functional.normalize(t.float(), dim=-1) for t in tokens]
    ref = HierarchicalTokenPooling(pool_factor=2, normalize_embeddings=False).pool(normed)
    ours = embedder.embed(texts, ["cluster"], normalize=False).vectors["cluster"]
    np.testing.assert_allclose(ours[0], ref[0].numpy(), atol=1e-5)


def test_cluster_leaves_queries_unpooled_unless_asked(embedder, st_model):
    """PyLate's convention: token pooling compresses documents; a query keeps every token."""
    texts = ["which proteins bind the promoter of the gene in yeast cells under stress"]
    tokens = st_model.encode(texts, output_value="token_embeddings")
    normed = [torch.nn.functional.normalize(t.float(), dim=-1) for t in tokens]
    q = embedder.embed(texts, ["cluster", "tokens"], role="query")
    np.testing.assert_allclose(q.vectors["cluster"][0], normed[0].numpy(), atol=1e-5)
    np.testing.assert_array_equal(q.vectors["cluster"][0], q.vectors["tokens"][0])
    ref = HierarchicalTokenPooling(pool_factor=2, num_protected_tokens=1, normalize_embeddings=True).pool(normed)
    spec = "cluster:pool_queries=true"
    pooled = embedder.embed(texts, [spec], role="query").vectors[spec]
    np.testing.assert_allclose(pooled[0], ref[0].numpy(), atol=1e-4)
    assert len(pooled[0]) < len(normed[0])


def test_tokens_are_normalized_token_states(embedder, st_model):
    texts = ["late interaction keeps every token", "x"]
    tokens = st_model.encode(texts, output_value="token_embeddings")
    ours = embedder.embed(texts, ["tokens"], normalize=False).vectors["tokens"]
    for o, t in zip(ours, tokens):
        np.testing.assert_allclose(o, torch.nn.functional.normalize(t, dim=-1).numpy(), atol=1e-5)


@pytest.mark.parametrize("pf", [2, 4])
def test_windowed_cluster_is_hierarchical_token_pooling_per_window(pf, encoder, embedder, st_model, scifact_docs):
    """cluster:window=true on a long text = HierarchicalTokenPooling of every window on its own
    (sentence-transformers' transformer run on that window), concatenated in window order; the
    text's windows span several forward batches. A text that fits one window is unchanged."""
    from embedpool.poolers.encoder import WINDOWED

    long_text = " ".join(scifact_docs[:12])
    rows = encoder.windows([long_text], WINDOWED)[0]
    assert len(rows) * encoder.max_length > 2 * encoder.max_batch_tokens  # 3+ forward batches
    bert = st_model[0].auto_model
    windows = []
    for row in rows:
        ids = torch.tensor([row.ids])
        with torch.inference_mode():
            h = bert(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
        windows.append(torch.nn.functional.normalize(h.float(), dim=-1))
    htp = HierarchicalTokenPooling(pool_factor=pf, num_protected_tokens=1, normalize_embeddings=True)
    ref = torch.cat(htp.pool(windows)).numpy()
    short = scifact_docs[20][:300]
    spec = f"cluster:pool_factor={pf},window=true"
    out = embedder.embed([long_text, short], [spec, f"cluster:pool_factor={pf}"])
    got = out.vectors[spec][0]
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, atol=1e-4)
    # about n / pool_factor vectors per window, each window keeping its [CLS]
    assert len(got) == sum(1 + max((len(r.ids) - 1) // pf, 1) for r in rows)
    short_ref = htp.pool([windows_of(st_model, short)])[0].numpy()
    np.testing.assert_allclose(out.vectors[spec][1], short_ref, atol=1e-4)
    np.testing.assert_allclose(out.vectors[spec][1], out.vectors[f"cluster:pool_factor={pf}"][1], atol=1e-5)


def windows_of(st_model, text: str) -> torch.Tensor:
    """sentence-transformers' normalized token states of a text that fits one window."""
    tokens = st_model.encode([text], output_value="token_embeddings")[0]
    return torch.nn.functional.normalize(tokens.float(), dim=-1)
