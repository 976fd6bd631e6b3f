"""The storage contract, run over every backend: a FAISS folder, Milvus Lite (the real engine
in a temp .db; no mocks) and, in ``make test-slow``, a real Milvus 2.3 server (``milvus-server``). Each test states one rule of :class:`embedpool.index.CollectionBase`
and checks that both backends keep it the same way -- the same answers, the same errors, the
same ``stats()`` keys -- so ``app/`` never needs to know which one it holds.

Milvus Lite is a dependency of embedpool, not an option: without it the Milvus cases fail (they
are not skipped), and the FAISS cases still run."""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest

from embedpool.errors import ConflictError, InvalidError, NotFoundError
from embedpool.index import (
    INT_MAX,
    INT_MIN,
    CollectionBase,
    CollectionSpec,
    FORMAT_VERSION,
    FaissCollection,
    STATS_KEYS,
    delete_collection,
    list_collections,
    open_collection,
    read_collection_manifest,
    check_document,
)
from embedpool.index.milvus import ClientPool, MilvusCollection
from index_testutil import naive_maxsim, rand_docs, rand_unit, unit

DIM = 8
SINGLE = CollectionSpec(kind="single", model="m", pooler="mean", dim=DIM)
MULTI = CollectionSpec(kind="multi", model="m", pooler="tokens", dim=DIM, token_factory="Flat")
CDIM = 6  # companion vectors: another dimension than the token vectors', so a mix-up fails
WINDOWS = CollectionSpec(**{**MULTI.to_dict(), "companion_pooler": "mean", "companion_dim": CDIM,
                            "companion_rows": "window"})
PER_DOC = CollectionSpec(**{**WINDOWS.to_dict(), "companion_rows": "document"})
SPARSE = CollectionSpec(kind="sparse", model="m", pooler="splade", dim=40, normalized=False, factory="exact")
CONTRACT = {"add", "delete", "commit", "compact", "build_token_index", "get_property", "set_property",
            "get", "ids", "stats", "__len__", "__contains__", "refresh", "close"}


@pytest.fixture(scope="module")
def milvus_uri(tmp_path_factory):
    try:
        import milvus_lite  # noqa: F401
    except ImportError as e:
        pytest.fail(f"milvus-lite cannot be imported ({e}): it is a dependency of embedpool "
                    "(pyproject.toml) that the Milvus backend needs; pip install -e . installs it")
    path = str(tmp_path_factory.mktemp("contract") / "c.db")
    anchor = ClientPool.acquire(path, None)  # keep the engine up between tests
    yield path
    ClientPool.release(anchor)


@pytest.fixture(params=["faiss", "milvus", pytest.param("milvus-server", marks=pytest.mark.slow)])
def where(request, tmp_path):
    """``open_collection`` keyword arguments of one backend (a fresh FAISS folder per test; Milvus
    collections are dropped after it). Only the Milvus cases need Milvus Lite; the server's need
    the real server (slow)."""
    kw = {"backend": request.param.split("-")[0]}
    if request.param == "milvus":
        kw["milvus_uri"] = request.getfixturevalue("milvus_uri")
    elif request.param == "milvus-server":
        kw["milvus_uri"] = request.getfixturevalue("milvus_server").uri
    yield {"data_dir": tmp_path / "data", **kw}
    if kw["backend"] == "milvus":
        for name in list_collections(**kw, data_dir=tmp_path):
            delete_collection(tmp_path, name, **kw)


def _open(where, name, spec=None):
    kw = dict(where)
    return open_collection(kw.pop("data_dir"), name, spec, **kw)


def _fill(coll, n=12, seed=0):
    rng = np.random.default_rng(seed)
    ids = [f"d{i}" for i in range(n)]
    vecs = rand_unit(rng, n, DIM) if coll.spec.kind == "single" else rand_docs(rng, n, DIM, 1, 4)
    coll.add(ids, vecs, texts=[f"text {i}" for i in ids], metadata=[{"i": i} for i in range(n)])
    return ids, vecs


def test_the_base_class_declares_the_whole_contract():
    assert CONTRACT <= CollectionBase.__abstractmethods__
    for method in ("search", "delete_where", "manifest", "__enter__", "__exit__"):
        assert hasattr(CollectionBase, method)
    for cls in (FaissCollection, MilvusCollection):
        assert not inspect.isabstract(cls), cls.__abstractmethods__
        assert issubclass(cls, CollectionBase)
    with pytest.raises(TypeError):
        CollectionBase()


