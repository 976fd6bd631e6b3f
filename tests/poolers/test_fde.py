"""The MUVERA FDE pooler against the paper's definition (a literal per-partition reading in
fde_reference.py), its query/document asymmetry, seeds, and its agreement with exact MaxSim on
real MiniLM token states of SciFact."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from fde_reference import fde_literal, phi  # noqa: E402  (tests/poolers is on sys.path)
from scipy.stats import spearmanr

from embedpool.errors import InvalidError
from embedpool.poolers import TokenStates, build_pooler
from embedpool.poolers.encoder import WINDOWED
from embedpool.poolers.fde import FDE


def _matrices(f: FDE):
    """The encoder's random draws in the literal reading's shapes."""
    k, dp = f.k_sim, f.dim_proj
    gs = [f.hyperplanes[:, r * k:(r + 1) * k].T.astype(np.float64) for r in range(f.reps)]
    if f.projections is None:
        ss = [np.eye(f.dim) * np.sqrt(f.dim)] * f.reps  # psi = identity
    else:
        ss = [f.projections[r].T.astype(np.float64) * np.sqrt(dp) for r in range(f.reps)]
    return gs, ss


def test_fde_equals_the_papers_definition():
    """Random small cases, several texts per batch, projected and unprojected, both roles:
    every component as the literal reading computes it (including which vector fills an
    empty document partition)."""
    rng = np.random.default_rng(0)
    for trial in range(120):
        dim = int(rng.integers(3, 9))
        f = FDE(dim, int(rng.integers(1, 4)), int(rng.integers(1, dim + 1)), int(rng.integers(1, 4)), trial)
        sets = [rng.standard_normal((int(rng.integers(1, 9)), dim)).astype(np.float32)
                for _ in range(int(rng.integers(1, 4)))]
        gs, ss = _matrices(f)
        for role in ("query", "document"):
            got = f.encode(sets, role)
            assert got.shape == (len(sets), f.reps * 2 ** f.k_sim * f.dim_proj)
            for s, g in zip(sets, got):
                np.testing.assert_allclose(g, fde_literal(s.astype(np.float64), role, gs, ss), atol=1e-5)


def test_query_sums_document_averages_and_fills():
    """The asymmetry: a query block is the sum of its partition's vectors (empty partitions stay
    zero), a document block their mean, and no document block is empty."""
    rng = np.random.default_rng(1)
    f = FDE(16, 3, 16, 2, seed=3)  # no projection: blocks are the raw sums / means
    x = rng.standard_normal((5, 16)).astype(np.float32)
    q, d = f.encode([x], "query")[0].reshape(2, 8, 16), f.encode([x], "document")[0].reshape(2, 8, 16)
    parts = f.partition(x)
    for r in range(2):
        for b in range(8):
            members = x[parts[:, r] == b]
            if len(members):
                np.testing.assert_allclose(q[r, b], members.sum(0), atol=1e-5)
                np.testing.assert_allclose(d[r, b], members.mean(0), atol=1e-5)
            else:
                assert not q[r, b].any()
                assert any(np.allclose(d[r, b], v) for v in x)  # filled with one of the vectors
    # so doubling every vector's multiplicity doubles a query's FDE and leaves a document's
    x2 = np.concatenate([x, x])
    np.testing.assert_allclose(f.encode([x2], "query")[0], 2 * f.encode([x], "query")[0], atol=1e-5)
    np.testing.assert_allclose(f.encode([x2], "document")[0], f.encode([x], "document")[0], atol=1e-5)


def test_empty_partition_takes_the_nearest_vector_by_hamming_distance():
    """One hyperplane pattern fixed by hand: a document whose vectors fall in partitions 0b000
    and 0b011 fills 0b001 with the earliest vector at distance 1 (the first one), and 0b111
    with the vector of 0b011 (distance 1, while 0b000 is at 3)."""
    f = FDE(3, 3, 3, 1, seed=0)
    f.hyperplanes = np.eye(3, dtype=np.float32)  # partition bit i = sign of coordinate i
    x = np.array([[-1, -1, -1], [1, 1, -1]], np.float32)  # partitions 0b000, 0b011
    assert [phi(np.eye(3), v) for v in x] == [0, 3]
    d = f.encode([x], "document")[0].reshape(8, 3)
    np.testing.assert_array_equal(d[0b001], x[0])  # distance 1 to both: the earlier vector
    np.testing.assert_array_equal(d[0b111], x[1])
    np.testing.assert_array_equal(d[0b100], x[0])  # distance 1 to 0b000, 3 to 0b011


def test_fixed_seed_gives_identical_fdes_and_the_seed_matters():
    rng = np.random.default_rng(2)
    sets = [rng.standard_normal((n, 384)).astype(np.float32) for n in (3, 40, 200)]
    a, b = build_pooler("fde"), build_pooler("fde")
    for role in ("query", "document"):
        np.testing.assert_array_equal(a.encode_sets(sets, role), b.encode_sets(sets, role))
    other = build_pooler("fde:seed=7").encode_sets(sets, "document")
    assert not np.allclose(other, a.encode_sets(sets, "document"))


def test_spec_records_every_parameter_and_bad_options_are_refused():
    p = build_pooler("fde")
    assert p.spec == (f"fde:k_sim={p.k_sim},dim_proj={p.dim_proj},reps={p.reps},seed={p.seed},"
                      f"final_dim=0,window=false")
    assert build_pooler(p.spec).spec == p.spec  # the manifest's spec rebuilds the same pooler
    assert p.output_dim(384) == p.reps * 2 ** p.k_sim * p.dim_proj and not p.multi_vector
    assert build_pooler("fde:final_dim=256").output_dim(384) == 256
    for bad, msg in (("fde:k_sim=0", "k_sim"), ("fde:reps=0", "reps"), ("fde:k_sim=10,reps=100", "at most"),
                     ("fde:final_dim=-1", "final_dim")):
        with pytest.raises(ValueError, match=msg):
            build_pooler(bad)
    with pytest.raises(InvalidError, match="valid options"):
        build_pooler("fde:bits=3")
    with pytest.raises(ValueError, match="dim_proj"):
        build_pooler("fde:dim_proj=999").encode_sets([np.ones((2, 384), np.float32)], "query")


def test_final_projection_is_a_scaled_random_sign_matrix():
    rng = np.random.default_rng(4)
    f = FDE(32, 2, 8, 3, seed=5, final_dim=64)
    assert f.final.shape == (96, 64) and set(np.unique(np.abs(f.final) * 8)) == {1.0}
    x = [rng.standard_normal((6, 32)).astype(np.float32)]
    raw = FDE(32, 2, 8, 3, seed=5).encode(x, "document")
    np.testing.assert_allclose(f.encode(x, "document"), raw @ f.final, rtol=1e-5, atol=1e-5)


def test_cost_is_linear_in_the_number_of_tokens():
    """A 40,000-vector document: FDE time grows about linearly from 5,000 vectors (8x the vectors:
    well under the 64x of a quadratic cost; the bound is their geometric middle, since the larger
    input also leaves the caches -- 4x the vectors once measured 8.2x), and the result is still the
    definition's (the fill needs no token pairs)."""
    rng = np.random.default_rng(5)
    f = build_pooler("fde").encoder(384)
    big = rng.standard_normal((40_000, 384)).astype(np.float32)
    small = big[:5_000]

    def best(x):
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            f.encode([x], "document")
            ts.append(time.perf_counter() - t)
        return min(ts)

    assert best(big) < 22 * best(small)
    tiny = FDE(384, 2, 4, 1, seed=1)
    gs, ss = _matrices(tiny)
    np.testing.assert_allclose(tiny.encode([big[:3000]], "document")[0],
                               fde_literal(big[:3000].astype(np.float64), "document", gs, ss), atol=1e-4)


