"""``per_window=true`` on the single-vector poolers: a document gives one vector per window, each
the plain pooler's vector of that window taken alone (for ``mean``: sentence-transformers' own
output on that window's ids); a query gives one vector, the plain pooler's over all its windows;
specs, configs, workloads and post-processing as for every multi-vector pooler."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import numpy as np
import pytest
import torch

from embedpool.errors import InvalidError
from embedpool.poolers import REGISTRY, TokenStates, build_pooler
from embedpool.poolers.encoder import STANDARD, WINDOWED
from embedpool.poolers.pipeline import postprocess

PLAIN = ["mean", "mean:include_special=false", "cls", "max", "landmark", "fde", "layermean", "maxpoolbert:layers=all"]


def per_window(spec: str) -> str:
    return spec + ("," if ":" in spec else ":") + "per_window=true"


@pytest.fixture(scope="module")
def texts(scifact_docs) -> list[str]:
    """A text of several windows, one of two, one that fits a window, and an empty one."""
    return ["\n\n".join(scifact_docs[:3]), scifact_docs[3], "a short text", ""]


def _window_rows(encoder, text: str, plan, role: str) -> list:
    return encoder.tokenize_each([text], plan, role)[0]


def plain_on_each_window(encoder, spec: str, text: str, role: str = "document") -> torch.Tensor:
    """The plain pooler (``spec`` without per_window) on every window of ``text`` (under the
    per-window pooler's plan), each window encoded as a text of its own: ``[n_windows, D]``."""
    plain = build_pooler(spec)
    rows = _window_rows(encoder, text, build_pooler(per_window(spec)).plan, role)
    out: list = [None] * len(rows)
    for ids, states in encoder.encode([""] * len(rows), plain.plan, role=role, rows=[[r] for r in rows],
                                      all_layers=plain.needs_layers):
        assert states.one_row_per_text
        pooled = plain.pool_role(states, role)
        for j, i in enumerate(ids):
            out[i] = pooled[j]
    return torch.stack(out)


def plain_over_all_windows(encoder, spec: str, text: str, role: str) -> torch.Tensor:
    """The plain pooler on all of ``text``'s windows at once (one batch of token states)."""
    plain = build_pooler(spec)
    plan = build_pooler(per_window(spec)).plan
    states = TokenStates.concat([s for _, s in encoder.encode([text], plan, role=role, all_layers=plain.needs_layers)])
    return plain.pool_role(states, role)[0]


SPECS = [per_window(s) for s in PLAIN] + PLAIN


@contextmanager
def two_windows_a_batch(encoder):
    """A forward budget of two windows: the long text spans three or more batches."""
    old = encoder.max_batch_tokens
    encoder.max_batch_tokens = 2 * encoder.max_length
    try:
        yield
    finally:
        encoder.max_batch_tokens = old


@pytest.fixture(scope="module")
def documents(embedder, texts):
    """Every spec on the texts as documents: at the default budget (the long text's windows in
    one batch) and two windows a batch."""
    whole = embedder.embed(texts, SPECS, role="document", normalize=False)
    with two_windows_a_batch(embedder.encoder):
        split = embedder.embed(texts, SPECS, role="document", normalize=False)
    return whole, split


@pytest.fixture(scope="module")
def queries(embedder, texts):
    """Every spec on each text alone as a query (so that a reference sees the very same token
    states), at the default budget and two windows a batch."""
    out = {}
    for split in (False, True):
        with two_windows_a_batch(embedder.encoder) if split else nullcontext():
            out[split] = [embedder.embed([t], SPECS, role="query", normalize=False) for t in texts]
    return out


# ---------------------------------------------------------------- documents
@pytest.mark.parametrize("spec", PLAIN)
def test_a_document_gives_each_windows_plain_vector(spec, encoder, documents, texts):
    """``[n_windows, D]`` per document, row j the plain pooler's vector of window j taken alone."""
    pw = per_window(spec)
    whole = documents[0]
    assert whole.multi_vector[pw]
    for i, text in enumerate(texts):
        got = whole.vectors[pw][i]
        want = plain_on_each_window(encoder, spec, text).numpy()
        n_windows = len(encoder.windows([text], build_pooler(pw).plan)[0])
        assert got.shape == want.shape == (n_windows, want.shape[1]), (spec, i)
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"{pw} text {i}")
    assert whole.vectors[pw][0].shape[0] >= 4  # the long text really has several windows