@pytest.mark.parametrize("spec", [SINGLE, MULTI], ids=["single", "multi"])
def test_stats_have_the_same_keys_and_meaning(where, spec):
    coll = _open(where, "s", spec)
    try:
        empty = coll.stats()
        assert tuple(empty) == STATS_KEYS
        assert (empty["documents"], empty["vectors"], empty["tombstones"]) == (0, 0, 0)
        ids, vecs = _fill(coll)
        coll.commit()
        st = coll.stats()
        assert tuple(st) == STATS_KEYS
        n_vec = 12 if spec.kind == "single" else sum(len(v) for v in vecs)
        assert (st["documents"], st["vectors"]) == (12, n_vec)
        assert st["backend"] == coll.backend and isinstance(st["location"], str) and st["location"]
        assert st["bytes_per_doc"] > 0 and isinstance(st["index_type"], str)
        assert st["token_index"] is (spec.kind == "multi" and coll.capabilities.token_index_on_insert)
        assert (st["bytes_on_disk"] is not None) == coll.capabilities.measures_disk_usage
        assert coll.manifest["counts"] == {"documents": 12, "vectors": n_vec}
    finally:
        coll.close()


def test_writes_reads_and_errors_agree(where):
    coll = _open(where, "w", SINGLE)
    try:
        ids, x = _fill(coll)
        coll.add(["d3"], rand_unit(np.random.default_rng(9), 1, DIM), texts=["replaced"])
        assert len(coll) == 12 and coll.ids() == [i for i in ids if i != "d3"] + ["d3"]
        got = coll.get("d3")
        assert set(got) == {"id", "text", "metadata", "vector"} and got["text"] == "replaced"
        assert got["metadata"] is None and got["vector"].shape == (DIM,)
        assert "d1" in coll and "nope" not in coll
        with pytest.raises(NotFoundError, match="nothing was deleted"):
            coll.delete(["d1", "nope"])
        coll.delete(["d1", "d1"])  # duplicates in a delete are one delete
        assert "d1" not in coll and len(coll) == 11
        with pytest.raises(NotFoundError):
            coll.get("d1")
        with pytest.raises(ConflictError, match="dimension"):
            coll.add(["z"], rand_unit(np.random.default_rng(1), 1, DIM + 1))
        with pytest.raises(InvalidError, match="duplicate"):
            coll.add(["z", "z"], rand_unit(np.random.default_rng(1), 2, DIM))
        assert len(coll) == 11 and "z" not in coll  # refused batches change nothing
        hits = coll.search(x[5:6], k=3)
        assert hits[0][0].id == "d5" and hits[0][0].text == "text d5" and hits[0][0].metadata == {"i": 5}
        coll.commit()
        coll.compact()
        assert coll.stats()["tombstones"] == 0 and len(coll) == 11
    finally:
        coll.close()
    coll.close()  # idempotent
    assert len(coll) == 0
    with pytest.raises(InvalidError, match="closed"):
        coll.search(x[:1], k=1)


def test_multi_vector_search_modes_agree(where):
    single = _open(where, "single", SINGLE)
    coll = _open(where, "mv", PER_DOC)
    try:
        rng = np.random.default_rng(0)
        ids, docs = [f"d{i}" for i in range(12)], rand_docs(rng, 12, DIM, 1, 4)
        means = rand_unit(rng, 12, CDIM)  # the companion: a vector per document
        coll.add(ids, docs, companion=means)
        coll.commit()
        q, cq = [docs[4], docs[7]], means[[4, 7]]
        for mode in ("exhaustive", "tokens", "two_stage"):
            hits = coll.search(q, k=2, mode=mode, companion_queries=cq, k_token=4, candidates=5)
            assert [h[0].id for h in hits] == ["d4", "d7"], mode
        assert coll.capabilities.supports_token_ann and not single.capabilities.supports_token_ann
        coll.build_token_index()
        with pytest.raises(InvalidError, match="multi-vector collections only"):
            single.build_token_index()
        assert coll.get("d4")["vectors"].shape == docs[4].shape
    finally:
        coll.close()
        single.close()


def test_two_stage_without_a_companion_says_how_to_get_one(where):
    with _open(where, "plain", MULTI) as coll:
        ids, docs = _fill(coll, n=3)
        with pytest.raises(InvalidError, match="keeps no companion vectors.*--companion-pooler") as e:
            coll.search([docs[0]], mode="two_stage", companion_queries=rand_unit(np.random.default_rng(0), 1, CDIM))
        assert e.value.param == "mode"
        assert [h[0].id for h in coll.search([docs[0]], k=1, mode="exhaustive")] == ["d0"]


