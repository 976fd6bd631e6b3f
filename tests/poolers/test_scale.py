"""Long inputs: a text's windows over several forward batches, linear memory, and the workload
(tokens, vectors) known before the forward pass."""

from __future__ import annotations

import sys
from pathlib import Path

import memory_testutil
import numpy as np
import pytest
from memory_testutil import watched

from embedpool.errors import InvalidError
from embedpool.poolers import EmbedOptions, TokenStates, build_pooler
from embedpool.poolers.encoder import WINDOWED, Plan

ALL = ["mean", "max", "cls", "landmark", "landmark:g=8", "tokens:window=true",
       "cluster:pool_factor=3,window=true", "mean:include_special=false", "fde:window=true"]


@pytest.fixture(scope="module")
def long_text(scifact_docs) -> str:
    return "\n\n".join(scifact_docs[:14])  # ~4,000 tokens: 16 windows, 2+ forward batches


@pytest.mark.parametrize("role", ["document", "query"])
def test_windows_over_several_batches_equal_one_batch(role, encoder, embedder, long_text, scifact_docs):
    """A text whose windows do not fit one forward batch is forwarded in budget-sized batches
    and its parts merged: the same vectors as with all its windows in one batch (in both roles:
    cluster and fde treat queries differently)."""
    texts = [scifact_docs[40], long_text, "short", ""]
    specs = [s for s in ALL if build_pooler(s).plan.kind != "standard"
             and (role == "document" or build_pooler(s).role_aware)]  # queries differ only for these
    calls = encoder.stats.forward_calls
    split = embedder.embed(texts, specs, role=role)
    n_split = encoder.stats.forward_calls - calls
    old = encoder.max_batch_tokens
    try:
        encoder.max_batch_tokens = 1 << 16
        calls = encoder.stats.forward_calls
        whole = embedder.embed(texts, specs, role=role)
        n_whole = encoder.stats.forward_calls - calls
    finally:
        encoder.max_batch_tokens = old
    assert n_split > n_whole
    for spec in specs:
        for i in range(len(texts)):
            a, b = split.vectors[spec][i], whole.vectors[spec][i]
            assert a.shape == b.shape, (spec, i)
            np.testing.assert_allclose(a, b, atol=1e-5, err_msg=f"{spec} text {i}")


def test_no_forward_batch_over_the_budget(encoder, long_text):
    for plan in (WINDOWED, Plan("landmark", 32)):
        batches = list(encoder.encode([long_text, "x", long_text[:3000]], plan))
        assert all(s.attention_mask.numel() <= encoder.max_batch_tokens for _, s in batches), plan
        continued = [s.continued for _, s in batches]
        assert any(continued) and not continued[-1]
        for (ids, s), nxt in zip(batches, batches[1:]):
            if s.continued:  # a split text is alone, and its next part follows at once
                assert s.n_texts == 1 and nxt[0] == ids


@pytest.mark.parametrize("spec", ALL)
def test_merged_parts_equal_pooling_all_windows_at_once(spec, encoder, long_text):
    """Every pooler's ``merge`` of per-batch parts equals its ``pool`` on all the text's windows
    in one batch of token states (mean, max and cls included, for any windowing plan)."""
    pooler = build_pooler(spec)
    plan = pooler.plan if pooler.plan.kind != "standard" else WINDOWED
    batches = [s for _, s in encoder.encode([long_text], plan)]
    assert len(batches) >= 2
    parts = [pooler.part(s, pooler.pool(s)) for s in batches]
    merged = pooler.merge(parts)
    whole = pooler.pool(TokenStates.concat(batches))[0]
    assert merged.shape == whole.shape
    np.testing.assert_allclose(merged.numpy(), whole.numpy(), atol=1e-5)


@pytest.mark.parametrize("role", ["document", "query"])
def test_measure_counts_what_embed_runs_and_returns(role, encoder, embedder, long_text):
    long_text = long_text[:6000]  # ~1,300 tokens: several windows, one forward batch per plan
    texts = [long_text, "a short one", "", "word " * 300]
    specs = ["mean", "tokens", "tokens:window=true", "cluster:pool_factor=3,window=true", "cluster",
             "landmark", "attention:queries=3", "cluster:pool_queries=true,window=true"]
    work = embedder.measure(texts, specs, role=role)
    out = embedder.embed(texts, specs, role=role)
    assert sum(work.tokens) == out.tokens
    got = sum(len(v) if out.multi_vector[s] else 1 for s in specs for v in out.vectors[s])
    assert work.vectors == got
    # per text: the long one takes every window of the windowed and landmark plans
    alone = embedder.measure([long_text], specs, role=role)
    assert alone.tokens[0] == work.tokens[0] > 3 * encoder.max_length
    assert embedder.measure([], specs, role=role).vectors == 0
    with pytest.raises(ValueError, match="over the model's limit"):
        embedder.measure(["word " * 400], ["mean"], truncate=False)