@pytest.fixture(scope="module")
def abstracts(embedder, scifact_docs):
    texts = scifact_docs[:12] + ["a short text", ""]
    return texts, embedder.embed(texts, SPECS, role="document", normalize=False)


@pytest.mark.parametrize("spec", PLAIN)
def test_a_text_in_one_window_gives_the_plain_poolers_vector(spec, encoder, abstracts):
    """A text that fits one window: ``[1, D]``, the plain pooler's vector (its own plan: the
    standard one, truncating, for all but landmark). A longer text's first window is the
    standard truncated sequence: its vector is the plain pooler's on the standard plan."""
    pw = per_window(spec)
    texts, out = abstracts
    fits = [len(encoder.windows([t], build_pooler(pw).plan)[0]) == 1 for t in texts]
    assert any(fits) and not all(fits)
    for i, one in enumerate(fits):
        got, plain = out.vectors[pw][i], out.vectors[spec][i]
        if one:
            assert got.shape == (1, plain.shape[0])
            np.testing.assert_allclose(got[0], plain, atol=1e-5, err_msg=f"{pw} text {i}")
        elif build_pooler(spec).plan == STANDARD:
            np.testing.assert_allclose(got[0], plain, atol=1e-5, err_msg=f"{pw} text {i}, window 0")