def test_properties_are_staged_until_commit_and_travel_with_the_collection(where):
    coll = _open(where, "p", SINGLE)
    try:
        assert coll.get_property("job") is None
        _fill(coll, n=4)
        coll.set_property("job", json.dumps({"committed": 4}))
        assert coll.get_property("job") == '{"committed": 4}'  # this object sees its staged value
        other = _open(where, "p")
        try:
            assert other.get_property("job") is None  # not durable before commit
        finally:
            other.close()
        coll.commit()
        coll.set_property("job", "later")  # staged, never committed
    finally:
        coll.close()  # discards the staged value
    again = _open(where, "p")
    try:
        assert again.get_property("job") == '{"committed": 4}' and len(again) == 4
        with pytest.raises(InvalidError, match="reserved"):
            again.set_property("embedpool.manifest", "{}")
        with pytest.raises(InvalidError, match="reserved"):
            again.set_property("", "x")
        with pytest.raises(InvalidError, match="strings"):
            again.set_property("job", 3)
        assert again.manifest["kind"] == "single"
    finally:
        again.close()
    kw = dict(where)
    delete_collection(kw.pop("data_dir"), "p", **kw)  # properties die with the collection
    fresh = _open(where, "p", SINGLE)
    try:
        assert fresh.get_property("job") is None and len(fresh) == 0
    finally:
        fresh.close()


def test_a_property_never_claims_more_than_is_committed(where):
    """What the indexing job relies on: documents added, their resume state staged, no commit
    (a crash): the state is not there, whatever the backend kept of the documents."""
    coll = _open(where, "c", SINGLE)
    _fill(coll, n=6)
    coll.set_property("state", "6 records")
    coll.close()  # no commit
    again = _open(where, "c")
    try:
        assert again.get_property("state") is None
        assert len(again) == (0 if again.capabilities.transactional else 6)
        _fill(again, n=6)
        again.set_property("state", "6 records")
        again.commit()
    finally:
        again.close()
    third = _open(where, "c")
    try:
        assert third.get_property("state") == "6 records" and len(third) == 6
    finally:
        third.close()


def test_refresh_and_deletion_elsewhere(where):
    coll = _open(where, "r", SINGLE)
    try:
        _fill(coll, n=3)
        coll.commit()
        assert coll.refresh() is False
        writer = _open(where, "r")
        writer.add(["new"], rand_unit(np.random.default_rng(2), 1, DIM))
        writer.commit()
        writer.close()
        coll.refresh()
        assert "new" in coll and len(coll) == 4  # another writer's commit is seen
        kw = dict(where)
        delete_collection(kw.pop("data_dir"), "r", **kw)
        with pytest.raises(NotFoundError):
            coll.refresh()
    finally:
        coll.close()


def test_manifest_without_opening(where):
    coll = _open(where, "m", MULTI)
    _fill(coll, n=5)
    coll.commit()
    live = coll.manifest
    coll.close()
    kw = dict(where)
    data_dir = kw.pop("data_dir")
    m = read_collection_manifest(data_dir, "m", **kw)
    assert CollectionSpec.from_dict(m) == MULTI == CollectionSpec.from_dict(live)
    assert m["counts"]["documents"] == 5 and m["format"] == "embedpool-collection"
    with pytest.raises(NotFoundError, match="no collection 'absent'"):
        read_collection_manifest(data_dir, "absent", **kw)


# ---- companion rows kept by the collection (spec.companion_pooler) ---------------------------
def _fill_companion(coll, n=12, seed=0):
    """``n`` documents with their companion rows: d0 has one row, d1 three, the others 1-4
    (``companion_rows="document"``: one each)."""
    rng = np.random.default_rng(seed)
    ids = [f"d{i}" for i in range(n)]
    docs = rand_docs(rng, n, DIM, 1, 4)
    window = coll.spec.companion_rows == "window"
    counts = [1, 3, *rng.integers(1, 5, n - 2)] if window else [1] * n
    comp = [rand_unit(rng, int(r), CDIM) for r in counts]
    coll.add(ids, docs, texts=[f"text {i}" for i in ids], companion=comp)
    return ids, docs, comp


def _best_docs(cq, ids, comp, k):
    """Reference candidates: the ``k`` distinct documents of the best companion rows for ``cq``
    (every row scored by the obvious inner product), best first."""
    scored = sorted(((float(np.dot(np.float64(cq), np.float64(row))), i) for i, rows in zip(ids, comp)
                     for row in rows), key=lambda t: -t[0])
    return list(dict.fromkeys(i for _, i in scored))[:k]