@pytest.mark.parametrize("role", ["document", "query"])
def test_work_bound_holds_without_tokenizing(role, embedder, long_text):
    """``work_bound`` bounds what ``measure`` counts, for any texts (here: over the window, empty,
    short), whenever it gives a bound; it gives none where a text's cost is not bounded by
    its count (windowing plans, multi-vector poolers, inputs not truncated)."""
    texts = [long_text[:6000], "", "a short one", "ünïcödé ☃ " * 200]
    for specs, options in ((["mean"], {}), (["mean", "cls", "max"], {}), (["mean"], {"truncation_direction": "left"})):
        bound = embedder.work_bound(len(texts), specs, EmbedOptions(role=role, **options))
        work = embedder.measure(texts, specs, role=role, **options)
        assert bound is not None and sum(work.tokens) <= bound[0] and work.vectors <= bound[1], specs
        assert bound[1] == len(texts) * len(specs)
    for specs, options in ((["mean:per_window=true"], {}), (["landmark"], {}), (["tokens"], {}), (["mean", "cluster"], {}),
                           (["mean"], {"truncate": False})):
        assert embedder.work_bound(len(texts), specs, EmbedOptions(role=role, **options)) is None, specs


@pytest.mark.parametrize("role", ["document", "query"])
def test_embed_reuses_what_measure_tokenized(role, encoder, embedder, long_text, monkeypatch):
    """``embed(tokenized=measure(...).tokenized)`` tokenizes nothing and returns what a plain
    ``embed`` returns, for every plan (also for a slice of the texts and lists joined, as the
    server's batcher passes them); ``counts`` is each input's length as the tokenizer itself
    gives it (specials included, cut at the window), whichever plans the poolers need."""
    texts = [long_text[:6000], "a short one", "", "word " * 300]
    specs = ["mean", "tokens:window=true", "landmark", "cluster:pool_factor=3,window=true"]
    want = embedder.embed(texts, specs, role=role)
    work = embedder.measure(texts, specs, role=role)
    reference = [len(ids) for ids in encoder.tokenizer(texts, truncation=True, max_length=encoder.max_length)["input_ids"]]
    assert work.counts == reference  # the standard plan's rows
    assert embedder.measure(texts, ["tokens:window=true", "landmark"], role=role).counts == reference  # derived
    order = [2, 3, 0, 1]  # slices of two measured calls, joined: what the batcher hands over
    joined = (embedder.measure([texts[i] for i in order[:2]], specs, role=role).tokenized
              + embedder.measure([texts[i] for i in order[2:]], specs, role=role).tokenized)
    calls = []
    real = encoder.tokenize
    monkeypatch.setattr(encoder, "tokenize", lambda *a, **k: calls.append(a) or real(*a, **k))
    got = embedder.embed(texts, specs, role=role, tokenized=work.tokenized)
    got_joined = embedder.embed([texts[i] for i in order], specs, role=role, tokenized=joined)
    assert calls == []
    # rows made with other options are refused, not silently tokenized again
    with pytest.raises(InvalidError, match="made with the options"):
        embedder.embed(texts, ["mean"], role="query" if role == "document" else "document", tokenized=work.tokenized)
    with pytest.raises(InvalidError, match="4 texts' rows for 3 texts"):
        embedder.embed(texts[:3], ["mean"], role=role, tokenized=work.tokenized)
    assert calls == []
    assert got.tokens == want.tokens == got_joined.tokens
    for spec in specs:
        for i, (a, b) in enumerate(zip(got.vectors[spec], want.vectors[spec])):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_allclose(got_joined.vectors[spec][order.index(i)], b, atol=1e-5)


def test_20k_token_document_clusters_in_bounded_memory(encoder, scifact_docs, tmp_path):
    """``cluster:pool_factor=4,window=true`` on a 20,000-token document of SciFact abstracts,
    in a subprocess: the pooling step alone (all 80 windows' token states in one batch) and
    the whole ``embed`` (forward included) each grow the RSS by less than 300 MB, measured as
    the kernel's RSS high-water mark over the RSS before the step (every allocator counted:
    torch's, numpy's, scipy's). Whole-text clustering needs ~20,000² × 12 bytes ≈ 4.8 GB."""
    text = "\n\n".join(scifact_docs)
    offsets = encoder.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True,
                                verbose=False)["offset_mapping"]
    document = tmp_path / "document.txt"
    document.write_text(text[:offsets[20_000 - 1][1]], encoding="utf-8")
    # a fixed mmap threshold: freed blocks go back to the system at once, so memory the process
    # held before the step cannot hide the step's own allocations
    env = {"MALLOC_MMAP_THRESHOLD_": "131072"}
    out, killed = watched([sys.executable, str(Path(memory_testutil.__file__)), "--pooler",
                           "cluster:pool_factor=4,window=true", "--document", str(document)],
                          env, limit_bytes=3 << 30)
    assert killed is None, killed
    pool, embed = out["pool"], out["embed"]
    assert out["encoded_tokens"] >= 20_000 and pool["rows"] >= 20_000 // 254
    assert pool["step_rss_growth_mb"] < 300, pool
    assert embed["step_rss_growth_mb"] < 300, embed
    # about n / 4 vectors per window, as many as measure() predicted
    assert pool["vectors"] == embed["vectors"] == out["expected_vectors"]
    assert 20_000 / 4 < pool["vectors"] < 20_000 / 4 + 2 * pool["rows"]
    # the forward ran in budget-sized batches: at most 2048 / 256 = 8 windows per call
    assert embed["forward_calls"] >= pool["rows"] // 8