# ------------------------------------------------------------------ real token states
@pytest.fixture(scope="module")
def scifact_slice(data_dir):
    """24 test queries, their relevant abstracts and other abstracts up to 96 documents."""
    sf = data_dir / "scifact"
    qrels: dict[str, set[str]] = {}
    for line in list(open(sf / "qrels" / "test.tsv"))[1:]:
        q, d, s = line.split("\t")
        if int(s) > 0:
            qrels.setdefault(q, set()).add(d)
    queries = {}
    for line in open(sf / "queries.jsonl"):
        o = json.loads(line)
        if o["_id"] in qrels and len(queries) < 24:
            queries[o["_id"]] = o["text"]
    want = set().union(*(qrels[q] for q in queries))
    docs = {}
    for line in open(sf / "corpus.jsonl"):
        o = json.loads(line)
        if o["_id"] in want or len(docs) < 96 - len(want):
            docs[o["_id"]] = (o["title"] + " " + o["text"]).strip()
    return list(queries.values()), list(docs.values())


def test_fde_inner_product_tracks_maxsim_on_real_token_states(embedder, scifact_slice):
    """Spearman of <FDE(q), FDE(d)> with exact MaxSim over the (query, document) pairs of the slice,
    per query (the ranking a candidate generator must preserve; pooled over all queries it is
    lower, ~0.63 in bench/index.py --fde, as MaxSim and FDE scale differently with the query),
    at the default parameters; document FDEs as the pipeline makes them (L2-normalized)."""
    queries, docs = scifact_slice
    qr = embedder.embed(queries, ["tokens", "fde"], role="query")
    dr = embedder.embed(docs, ["tokens", "fde"], role="document")
    maxsim = np.array([[(q @ d.T).max(1).sum() for d in dr.vectors["tokens"]] for q in qr.vectors["tokens"]])
    approx = qr.matrix("fde") @ dr.matrix("fde").T
    per_query = [spearmanr(m, a).statistic for m, a in zip(maxsim, approx)]
    assert np.mean(per_query) >= 0.8, np.round(per_query, 3)
    # the FDE pooler of the token states equals the encoding of the tokens pooler's vectors
    ref = embedder.pooler("fde").encode_sets(dr.vectors["tokens"][:4], "document")
    np.testing.assert_allclose(dr.matrix("fde")[:4], ref / np.linalg.norm(ref, axis=1, keepdims=True), atol=1e-5)