def _two_stage(coll, q, cq, candidates, k):
    return coll.search(q, k=k, mode="two_stage", companion_queries=cq, candidates=candidates)


def _ranking(hits):
    return [[(h.id, round(h.score, 4)) for h in r] for r in hits]


def test_companion_rows_are_stored_with_their_documents(where):
    with _open(where, "cr", WINDOWS) as coll, _open(where, "cr-plain", MULTI) as plain:
        ids, docs, comp = _fill_companion(coll)
        assert coll.stats()["companion_rows"] == sum(map(len, comp)) and len(comp[0]) == 1 and len(comp[1]) == 3
        assert tuple(coll.stats()) == STATS_KEYS and coll.stats()["documents"] == 12
        for i, d, rows in zip(ids, docs, comp):
            got = coll.get(i)
            assert got["companion"].dtype == np.float32 and got["companion"].shape == rows.shape
            np.testing.assert_allclose(got["companion"], rows, atol=1e-6)
            np.testing.assert_allclose(got["vectors"], d, atol=1e-6)
            assert got["text"] == f"text {i}"
        assert coll.manifest["format_version"] == FORMAT_VERSION and coll.manifest["companion_pooler"] == "mean"
        _fill(plain, n=3)  # a collection without a companion keeps none
        assert plain.stats()["companion_rows"] is None and "companion" not in plain.get("d0")


def test_two_stage_over_companion_rows_is_exhaustive_when_candidates_cover_the_corpus(where):
    with _open(where, "ts", WINDOWS) as coll:
        ids, docs, comp = _fill_companion(coll, n=20)
        coll.commit()
        rng = np.random.default_rng(7)
        q, cq = rand_docs(rng, 4, DIM, 2, 5), rand_unit(rng, 4, CDIM)
        exhaustive = coll.search(q, k=6)
        for candidates in (20, 500):  # every document; more than there are
            assert _ranking(_two_stage(coll, q, cq, candidates, 6)) == _ranking(exhaustive), candidates
        for qi, hits in zip(q, exhaustive):  # and both are exact MaxSim
            want = sorted(((naive_maxsim(qi, d), i) for i, d in zip(ids, docs)), key=lambda t: -t[0])[:6]
            assert [h.id for h in hits] == [i for _, i in want]
            np.testing.assert_allclose([h.score for h in hits], [s for s, _ in want], atol=1e-5)
        with pytest.raises(InvalidError, match="companion_queries"):
            coll.search(q, mode="two_stage")
        with pytest.raises(ConflictError, match="dimension"):
            _two_stage(coll, q, rand_unit(rng, 4, DIM), 5, 3)


def test_candidates_count_the_documents_of_the_best_rows(where):
    with _open(where, "c1", WINDOWS) as coll:
        ids, docs, comp = _fill_companion(coll, n=15)
        rng = np.random.default_rng(3)
        q, cq = rand_docs(rng, 5, DIM, 2, 4), rand_unit(rng, 5, CDIM)
        for qi, c, hits in zip(q, cq, _two_stage(coll, q, cq, 1, 3)):
            best = _best_docs(c, ids, comp, 1)  # the one document of the best row
            assert [h.id for h in hits] == best
            assert hits[0].score == pytest.approx(naive_maxsim(qi, docs[ids.index(best[0])]), abs=1e-5)
        for c, hits in zip(cq, _two_stage(coll, q, cq, 3, 10)):  # reranked: compare as sets
            assert sorted(h.id for h in hits) == sorted(_best_docs(c, ids, comp, 3))
        # a document with many rows near the query takes one candidate, not fifty
        crowd = unit(cq[0] + 0.05 * rng.standard_normal((50, CDIM)))
        coll.add(["crowd"], rand_docs(rng, 1, DIM, 2, 3), companion=[crowd])
        want = _best_docs(cq[0], [*ids, "crowd"], [*comp, crowd], 4)
        assert want[0] == "crowd" and len(want) == 4
        assert sorted(h.id for h in _two_stage(coll, q[:1], cq[:1], 4, 10)[0]) == sorted(want)


