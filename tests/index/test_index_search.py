"""Metadata filters, BM25 and hybrid search, over every backend (a FAISS folder and Milvus Lite,
the contract test's pattern): each rule is checked against a reference written here -- plain
Python predicates over the stored metadata, exact scores in numpy, bm25s for BM25 -- never
against the code under test."""

from __future__ import annotations

import math

import numpy as np
import pytest

from embedpool.errors import InvalidError
from embedpool.index import TUNED_PROPERTY, CollectionSpec, delete_collection, parse_filter, tuned_entry
from index_testutil import naive_maxsim, rand_docs, rand_unit
from test_index_contract import _open, milvus_uri, where  # noqa: F401  (fixtures)

DIM = 8
N = 1000
SINGLE = CollectionSpec(kind="single", model="m", pooler="mean", dim=DIM)
MULTI = CollectionSpec(kind="multi", model="m", pooler="tokens", dim=DIM, token_factory="HNSW32",
                       companion_pooler="mean", companion_dim=DIM, companion_rows="window")
WORDS = ["cat", "dog", "bird", "fish", "horse", "mouse", "lion", "tiger", "wolf", "bear"]


def _metadata(i: int) -> dict:
    """Document i's metadata: a tenant that keeps 0.1% / 1% / 10% of the corpus, a year, a date
    with and without a zone, tags (a list), a flag, and keys some documents lack."""
    m = {"tenant": "rare" if i % 1000 == 7 else "small" if i % 100 == 3 else "mid" if i % 10 == 5 else "big",
         "year": 2000 + i % 25, "day": f"2024-{1 + i % 12:02d}-{1 + i % 28:02d}" + ("T12:00:00+02:00" if i % 2 else ""),
         "tags": [WORDS[i % 10], WORDS[(i // 10) % 10]], "flag": i % 3 == 0}
    if i % 4 == 0:
        m["score"] = i / 7
    if i % 5 == 0:
        del m["tags"]
    return m


def _day(m):
    from datetime import datetime, timezone

    d = datetime.fromisoformat(m["day"])
    return (d if d.tzinfo else d.replace(tzinfo=timezone.utc)).timestamp()


JUNE15 = 1718409600.0  # 2024-06-15T00:00:00Z

#: (filter, the same rule as a plain predicate, what it keeps)
FILTERS = [
    ({"tenant": "rare"}, lambda m: m["tenant"] == "rare"),  # 0.1%
    ({"tenant": "small"}, lambda m: m["tenant"] == "small"),  # 1%
    ({"tenant": {"$in": ["mid", "rare"]}}, lambda m: m["tenant"] in ("mid", "rare")),
    ({"year": {"$gte": 2010, "$lt": 2013}}, lambda m: 2010 <= m["year"] < 2013),
    ({"day": {"$gt": "2024-06-15"}}, lambda m: _day(m) > JUNE15),
    ({"tags": "wolf"}, lambda m: "wolf" in m.get("tags", [])),
    ({"tags": {"$nin": ["cat", "dog"]}}, lambda m: not {"cat", "dog"} & set(m.get("tags", []))),
    ({"score": {"$exists": True}, "flag": True}, lambda m: "score" in m and m["flag"]),
    ({"flag": 1}, lambda m: m["flag"] is True),  # booleans are 1 and 0
    ({"score": {"$ne": 0}}, lambda m: m.get("score") != 0),  # $ne keeps documents without the key
    ({"$or": [{"tenant": "rare"}, {"$and": [{"year": 2001}, {"tags": {"$exists": False}}]}]},
     lambda m: m["tenant"] == "rare" or (m["year"] == 2001 and "tags" not in m)),
]


@pytest.fixture(scope="module")
def corpus():
    rng = np.random.default_rng(5)
    meta = [_metadata(i) for i in range(N)]
    texts = [" ".join(WORDS[j] for j in rng.integers(0, 10, int(rng.integers(1, 8)))) for _ in range(N)]
    return {"ids": [f"d{i}" for i in range(N)], "meta": meta, "texts": texts,
            "single": rand_unit(rng, N, DIM), "multi": rand_docs(rng, N, DIM, 1, 5),
            "companion": [rand_unit(rng, int(rng.integers(1, 4)), DIM) for _ in range(N)]}


def _fill(coll, c):
    kw = {"companion": c["companion"]} if coll.spec.companion_pooler else {}
    coll.add(c["ids"], c[coll.spec.kind], texts=c["texts"], metadata=c["meta"], **kw)
    coll.commit()


def _reference(scores, meta, pred, k):
    """The unfiltered ranking of the whole collection (exact scores), post-filtered."""
    return [f"d{i}" for i in np.argsort(-np.asarray(scores), kind="stable") if pred(meta[i])][:k]


@pytest.mark.parametrize("factory", ["IDMap2,Flat", "HNSW32"])
def test_filtered_single_vector_search_is_the_unfiltered_one_post_filtered(where, corpus, factory):
    _filtered_equals_post_filtered(where, corpus, factory, "")


@pytest.mark.parametrize("factory", ["HNSW32 selector", "IVF16,Flat selector", "IDMap2,Flat broad"])
def test_faiss_filter_paths_are_the_unfiltered_search_post_filtered(tmp_path, corpus, factory, monkeypatch):
    """FAISS' own paths. ``selector``: FAISS answers even small filters with its ID selector inside
    HNSW / IVF (by default a filter that keeps few documents is answered exactly over them).
    ``broad``: a filter that keeps most documents is applied to the unfiltered ranking, however
    small the collection (by default only from 50,000 documents on)."""
    factory, _, selector = factory.partition(" ")
    monkeypatch.setattr("embedpool.index.faiss.single.EXACT_AMONG", 0)
    monkeypatch.setattr("embedpool.index.faiss.collection.BROAD_MIN_DOCS", 0)
    _filtered_equals_post_filtered({"data_dir": tmp_path / "data", "backend": "faiss"}, corpus, factory, selector)


def _filtered_equals_post_filtered(where, corpus, factory, selector):
    coll = _open(where, "f1", CollectionSpec(**{**SINGLE.to_dict(), "factory": factory}))
    try:
        _fill(coll, corpus)
        q = rand_unit(np.random.default_rng(9), 3, DIM)
        scores = q @ corpus["single"].T
        for flt, pred in FILTERS:
            hits = coll.search(q, k=10, filter=flt)
            for r in range(len(q)):
                want = _reference(scores[r], corpus["meta"], pred, 10)
                got = [h.id for h in hits[r]]
                assert len(got) == len(want), (flt, factory)  # k come back when k match
                assert all(pred(corpus["meta"][int(i[1:])]) for i in got), flt
                exact = factory == "IDMap2,Flat" or (where["backend"] == "faiss" and not selector)
                if exact or len(want) < 10:
                    assert got == want, (flt, factory)
                else:  # an approximate index: most of the exact top 10
                    assert len(set(got) & set(want)) >= 7, (flt, factory, got, want)
                np.testing.assert_allclose([h.score for h in hits[r]],
                                           [scores[r][int(i[1:])] for i in got], atol=1e-5)
    finally:
        coll.close()


def _maxsim(q, docs):
    """MaxSim the obvious way, in float64: per query vector its best inner product, summed."""
    q = np.float64(q)
    return [float((q @ np.float64(d).T).max(axis=1).sum()) for d in docs]


def test_filtered_multi_vector_search_is_the_unfiltered_one_post_filtered(where, corpus):
    coll = _open(where, "f2", MULTI)
    try:
        _fill(coll, corpus)
        rng = np.random.default_rng(11)
        qs, cq = rand_docs(rng, 2, DIM, 2, 4), rand_unit(rng, 2, DIM)
        full = [_maxsim(q, corpus["multi"]) for q in qs]
        for mode in ("exhaustive", "two_stage", "tokens"):
            for flt, pred in FILTERS[:6]:
                hits = coll.search(qs, k=10, mode=mode, filter=flt, companion_queries=cq, candidates=50, k_token=8)
                n_match = sum(map(pred, corpus["meta"]))
                for r in range(len(qs)):
                    want = _reference(full[r], corpus["meta"], pred, 10)
                    got = [h.id for h in hits[r]]
                    assert len(got) == len(want) and all(pred(corpus["meta"][int(i[1:])]) for i in got), (flt, mode)
                    if mode == "exhaustive" or len(want) < 10 or (mode == "two_stage" and n_match <= 50):
                        # exact, or candidates that cover every matching document
                        assert got == want, (flt, mode)
                    np.testing.assert_allclose([h.score for h in hits[r]], [full[r][int(i[1:])] for i in got],
                                               atol=1e-4)
        assert naive_maxsim(qs[0], corpus["multi"][0]) == pytest.approx(full[0][0])  # the reference itself
    finally:
        coll.close()


def test_delete_by_filter(where, corpus):
    coll = _open(where, "f3", SINGLE)
    try:
        _fill(coll, corpus)
        pred = FILTERS[3][1]
        assert coll.delete_where(FILTERS[3][0]) == sum(map(pred, corpus["meta"]))
        coll.commit()
        left = set(coll.ids())
        assert left == {f"d{i}" for i, m in enumerate(corpus["meta"]) if not pred(m)}
        assert coll.delete_where({"tenant": "nobody"}) == 0
        with pytest.raises(InvalidError, match="needs a filter"):
            coll.delete_where(None)
    finally:
        coll.close()


@pytest.mark.parametrize("bad, message", [
    ({"year": {"$gte": "soon"}}, "'year': \\$gte 'soon' is not a number or an ISO 8601 date"),
    ({"year": {"$between": [1, 2]}}, "'year': unknown operator '\\$between'"),
    ({"tags": ["a", "b"]}, "'tags': \\$eq takes a string, number or boolean.*use \\$in"),
    ({"tenant": None}, "use \\$exists for null"),
    ({"$or": []}, "\\$or takes a non-empty list"),
    ({"$nor": [{"a": 1}]}, "unknown operator '\\$nor'"),
    ({"x": {"$in": "abc"}}, "'x': \\$in takes a non-empty list"),
    ({}, "empty object"),
    ([1], "a filter is a JSON object"),
    ({"x": {"$gt": 1, "$gte": 2}}, "one lower bound"),
    ({"x": {"$gt": 1, "$lt": "2024-01-01"}}, "mixes numbers and dates"),
    ({"x": {"$exists": "yes"}}, "\\$exists takes true or false"),
])
def test_bad_filters_say_what_is_wrong(where, bad, message):
    coll = _open(where, "f4", SINGLE)
    try:
        with pytest.raises(InvalidError, match="^filter: .*" + message):
            coll.search(rand_unit(np.random.default_rng(1), 1, DIM), k=3, filter=bad)
    finally:
        coll.close()


# ---------------------------------------------------------------------------------- BM25
def test_bm25_scores_equal_bm25s_with_the_same_tokenization(tmp_path):
    """FTS5's BM25 in the document store against bm25s (Robertson, k1 1.2, b 0.75) on the terms
    of bm25s' own tokenizer with PyStemmer's English stemmer and English stopwords; an empty
    document counts in N and the average length, as there."""
    import bm25s
    import Stemmer

    texts = ["The cats are running in the garden, cats everywhere.", "A dog runs after the cat.",
             "Running is healthy; runners run daily.", "Quantum physics of cats and boxes.",
             "Dogs and cats: a history of domestication.", "Gardens need water and sun.",
             "The runner's garden", "physics physics physics", "", "Nothing relevant here at all."]
    stem = Stemmer.Stemmer("english").stemWords
    tokens = bm25s.tokenize(texts, stopwords="en", stemmer=stem, return_ids=False, show_progress=False)
    ref = bm25s.BM25(method="robertson", k1=1.2, b=0.75)
    ref.index(bm25s.tokenize(texts, stopwords="en", stemmer=stem, show_progress=False), show_progress=False)
    spec = CollectionSpec(**{**SINGLE.to_dict(), "dim": 2})
    from embedpool.index import open_collection

    coll = open_collection(tmp_path, "bm", spec)
    try:
        coll.add([f"t{i}" for i in range(len(texts))], rand_unit(np.random.default_rng(0), len(texts), 2), texts=texts)
        coll.commit()
        for query in ["running cats", "garden physics", "dog", "the of and", "history domestication water"]:
            q = bm25s.tokenize([query], stopwords="en", stemmer=stem, return_ids=False, show_progress=False)[0]
            want = ref.get_scores(list(dict.fromkeys(q))) if q else np.zeros(len(texts))
            got = {h.id: h.score for h in coll.search(k=len(texts), mode="bm25", texts=[query])[0]}
            for i, t in enumerate(tokens):
                shares = bool(set(t) & set(q))
                assert (f"t{i}" in got) == shares, (query, i)
                # bm25s' Robertson variant leaves the constant factor (k1 + 1) out of the tf part (the
                # variants of Kamphuis et al. differ by it; the ranking is the same) and floors a
                # negative idf at 0 where FTS5 floors it at 1e-6
                assert got.get(f"t{i}", 0.0) == pytest.approx(2.2 * float(want[i]), abs=1e-5), (query, i)
    finally:
        coll.close()


#: the backends with full-text search (FAISS, Milvus Lite); the real server here is Milvus 2.3, which
#: has none: test_a_milvus_server_without_full_text_refuses_bm25_naming_the_version checks its refusal
LEXICAL = pytest.mark.parametrize("where", ["faiss", "milvus"], indirect=True)


@pytest.mark.slow
def test_a_milvus_server_without_full_text_refuses_bm25_naming_the_version(milvus_server, tmp_path):
    """Milvus 2.3 and 2.4 have no full-text search: a collection made there records it, and a
    lexical or hybrid search is an InvalidError (a 422) that names the version that has it."""
    from embedpool.index.milvus.versions import features_of

    assert not features_of(milvus_server.version()).full_text, \
        "this Milvus server has full-text search: add it to LEXICAL's backends"
    where = {"data_dir": tmp_path / "data", "backend": "milvus", "milvus_uri": milvus_server.uri}
    coll = _open(where, "nofts", SINGLE)
    try:
        assert coll.manifest.get("milvus_full_text") is False
        coll.add(["a"], rand_unit(np.random.default_rng(0), 1, DIM), texts=["a cat"])
        for mode in ("bm25", "hybrid"):
            with pytest.raises(InvalidError, match="no full-text.*Milvus 2.5 and later"):
                coll.search(rand_unit(np.random.default_rng(1), 1, DIM), k=3, mode=mode, texts=["cat"])
    finally:
        coll.close()
        delete_collection(where["data_dir"], "nofts", backend="milvus", milvus_uri=milvus_server.uri)


@LEXICAL
def test_bm25_and_hybrid_on_every_backend(where, corpus):
    _bm25_and_hybrid(where, corpus)


def test_bm25_and_hybrid_with_broad_filters_on_faiss(tmp_path, corpus, monkeypatch):
    """Filters that keep most documents, applied to the BM25 ranking (FAISS' own path)."""
    monkeypatch.setattr("embedpool.index.faiss.collection.BROAD_MIN_DOCS", 0)
    _bm25_and_hybrid({"data_dir": tmp_path / "data", "backend": "faiss"}, corpus)


def _bm25_and_hybrid(where, corpus):
    coll = _open(where, "bm", SINGLE)
    try:
        _fill(coll, corpus)
        nin = coll.search(k=10, mode="bm25", texts=["wolf bear"], filter={"tags": {"$nin": ["cat", "dog"]}})[0]
        want = sorted(((h.score, h.id) for h in coll.search(k=N, mode="bm25", texts=["wolf bear"])[0]
                       if not {"cat", "dog"} & set(corpus["meta"][int(h.id[1:])].get("tags", []))), reverse=True)
        # (short texts of ten words: many equal scores, whose order is not the point)
        assert [round(h.score, 9) for h in nin] == [round(x, 9) for x, _ in want][:10]
        assert all(not {"cat", "dog"} & set(corpus["meta"][int(h.id[1:])].get("tags", [])) for h in nin)
        hits = coll.search(k=10, mode="bm25", texts=["wolf wolves", "zebra"], filter={"tenant": "small"})
        have = [i for i in range(N) if "wolf" in corpus["texts"][i].split() and corpus["meta"][i]["tenant"] == "small"]
        assert len(hits[0]) == min(10, len(have)) > 0 and hits[1] == []
        for h in hits[0]:
            i = int(h.id[1:])
            assert i in have and h.score > 0
        scores = [h.score for h in hits[0]]
        assert scores == sorted(scores, reverse=True)
        rare = coll.search(k=10, mode="bm25", texts=[" ".join(WORDS)], filter={"tenant": "rare"})[0]
        assert {h.id for h in rare} == {f"d{i}" for i in range(N) if i % 1000 == 7}
        q = rand_unit(np.random.default_rng(3), 2, DIM)
        texts = ["wolf bear", "cat"]
        for fusion in ("rrf", "score", "zscore"):
            vec = coll.search(q, k=10, filter={"year": {"$lt": 2010}})
            lex = coll.search(k=10, mode="bm25", texts=texts, filter={"year": {"$lt": 2010}})
            for w, alone in ((1.0, vec), (0.0, lex)):
                got = coll.search(q, k=10, mode="hybrid", texts=texts, fusion=fusion, weight=w,
                                  filter={"year": {"$lt": 2010}})
                assert [[h.id for h in r] for r in got] == [[h.id for h in r] for r in alone], (fusion, w)
    finally:
        coll.close()


@LEXICAL
def test_hybrid_fuses_the_two_rankings_as_the_formulas_say(where, corpus):
    """RRF, min-max and z-score fusion, recomputed here from the two sides' own rankings; a
    fusion tuned for the collection (a stored property) is what a search that names none uses,
    after a reopen too."""
    coll = _open(where, "hy", MULTI)
    try:
        _fill(coll, corpus)
        rng = np.random.default_rng(4)
        qs, text = rand_docs(rng, 1, DIM, 2, 3), ["lion tiger"]
        vec = coll.search(qs, k=100)[0]
        lex = coll.search(k=100, mode="bm25", texts=text)[0]
        for fusion, w in (("rrf", 0.5), ("rrf", 0.8), ("score", 0.3), ("zscore", 0.5), ("zscore", 0.2)):
            fused: dict[str, float] = {}
            for hits, weight in ((vec, w), (lex, 1 - w)):
                s = [h.score for h in hits]
                part = ([1 / (60 + r) for r in range(1, len(hits) + 1)] if fusion == "rrf"
                        else [(x - min(s)) / (max(s) - min(s)) for x in s] if fusion == "score"
                        else [(x - min(s)) / float(np.std(s)) for x in s])
                for h, p in zip(hits, part):
                    fused[h.id] = fused.get(h.id, 0) + weight * p
            want = sorted(fused.items(), key=lambda t: -t[1])[:10]
            got = coll.search(qs, k=10, mode="hybrid", texts=text, fusion=fusion, weight=w)[0]
            assert [h.id for h in got] == [i for i, _ in want], fusion
            np.testing.assert_allclose([h.score for h in got], [s for _, s in want], rtol=1e-6)
            assert all(math.isfinite(h.score) for h in got)
        for mode in ("exhaustive", "two_stage"):  # weight 1 / 0: each side alone, multi-vector too
            kw = {"vector_mode": mode, "companion_queries": rand_unit(rng, 1, DIM), "candidates": 30}
            alone = coll.search(qs, k=10, mode=mode, **{k: v for k, v in kw.items() if k != "vector_mode"})
            assert [h.id for h in coll.search(qs, k=10, mode="hybrid", texts=text, weight=1, **kw)[0]] == \
                [h.id for h in alone[0]]
            assert [h.id for h in coll.search(qs, k=10, mode="hybrid", texts=text, weight=0, **kw)[0]] == \
                [h.id for h in lex[:10]]
        def hybrid(c, **kw):
            return [(h.id, h.score) for h in c.search(qs, k=10, mode="hybrid", texts=text, **kw)[0]]

        assert coll.tuned_fusion() is None and hybrid(coll) == hybrid(coll, fusion="rrf", weight=0.5)
        coll.set_property(TUNED_PROPERTY, tuned_entry(None, "exhaustive", "zscore", 0.3, split="dev"))
        coll.commit()
        coll.close()
        coll = _open(where, "hy", MULTI)
        assert coll.tuned_fusion("exhaustive") == ("zscore", 0.3) and coll.tuned_fusion("two_stage") is None
        assert hybrid(coll) == hybrid(coll, fusion="zscore", weight=0.3) != hybrid(coll, fusion="rrf", weight=0.5)
        assert hybrid(coll, weight=0.7) == hybrid(coll, fusion="zscore", weight=0.7)  # what is named wins
        assert hybrid(coll, fusion="rrf") == hybrid(coll, fusion="rrf", weight=0.3)
        with pytest.raises(InvalidError, match="weight"):
            coll.search(qs, mode="hybrid", texts=text, weight=1.5)
        with pytest.raises(InvalidError, match="fusion"):
            coll.search(qs, mode="hybrid", texts=text, fusion="max")
        with pytest.raises(InvalidError, match="need texts"):
            coll.search(qs, mode="bm25")
    finally:
        coll.close()


@LEXICAL
def test_a_delete_or_upsert_changes_lexical_and_vector_hits_in_the_same_commit(where):
    spec = CollectionSpec(**{**SINGLE.to_dict(), "dim": 4})
    writer = _open(where, "lx", spec)
    rng = np.random.default_rng(2)
    x = rand_unit(rng, 3, 4)
    try:
        writer.add(["a", "b", "c"], x, texts=["alpha apple", "beta banana", "gamma grape"],
                   metadata=[{"v": 1}, {"v": 1}, {"v": 1}])
        writer.commit()
        writer.add(["a"], x[2:3], texts=["alpha avocado"], metadata=[{"v": 2}])  # upsert
        writer.delete(["b"])
        reader = _open(where, "lx")
        try:
            def seen(coll):
                lex = {t: [h.id for h in coll.search(k=3, mode="bm25", texts=[t])[0]]
                       for t in ("apple", "avocado", "banana")}
                vec = [h.id for h in coll.search(x[1:2], k=3)[0]]
                return lex, vec, [h.id for h in coll.search(x[0:1], k=3, filter={"v": 2})[0]]

            before = ({"apple": ["a"], "avocado": [], "banana": ["b"]}, ["b", "a", "c"][:3], [])
            after = ({"apple": [], "avocado": ["a"], "banana": []}, None, ["a"])
            lex, vec, flt = seen(writer)  # the writer sees its own changes at once
            assert (lex, flt) == (after[0], after[2]) and "b" not in vec
            if writer.capabilities.transactional:  # another reader sees the last commit
                lex, vec, flt = seen(reader)
                assert lex == before[0] and "b" in vec and flt == []
            writer.commit()
            reader.refresh()
            lex, vec, flt = seen(reader)
            assert lex == after[0] and "b" not in vec and flt == ["a"]
        finally:
            reader.close()
    finally:
        writer.close()


def test_filters_parse_to_one_tree():
    assert parse_filter(None) is None
    a = parse_filter({"x": 1, "y": {"$lt": 3}})
    assert a == parse_filter('{"x": 1, "y": {"$lt": 3}}') and hash(a) == hash(parse_filter({"x": 1, "y": {"$lt": 3}}))


def test_milvus_without_full_text_says_so(milvus_uri):  # noqa: F811
    """A Milvus server before 2.5 has no BM25 function: its collections are made without one
    (the manifest says so) and a lexical search is refused, naming the version that has it."""
    from embedpool.index import open_collection
    from embedpool.index.milvus.schema import full_text
    from embedpool.index.milvus.versions import features_of

    assert not full_text(SINGLE, features_of("v2.4.13")) and full_text(SINGLE, features_of("v2.5.0"))
    assert not full_text(CollectionSpec(**{**SINGLE.to_dict(), "analyzer": "none"}), features_of("v2.6.0"))
    coll = open_collection("unused", "ft", SINGLE, backend="milvus", milvus_uri=milvus_uri)
    try:
        assert coll.manifest["milvus_full_text"] is True  # Milvus Lite has it
        coll._manifest["milvus_full_text"] = False  # as a collection made on a 2.4 server reads
        with pytest.raises(InvalidError, match="no full-text.*Milvus 2.5 and later"):
            coll.search(k=3, mode="bm25", texts=["cat"])
    finally:
        coll.close()