def test_window_true_encodes_every_window_of_a_long_input(embedder):
    words = " ".join(f"w{i % 97} alpha" for i in range(1100))  # ~3,000 tokens
    r = embedder.embed([words], ["tokens:window=true", "fde:window=true", "fde"], normalize=False)
    ref = embedder.pooler("fde:window=true").encode_sets(r.vectors["tokens:window=true"], "document")
    np.testing.assert_allclose(r.vectors["fde:window=true"][0], ref[0], atol=1e-5)
    assert not np.allclose(r.vectors["fde:window=true"][0], r.vectors["fde"][0], atol=1e-3)  # not truncated


# ------------------------------------------------------------------ a text over several batches
def _states(x: np.ndarray) -> TokenStates:
    """Token states of one row holding the vectors ``x`` (what a forward batch hands over)."""
    n = len(x)
    return TokenStates(hidden=torch.from_numpy(x)[None], attention_mask=torch.ones(1, n, dtype=torch.long),
                       special_tokens_mask=torch.zeros(1, n, dtype=torch.long), text_index=torch.tensor([0]),
                       n_texts=1, continued=True)


def test_parts_are_bounded_and_their_merge_is_the_papers_fde_of_all_vectors():
    """Random texts cut at random points into parts (few partitions, few vectors per part: a
    partition is often first occupied in a later part, and empty ones tie in Hamming distance):
    the merge of the parts equals the FDE of all the vectors at once and the literal reading
    of the paper, in both roles; a part's size does not grow with the vectors it holds."""
    rng = np.random.default_rng(7)
    for trial in range(60):
        dim = int(rng.integers(3, 7))
        p = build_pooler(f"fde:k_sim={int(rng.integers(1, 4))},dim_proj={int(rng.integers(1, dim + 1))},"
                         f"reps={int(rng.integers(1, 4))},seed={trial},window=true")
        x = rng.standard_normal((int(rng.integers(2, 14)), dim)).astype(np.float32)
        cuts = np.sort(rng.choice(np.arange(1, len(x)), size=int(rng.integers(1, min(4, len(x)))), replace=False))
        pieces = np.split(x, cuts)
        unit = x / np.linalg.norm(x, axis=1, keepdims=True)  # the pooler's token vectors
        gs, ss = _matrices(p.encoder(dim))
        for role in ("query", "document"):
            parts = [p.part(_states(piece), p.pool_role(_states(piece), role), role) for piece in pieces]
            merged = p.merge(parts, role).numpy()
            np.testing.assert_allclose(merged, p.encode_sets([unit], role)[0], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(merged, fde_literal(unit.astype(np.float64), role, gs, ss), atol=1e-5)
    f = build_pooler("fde")
    small, large = (f.part(_states(rng.standard_normal((n, 384)).astype(np.float32)), None) for n in (3, 3000))
    size = [sum(a.nbytes for a in vars(c).values() if isinstance(a, np.ndarray)) for c in (small, large)]
    assert size[0] == size[1] <= 2 * f.reps * 2 ** f.k_sim * 384 * 4 + 2 * f.reps * 2 ** f.k_sim * 8


@pytest.mark.parametrize("role", ["document", "query"])
def test_a_long_text_over_several_batches_has_the_fde_of_all_its_tokens(role, encoder, embedder, scifact_docs,
                                                                      monkeypatch):
    """A text of SciFact abstracts over 3,000 tokens, forwarded four windows per batch: its
    ``fde:window=true`` (merged from one bounded part per batch) equals the FDE of all its
    token vectors encoded at once, and the paper's literal reading of them (there with 2**7
    partitions, so that many are empty and filled from vectors of later batches)."""
    text, n = "", 0
    for doc in scifact_docs:
        text, n = (text + "\n\n" + doc).strip(), n + len(encoder.tokenizer(doc, add_special_tokens=False)["input_ids"])
        if n > 3000:
            break
    monkeypatch.setattr(encoder, "max_batch_tokens", 4 * encoder.max_length)
    batches = [s for _, s in encoder.encode([text], WINDOWED, role=role)]
    assert len(batches) >= 3 and batches[0].continued and sum(int(s.attention_mask.sum()) for s in batches) > 3000
    specs = ["fde:window=true", "fde:k_sim=7,dim_proj=8,reps=2,window=true"]
    out = embedder.embed([text], specs + ["tokens:window=true"], role=role, normalize=False)
    tokens = out.vectors["tokens:window=true"][0]  # every token vector, as the FDE pooler normalizes them
    for spec in specs:
        p = embedder.pooler(spec)
        want = p.encode_sets([tokens], role)[0]  # float32 sums in another order: rounding relative to the vector
        np.testing.assert_allclose(out.vectors[spec][0], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    small = embedder.pooler(specs[1]).encoder(tokens.shape[1])
    if role == "document":  # the fill matters: empty partitions, some first met after the first batch
        first_batch = int(batches[0].attention_mask.sum())
        occupied_late = set(small.partition(tokens[first_batch:])[:, 0]) - set(small.partition(tokens[:first_batch])[:, 0])
        assert len(set(small.partition(tokens)[:, 0])) < small.partitions and occupied_late
    gs, ss = _matrices(small)
    want = fde_literal(tokens.astype(np.float64), role, gs, ss)
    np.testing.assert_allclose(out.vectors[specs[1]][0], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