def test_replacing_a_document_replaces_its_companion_rows(where):
    with _open(where, "rp", WINDOWS) as coll:
        ids, docs, comp = _fill_companion(coll)
        before = coll.stats()["companion_rows"]
        old = comp[1]  # three rows
        comp[1] = unit(-old[:1])  # one row, the opposite of the first old one
        coll.add(["d1"], [docs[1]], companion=[comp[1]])
        assert coll.stats()["companion_rows"] == before - 2 and len(coll) == 12
        np.testing.assert_allclose(coll.get("d1")["companion"], comp[1], atol=1e-6)
        assert _best_docs(old[0], ids, comp, 1) != ["d1"]  # the old row would have been the best
        for row in old:  # old rows are never candidates
            assert [h.id for h in _two_stage(coll, [docs[1]], row[None], 1, 1)[0]] == _best_docs(row, ids, comp, 1)
        comp[1] = rand_unit(np.random.default_rng(5), 4, CDIM)  # and up: one row -> four
        coll.add(["d1"], [docs[1]], companion=[comp[1]])
        assert coll.stats()["companion_rows"] == before + 1
        np.testing.assert_allclose(coll.get("d1")["companion"], comp[1], atol=1e-6)
        for row in comp[1]:
            assert [h.id for h in _two_stage(coll, [docs[0]], row[None], 1, 1)[0]] == ["d1"]
        coll.commit()


def test_deleting_a_document_removes_all_its_companion_rows_and_reopening_keeps_the_rest(where):
    with _open(where, "dl", WINDOWS) as coll:
        ids, docs, comp = _fill_companion(coll)
        coll.commit()
        before = coll.stats()["companion_rows"]
        coll.delete(["d1"])  # three rows
        assert coll.stats()["companion_rows"] == before - 3
        live_ids, live_comp = ids[:1] + ids[2:], comp[:1] + comp[2:]
        for row in comp[1]:  # its rows are never candidates
            assert [h.id for h in _two_stage(coll, [docs[1]], row[None], 1, 1)[0]] == \
                _best_docs(row, live_ids, live_comp, 1)
            everything = _two_stage(coll, [docs[1]], row[None], 100, 100)[0]
            assert sorted(h.id for h in everything) == sorted(live_ids)
        coll.commit()
        coll.compact()
        rng = np.random.default_rng(11)
        q, cq = rand_docs(rng, 3, DIM, 2, 4), rand_unit(rng, 3, CDIM)
        seen = _ranking(_two_stage(coll, q, cq, 4, 3))
    with _open(where, "dl") as again:
        assert again.stats()["companion_rows"] == before - 3 and len(again) == 11
        np.testing.assert_allclose(again.get("d2")["companion"], comp[2], atol=1e-6)
        with pytest.raises(NotFoundError):
            again.get("d1")
        assert _ranking(_two_stage(again, q, cq, 4, 3)) == seen
        for c, hits in zip(cq, _two_stage(again, q, cq, 4, 10)):
            assert sorted(h.id for h in hits) == sorted(_best_docs(c, live_ids, live_comp, 4))


def test_companion_rows_are_required_checked_and_refused_as_a_whole(where):
    with _open(where, "rf", PER_DOC) as coll, _open(where, "rf-plain", MULTI) as plain:
        rng = np.random.default_rng(2)
        docs, vecs = rand_docs(rng, 3, DIM, 1, 3), rand_unit(rng, 3, CDIM)
        coll.add(["a", "b", "c"], docs, companion=vecs)  # one [n, companion_dim] array: a vector each
        coll.commit()
        state = (coll.ids(), coll.stats()["companion_rows"], coll.get("a")["companion"])
        assert state[1] == 3
        new = rand_docs(rng, 2, DIM, 1, 3)
        refused = [
            (InvalidError, r"pass companion=", {}),
            (ConflictError, "dimension", {"companion": rand_unit(rng, 2, CDIM + 1)}),
            (InvalidError, "one companion vector per document.*'new' has 2",
             {"companion": [rand_unit(rng, 1, CDIM), rand_unit(rng, 2, CDIM)]}),
            (InvalidError, "2 ids but 1", {"companion": [rand_unit(rng, 1, CDIM)]}),
            (ConflictError, "norm", {"companion": 2 * rand_unit(rng, 2, CDIM)}),
        ]
        for err, match, kw in refused:
            with pytest.raises(err, match=match):
                coll.add(["a", "new"], new, **kw)  # a replacement and a new document
            assert coll.ids() == state[0] and coll.stats()["companion_rows"] == state[1], match
            np.testing.assert_array_equal(coll.get("a")["companion"], state[2])
        coll.add(["a"], [new[0]], companion=vecs[1:2])  # a replacement keeps one row
        assert coll.stats()["companion_rows"] == 3
        np.testing.assert_allclose(coll.get("a")["companion"], vecs[1:2], atol=1e-6)
        with pytest.raises(InvalidError, match="keeps no companion"):
            plain.add(["x"], [docs[0]], companion=vecs[:1])
        assert len(plain) == 0