def test_mean_per_window_reproduces_sentence_transformers_on_each_window(encoder, embedder, st_model, texts):
    """sentence-transformers' own model run on each window's input ids gives each row of
    ``mean:per_window=true`` (normalized, as all-MiniLM-L6-v2's Normalize module does)."""
    got = embedder.embed(texts, ["mean:per_window=true"], role="document").vectors["mean:per_window=true"]
    for i, text in enumerate(texts):
        windows = encoder.windows([text], WINDOWED)[0]
        assert got[i].shape[0] == len(windows)
        for j, w in enumerate(windows):
            ids = torch.tensor([w.ids])
            with torch.inference_mode():
                ref = st_model.forward({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
            ref = ref["sentence_embedding"][0].numpy()
            cos = float(got[i][j] @ ref / (np.linalg.norm(got[i][j]) * np.linalg.norm(ref)))
            assert cos >= 0.99999, (i, j, cos)


@pytest.mark.parametrize("spec", PLAIN)
def test_a_document_over_several_forward_batches_gives_all_its_windows_in_order(spec, encoder, documents, texts):
    """Two windows per forward batch split the long text over three or more batches
    (``continued``); its vectors are the same as with all its windows in one batch."""
    pw = per_window(spec)
    whole, split = documents
    with two_windows_a_batch(encoder):
        batches = [s for _, s in encoder.encode(texts[:1], build_pooler(pw).plan)]
    assert len(batches) >= 3 and batches[0].continued
    for i, text in enumerate(texts):
        assert split.vectors[pw][i].shape == whole.vectors[pw][i].shape
        np.testing.assert_allclose(split.vectors[pw][i], whole.vectors[pw][i], atol=1e-5, err_msg=f"{pw} text {i}")


# ---------------------------------------------------------------- queries
@pytest.mark.parametrize("split", [False, True], ids=["default-budget", "two-windows-a-batch"])
@pytest.mark.parametrize("spec", PLAIN)
def test_a_query_gives_one_vector_the_plain_pooler_over_all_its_windows(spec, split, encoder, queries, texts):
    """``[1, D]`` per query: the plain pooler over every window of it (for fde the query FDE
    of all its tokens), also when its windows span several forward batches. (Merged sums
    differ from sums at once by float32 rounding: the tolerance is relative to the vector.)"""
    pw = per_window(spec)
    for i, text in enumerate(texts):
        got = queries[split][i].vectors[pw][0]
        with two_windows_a_batch(encoder) if split else nullcontext():
            want = plain_over_all_windows(encoder, spec, text, "query").numpy()
        assert got.shape == (1, want.shape[0])
        np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=f"{pw} text {i}")


def test_fde_per_window_query_is_the_query_fde_of_all_tokens_and_documents_differ(embedder, texts):
    pw = "fde:per_window=true"
    q = embedder.embed(texts[:1], [pw, "tokens:window=true"], role="query", normalize=False)
    want = embedder.pooler(pw).encode_sets(q.vectors["tokens:window=true"], "query")
    np.testing.assert_allclose(q.vectors[pw][0], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    d = embedder.embed(texts[:1], [pw], role="document", normalize=False).vectors[pw][0]
    assert d.shape[0] > 1 and not np.allclose(d.mean(0), want[0], atol=1e-3)


# ---------------------------------------------------------------- workload, post-processing
@pytest.mark.parametrize("role", ["document", "query"])
def test_measure_counts_one_vector_per_document_window_and_one_per_query(role, encoder, embedder, texts):
    specs = [per_window(s) for s in PLAIN]
    work = embedder.measure(texts, specs, role=role)
    out = embedder.embed(texts, specs, role=role)
    assert work.vectors == sum(len(v) for s in specs for v in out.vectors[s])
    for spec in specs:
        p = embedder.pooler(spec)
        for text, v in zip(texts, out.vectors[spec]):
            rows = [len(w.ids) for w in encoder.windows([text], p.plan)[0]]
            assert p.n_vectors(rows, role) == len(v) == (1 if role == "query" else len(rows))


def test_normalization_and_matryoshka_dimensions_apply_per_row(embedder, texts):
    """Each row post-processed on its own: cut to ``dimensions`` then L2-normalized; an fde is
    normalized but never cut."""
    specs = ["mean:per_window=true", "max:per_window=true", "fde:per_window=true"]
    raw = embedder.embed(texts, specs, role="document", normalize=False).vectors
    cut = embedder.embed(texts, specs, role="document", dimensions=64).vectors
    for spec in specs:
        dims = None if spec.startswith("fde") else 64
        for r, c in zip(raw[spec], cut[spec]):
            want = r[:, :dims] / np.linalg.norm(r[:, :dims], axis=1, keepdims=True)
            assert c.shape == want.shape
            np.testing.assert_allclose(c, want, atol=1e-6)
            np.testing.assert_allclose(postprocess(torch.from_numpy(r), True, dims).numpy(), c, atol=1e-6)
    assert cut["fde:per_window=true"][0].shape[1] == embedder.output_dim("fde:per_window=true", 64)


# ---------------------------------------------------------------- specs and configs
def test_specs_round_trip_and_existing_specs_are_unchanged():
    assert build_pooler("mean").spec == "mean"
    assert build_pooler("mean:per_window=false").spec == "mean"
    assert build_pooler("mean:per_window=true").spec == "mean:per_window=true"
    assert build_pooler("fde").spec == "fde:k_sim=4,dim_proj=64,reps=10,seed=42,final_dim=0,window=false"
    assert build_pooler("fde:per_window=false").spec == build_pooler("fde").spec
    canonical = "fde:k_sim=4,dim_proj=64,reps=10,seed=42,final_dim=0,window=true,per_window=true"
    assert build_pooler("fde:per_window=true").spec == build_pooler("fde:window=true,per_window=true").spec == canonical
    for spec in PLAIN:
        plain, pw = build_pooler(spec), build_pooler(per_window(spec))
        for p in (plain, pw):
            assert build_pooler(p.spec).spec == p.spec and build_pooler(p.spec).get_config_dict() == p.get_config_dict()
        assert plain.multi_vector is False and plain.role_aware is (plain.name == "fde")
        assert pw.multi_vector is True and pw.role_aware is True
        assert pw.plan == (plain.plan if plain.name == "landmark" else WINDOWED)
    assert build_pooler("landmark:g=8,per_window=true").plan.kind == "landmark"
    for name in ("mean", "cls", "max", "landmark", "fde"):
        assert REGISTRY[name].multi_vector is None  # decided per instance
    for spec in ("tokens:per_window=true", "cluster:per_window=true", "attention:per_window=true"):
        with pytest.raises(InvalidError, match="no option 'per_window'"):
            build_pooler(spec)
    with pytest.raises(InvalidError, match="not a valid bool"):
        build_pooler("mean:per_window=maybe")


@pytest.mark.parametrize("spec", ["mean:per_window=true", "fde:k_sim=2,dim_proj=8,reps=3,per_window=true",
                                  "landmark:g=7,per_window=true"])
def test_a_per_window_pooler_saves_and_loads_its_config(spec, tmp_path, embedder, texts):
    p = build_pooler(spec)
    folder = p.save(tmp_path / p.name)
    again = type(p).load(folder)
    assert again.get_config_dict() == p.get_config_dict() and again.get_config_dict()["per_window"] is True
    assert again.spec == p.spec and again.plan == p.plan and again.multi_vector is True
    for role in ("document", "query"):
        states = [s for _, s in embedder.encoder.encode(texts, p.plan, role=role, all_layers=p.needs_layers)]
        for s in states:
            for a, b in zip(again.pool_role(s, role), p.pool_role(s, role)):
                torch.testing.assert_close(a, b, atol=0, rtol=0)