# ---------------------------------------------------------------------- what a document stores (issue 50)
#: values at the edges of what every backend stores: they come back exactly (type, sign, every
#: character) after a reopen, and a filter on each finds its document
EDGES = {"max": INT_MAX, "min": INT_MIN, "tiny": 5e-324, "huge": 1.7976931348623157e308, "neg0": -0.0,
         "tenth": 0.1, "one": 1, "onef": 1.0, "nul": "a\x00b", "marks": "e\u0301\u0302", "emoji": "🙂👩‍👩‍👧",
         "rtl": "\u202eשלום\u202c", "ctl": "\x01\x1f\x7f\u2028", 'q"uo\\te': "a key with a quote and a backslash",
         "": "the empty key", "nested": {"l": [1, [2.5, None, True, {"x": "y"}]]}, "date": "2024-01-31"}
#: ids a Milvus expression must quote: each is written, found, replaced and deleted like any other
ODD_IDS = ['q"uote', "ap'os", "back\\slash", "nul\x00id", "line\nbreak", "é🙂\u202e"]


def _exact(value) -> str:
    """``value`` as JSON that tells 1 from 1.0 and -0.0 from 0.0 (key order aside)."""
    return json.dumps(value, sort_keys=True)


@pytest.mark.parametrize("spec", [SINGLE, MULTI], ids=["single", "multi"])
def test_stored_values_come_back_exactly_and_filters_find_them(where, spec):
    rng = np.random.default_rng(5)
    ids = ["edges", *ODD_IDS]
    metas = [EDGES] + [{"k": i} for i in ODD_IDS]
    texts = ["x\x00y e\u0301 🙂 \u202eשלום", *ODD_IDS]
    vecs = rand_unit(rng, len(ids), DIM) if spec.kind == "single" else rand_docs(rng, len(ids), DIM, 2, 4)
    query = vecs[:1] if spec.kind == "single" else [vecs[0]]
    with _open(where, "sv", spec) as coll:
        coll.add(ids, vecs, texts=texts, metadata=metas)
        coll.commit()
        for i, text, meta in zip(ids, texts, metas):
            got = coll.get(i)
            assert (got["id"], got["text"], _exact(got["metadata"])) == (i, text, _exact(meta))
        for key, value in EDGES.items():
            if key and not isinstance(value, dict):
                assert [h.id for h in coll.search(query, k=10, filter={key: value})[0]] == ["edges"], key
        for i in ODD_IDS:
            assert [h.id for h in coll.search(query, k=10, filter={"k": i})[0]] == [i], repr(i)
        shorter = rand_unit(rng, 3, DIM) if spec.kind == "single" else rand_docs(rng, 3, DIM, 1, 1)
        coll.add(ODD_IDS[:3], shorter, texts=["replaced"] * 3)  # multi: the stale rows of longer ones go
        coll.delete(ODD_IDS[3:])
        coll.commit()
    with _open(where, "sv") as coll:
        assert sorted(coll.ids()) == sorted(["edges", *ODD_IDS[:3]])
        assert _exact(coll.get("edges")["metadata"]) == _exact(EDGES)
        assert [coll.get(i)["text"] for i in ODD_IDS[:3]] == ["replaced"] * 3
        if spec.kind == "multi":
            assert coll.stats()["vectors"] == len(vecs[0]) + 3  # no stray rows of the longer versions


def _deep(levels: int) -> dict:
    value: object = 1
    for _ in range(levels):
        value = {"a": value}
    return value  # type: ignore[return-value]


def test_values_not_every_backend_stores_are_refused_by_path_and_nothing_is_written(where):
    """What no backend stores exactly or no answer renders is refused by ``add`` itself (the HTTP
    route and the indexing job check it first, with their limits): an :class:`InvalidError` whose
    ``param`` is the path of the value, and the whole batch is left out."""
    rng = np.random.default_rng(6)
    with _open(where, "rv", SINGLE) as coll:
        coll.add(["kept"], rand_unit(rng, 1, DIM), metadata=[{"v": INT_MAX}])
        refused = [
            ({"v": INT_MAX + 1}, "metadata.v", r"-\(2\^63-1\) \.\. 2\^63-1"),
            ({"v": [1, INT_MIN - 1]}, "metadata.v[1]", r"outside the 64-bit range"),
            ({"v": float("nan")}, "metadata.v", "NaN is not a finite number"),
            ({"v": {"w": float("-inf")}}, "metadata.v.w", "-Infinity is not a finite number"),
            ({"_embedpool_dates": {}}, "metadata._embedpool_dates", "reserved"),
            ({1: "x"}, "metadata", "JSON keys are strings"),
            ({"s": "x\ud800"}, "metadata.s", "lone surrogate"),
            ({"\ud800": 1}, 'metadata["\\ud800"]', "lone surrogate"),
            ({"v": {1, 2}}, "metadata.v", "set is not a JSON value"),
            (_deep(201), "metadata" + ".a" * 200, "nested 201 levels deep.*max_metadata_depth = 200"),
            (["not", "an object"], "metadata", "must be a JSON object"),
        ]
        for meta, path, match in refused:
            with pytest.raises(InvalidError, match=match) as e:
                coll.add(["new", "bad"], rand_unit(rng, 2, DIM), metadata=[{"ok": 1}, meta])
            assert e.value.param == path and "id 'bad'" in e.value.message, (path, e.value.param)
            assert coll.ids() == ["kept"], path
        coll.add(["deep"], rand_unit(rng, 1, DIM), metadata=[_deep(200)])
        coll.commit()
        assert coll.get("deep")["metadata"] == _deep(200) and coll.get("kept")["metadata"] == {"v": INT_MAX}


def test_the_one_check_of_what_a_document_stores():
    """``check_document``: the check the HTTP route and the indexing job make with their limits,
    naming each value by its path under the caller's field."""
    assert check_document("a", None) is None
    assert check_document("a", {"v": [1, 2.5]}, "documents[0]") == '{"v":[1,2.5]}'
    assert check_document("é" * 256, {"s": "x" * 6}, max_metadata_bytes=len('{"s":"xxxxxx"}')) is not None
    refused = [
        (("", None), "documents[3].id", "non-empty string"),
        (("é" * 256 + "x", None), "documents[3].id", "513 bytes as UTF-8; an id has at most 512"),
        (("a\udfff", None), "documents[3].id", "lone surrogate"),
        (("a", {"s": "x" * 7}), "documents[3].metadata", "15 bytes as compact JSON; the limit is max_metadata_bytes = 14"),
        (("a", {"k" * 50: [{"v": 2 ** 64}]}), 'documents[3].metadata["' + "k" * 40 + '..."][0].v', "18446744073709551616"),
        (("a", {"a": {"b": [[1]]}}), "documents[3].metadata.a.b[0]", "nested 4 levels deep.*max_metadata_depth = 3"),
    ]
    for (doc_id, meta), path, match in refused:
        with pytest.raises(InvalidError, match=match) as e:
            check_document(doc_id, meta, "documents[3]", max_metadata_depth=3, max_metadata_bytes=14,
                           context="corpus.jsonl, line 4: ")
        assert e.value.param == path and e.value.message.startswith(f"corpus.jsonl, line 4: {path}: "), e.value.message


def _sparse_rows(rng, n):
    return [{"indices": rng.choice(SPARSE.dim, 5, replace=False).tolist(), "values": rng.random(5).tolist()}
            for _ in range(n)]


def _has_sparse_vectors(where) -> bool:
    """FAISS folders and Milvus Lite store sparse rows; a Milvus server from 2.4 on."""
    if where["backend"] != "milvus":
        return True
    conn = ClientPool.acquire(where["milvus_uri"], None)
    try:
        return conn.features.sparse
    finally:
        ClientPool.release(conn)


def test_sparse_collections_keep_the_contract_or_are_refused_naming_kind(where):
    """A sparse collection (token id, weight rows) keeps the same stats keys, writes, deletes,
    filters and reopening as the other kinds where the backend stores sparse rows (FAISS, Milvus
    Lite); a Milvus without sparse vectors (the 2.3 server) refuses to create one, naming
    ``kind``, its version and the version needed, and leaves nothing behind."""
    if not _has_sparse_vectors(where):
        with pytest.raises(InvalidError, match=r"need Milvus 2\.4 or later, and the server is Milvus 2\.3") as e:
            _open(where, "sp", SPARSE)
        assert e.value.param == "kind"
        kw = dict(where)
        assert "sp" not in list_collections(kw.pop("data_dir"), **kw)
        return
    rng = np.random.default_rng(5)
    coll = _open(where, "sp", SPARSE)
    try:
        assert tuple(coll.stats()) == STATS_KEYS
        rows = _sparse_rows(rng, 12)
        ids = [f"d{i}" for i in range(12)]
        coll.add(ids, rows, texts=[f"text {i}" for i in ids], metadata=[{"i": i} for i in range(12)])
        coll.commit()
        st = coll.stats()
        assert (st["documents"], st["vectors"]) == (12, 12)
        assert st["bytes_per_doc"] == pytest.approx(5 * 6 + 16)  # uint16 token id + float32 weight, + 16
        assert coll.manifest["counts"] == {"documents": 12, "vectors": 12}
        assert coll.search([rows[3]], k=1)[0][0].id == "d3"
        every = {"indices": list(range(SPARSE.dim)), "values": [1.0] * SPARSE.dim}  # shares a token with all
        assert {h.id for h in coll.search([every], k=12, filter={"i": {"$gte": 10}})[0]} == {"d10", "d11"}
        got = coll.get("d4")["vector"]
        order = np.argsort(rows[4]["indices"])
        assert got["indices"].tolist() == np.asarray(rows[4]["indices"])[order].tolist()
        np.testing.assert_allclose(got["values"], np.asarray(rows[4]["values"], np.float32)[order])
        coll.add(["d4"], [{"indices": [], "values": []}], metadata=[{"i": 4}])  # no non-zero weight
        assert coll.get("d4")["vector"]["indices"].tolist() == [] and len(coll) == 12
        assert "d4" not in {h.id for h in coll.search([every], k=12)[0] if h.score > 0}
        coll.delete(["d3"])
        coll.commit()
        assert "d3" not in {h.id for h in coll.search([rows[3]], k=12)[0]}
        with pytest.raises(NotFoundError):
            coll.get("d3")
        with pytest.raises(ConflictError) as e:
            coll.add(["x"], np.ones((1, SPARSE.dim), np.float32))
        assert e.value.param == "vectors"
    finally:
        coll.close()
    coll = _open(where, "sp")
    try:
        assert len(coll) == 11 and coll.spec == SPARSE
        # its lexical index, alone and fused with the sparse rows, as every kind's
        assert [h.id for h in coll.search(k=1, mode="bm25", texts=["text d5"])[0]] == ["d5"]
        assert coll.search([rows[5]], k=1, mode="hybrid", texts=["text d5"])[0][0].id == "d5"
    finally:
        coll.close()


BAD_SPARSE = [
    ([{"indices": [1, 2], "values": [0.5, -0.1]}], InvalidError, "negative weight -0.1 \\(token id 2\\)"),
    ([{"indices": [1], "values": [float("nan")]}], InvalidError, "weight of nan"),
    ([{"indices": [1], "values": [float("inf")]}], InvalidError, "weight of inf"),
    ([{"indices": [SPARSE.dim], "values": [1.0]}], InvalidError, f"token id {SPARSE.dim}, outside the collection's"),
    ([{"indices": [4, 4], "values": [1.0, 2.0]}], InvalidError, "token id 4 twice"),
    (np.ones((1, SPARSE.dim), np.float32), ConflictError, "is sparse: give one {indices, values} row"),
]


def test_bad_sparse_rows_and_the_wrong_kind_of_vectors_are_refused_alike(where):
    """Every backend refuses the same bad rows with the same error naming the field (the one
    check, :func:`embedpool.index.check_sparse_rows`), with nothing of the batch stored; sparse
    rows sent to a dense collection are refused as well (also where Milvus has no sparse vectors)."""
    rng = np.random.default_rng(8)
    if _has_sparse_vectors(where):
        with _open(where, "bad", SPARSE) as coll:
            coll.add(["keep"], _sparse_rows(rng, 1))
            for rows, error, match in BAD_SPARSE:
                with pytest.raises(error, match=match) as e:
                    coll.add(["ok", "bad"], _sparse_rows(rng, 1) + list(rows))
                assert e.value.param == "vectors"
                with pytest.raises(error, match=match) as e:
                    coll.search(list(rows), k=1)
                assert e.value.param == "queries"
            assert coll.ids() == ["keep"]
    with _open(where, "dense", SINGLE) as coll:
        with pytest.raises(ConflictError, match="not sparse \\{indices, values\\} rows") as e:
            coll.add(["x"], _sparse_rows(rng, 1))
        assert e.value.param == "vectors" and len(coll) == 0
        with pytest.raises(ConflictError, match="not sparse") as e:
            coll.search(_sparse_rows(rng, 1), k=1)
        assert e.value.param == "queries"
