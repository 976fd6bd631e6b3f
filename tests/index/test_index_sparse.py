"""Sparse collections (issue 49, 1 and 4) on the FAISS backend: rows stored as (token id, weight)
pairs, searched exactly (a scipy.sparse product) or through a real Seismic index
(``pyseismic-lsr``); the exact search equals a brute-force numpy dot product over the stored
rows through upserts, deletes, filters, reopening and compaction; bad rows are refused naming
the field with nothing stored. On Milvus Lite (the real engine: SPARSE_FLOAT_VECTOR rows, a
SPARSE_INVERTED_INDEX) the same rows give the exact FAISS search's top k and scores. The approximate index's recall is measured in the benchmark, not
pinned here: these tests check what it must always keep (only live, matching documents, exact
scores)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.sparse as sp

from embedpool.errors import ConflictError, InvalidError
from embedpool.index import CollectionSpec, open_collection, parse_sparse_factory

VOCAB = 300


def _spec(factory: str = "exact", **kw) -> CollectionSpec:
    return CollectionSpec(kind="sparse", model="m", pooler="splade", dim=VOCAB, normalized=False, factory=factory,
                          **kw)


def _rows(rng, n: int, lo: int = 1, hi: int = 25) -> list[dict]:
    out = []
    for _ in range(n):
        k = int(rng.integers(lo, hi + 1))
        idx = rng.choice(VOCAB, k, replace=False)
        out.append({"indices": idx.tolist(), "values": rng.gamma(1.0, 1.0, k).astype(np.float32).tolist()})
    return out


def _dense(rows: list[dict]) -> np.ndarray:
    m = np.zeros((len(rows), VOCAB), np.float64)
    for j, r in enumerate(rows):
        m[j, r["indices"]] = r["values"]
    return m


class Reference:
    """What the collection should hold: id -> row, and the brute-force dot-product ranking."""

    def __init__(self) -> None:
        self.rows: dict[str, dict] = {}
        self.meta: dict[str, dict] = {}

    def add(self, ids, rows, meta):
        for i, r, m in zip(ids, rows, meta):
            self.rows.pop(i, None)  # a replaced document moves to the end
            self.rows[i], self.meta[i] = r, m

    def delete(self, ids):
        for i in ids:
            del self.rows[i], self.meta[i]

    def scores(self, q: dict, keep=lambda m: True) -> dict[str, float]:
        ids = [i for i in self.rows if keep(self.meta[i])]
        s = _dense([self.rows[i] for i in ids]) @ _dense([q])[0] if ids else np.zeros(0)
        return dict(zip(ids, s))


def _check_exact(coll, ref: Reference, queries, k: int, flt=None, keep=lambda m: True):
    results = coll.search(queries, k=k, filter=flt)
    for q, hits in zip(queries, results):
        want = ref.scores(q, keep)
        assert len(hits) == min(k, len(want))
        for h in hits:
            assert h.score == pytest.approx(want[h.id], rel=1e-5, abs=1e-5)
        # the k-th best score: every document above it is returned
        kth = sorted(want.values(), reverse=True)[len(hits) - 1] if hits else None
        above = {i for i, s in want.items() if kth is not None and s > kth + 1e-4}
        assert above <= {h.id for h in hits}
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)


def test_exact_search_equals_brute_force_through_upserts_deletes_reopen_and_compaction(tmp_path):
    rng = np.random.default_rng(7)
    ref = Reference()
    queries = _rows(rng, 6, 3, 30)
    coll = open_collection(tmp_path, "sp", _spec())
    try:
        ids = [f"d{i}" for i in range(120)]
        rows, meta = _rows(rng, 120), [{"g": i % 3} for i in range(120)]
        coll.add(ids, rows, texts=[f"text {i}" for i in ids], metadata=meta)
        ref.add(ids, rows, meta)
        _check_exact(coll, ref, queries, 10)  # uncommitted rows are searched too
        coll.commit()
        again = _rows(rng, 20)  # upserts: replace 20 documents
        coll.add(ids[:20], again, metadata=meta[:20])
        ref.add(ids[:20], again, meta[:20])
        coll.delete(ids[50:60])
        ref.delete(ids[50:60])
        coll.commit()
        assert coll.stats()["tombstones"] == 30
        _check_exact(coll, ref, queries, 10)
        _check_exact(coll, ref, queries, 7, {"g": 1}, lambda m: m["g"] == 1)
    finally:
        coll.close()
    coll = open_collection(tmp_path, "sp")
    try:
        assert len(coll) == 110 and coll.ids() == list(ref.rows)
        _check_exact(coll, ref, queries, 10)
        _check_exact(coll, ref, queries, 200)  # more than there are: every document, zeros included
        got = coll.get("d5")
        want = ref.rows["d5"]
        order = np.argsort(want["indices"])
        assert got["vector"]["indices"].tolist() == np.asarray(want["indices"])[order].tolist()
        np.testing.assert_allclose(got["vector"]["values"], np.asarray(want["values"], np.float32)[order])
        coll.compact()
        st = coll.stats()
        assert st["tombstones"] == 0 and st["documents"] == 110
        assert len(list(coll.folder.glob("sparse-*"))) == 1  # one base, no deltas
        _check_exact(coll, ref, queries, 10)
    finally:
        coll.close()


def test_uncommitted_rows_are_discarded_by_close(tmp_path):
    rng = np.random.default_rng(1)
    with open_collection(tmp_path, "sp", _spec()) as coll:
        coll.add(["a", "b"], _rows(rng, 2))
        coll.commit()
        coll.add(["c"], _rows(rng, 1))
        coll.delete(["a"])
    with open_collection(tmp_path, "sp") as coll:
        assert coll.ids() == ["a", "b"]
        assert {h.id for h in coll.search(_rows(rng, 1), k=5)[0]} == {"a", "b"}


def test_rows_take_bytes_per_non_zero_not_per_vocabulary_entry(tmp_path):
    rng = np.random.default_rng(2)
    with open_collection(tmp_path, "sp", _spec()) as coll:
        rows = _rows(rng, 40, 10, 10)
        coll.add([f"d{i}" for i in range(40)], rows)
        coll.commit()
        st = coll.stats()
        # uint16 token ids + float32 weights per non-zero, an int64 id and row offset per document
        assert st["bytes_per_doc"] == pytest.approx(10 * 6 + 16)
        assert st["index_type"] == "exact" and st["vectors"] == 40
        assert json.loads((coll.folder / "manifest.json").read_text())["format_version"] == 4


def test_scipy_matrices_and_pairs_are_rows_too(tmp_path):
    rows = sp.csr_matrix(np.array([[0, 1.5, 0, 2.0] + [0] * (VOCAB - 4), [3.0] + [0] * (VOCAB - 1)], np.float32))
    with open_collection(tmp_path, "sp", _spec()) as coll:
        coll.add(["m0", "m1"], rows)
        coll.add(["p"], [([3, 1], [1.0, 1.0])])  # unsorted ids are sorted
        hits = coll.search([([1, 3], [1.0, 1.0])], k=3)[0]
        assert [(h.id, h.score) for h in hits[:2]] == [("m0", 3.5), ("p", 2.0)]
        assert coll.get("p")["vector"]["indices"].tolist() == [1, 3]


@pytest.mark.parametrize("rows, match", [
    (np.ones((1, VOCAB), np.float32), "is sparse: give one {indices, values} row"),
    ([[0.0] * VOCAB], "is sparse: give one {indices, values} row"),
    ([{"indices": [1, 2], "values": [0.5, -0.1]}], "negative weight -0.1 \\(token id 2\\)"),
    ([{"indices": [1], "values": [float("nan")]}], "weight of nan"),
    ([{"indices": [1], "values": [float("inf")]}], "weight of inf"),
    ([{"indices": [VOCAB], "values": [1.0]}], f"token id {VOCAB}, outside the collection's vocabulary of {VOCAB}"),
    ([{"indices": [-1], "values": [1.0]}], "token id -1, outside"),
    ([{"indices": [4, 4], "values": [1.0, 2.0]}], "token id 4 twice"),
    ([{"indices": [1, 2], "values": [1.0]}], "2 indices and 1 values"),
    ([{"indices": [1]}], "needs 'indices' and 'values'"),
], ids=["dense-array", "dense-list", "negative", "nan", "inf", "past-vocabulary", "below-0", "duplicate",
        "lengths", "missing-values"])
def test_bad_rows_are_refused_naming_the_field_and_nothing_is_stored(tmp_path, rows, match):
    rng = np.random.default_rng(3)
    with open_collection(tmp_path, "sp", _spec()) as coll:
        coll.add(["keep"], _rows(rng, 1))
        coll.commit()
        good = _rows(rng, 1)
        with pytest.raises((InvalidError, ConflictError), match=match) as e:
            coll.add(["ok", "bad"], good + list(rows))
        assert e.value.param == "vectors"
        assert coll.ids() == ["keep"] and len(coll) == 1
        with pytest.raises((InvalidError, ConflictError), match=match) as e:
            coll.search(list(rows), k=1)
        assert e.value.param == "queries"


def test_sparse_rows_sent_to_a_dense_collection_are_refused(tmp_path):
    for spec, vectors in ((CollectionSpec(kind="single", model="m", pooler="mean", dim=8), np.eye(8)[:1]),
                          (CollectionSpec(kind="multi", model="m", pooler="tokens", dim=8, token_factory="Flat"),
                           [np.eye(8)[:2]])):
        with open_collection(tmp_path, spec.kind, spec) as coll:
            for rows in ([{"indices": [1], "values": [1.0]}], [([1], [1.0])], sp.csr_matrix(np.eye(8)[:1])):
                with pytest.raises(ConflictError, match="not sparse \\{indices, values\\} rows") as e:
                    coll.add(["x"], rows)
                assert e.value.param == "vectors" and len(coll) == 0
                with pytest.raises(ConflictError, match="not sparse") as e:
                    coll.search(rows, k=1)
                assert e.value.param == "queries"
            coll.add(["x"], vectors)  # its own kind of vectors still go in


@pytest.mark.parametrize("factory, match", [
    ("IDMap2,Flat", "FAISS factories apply to dense collections"),
    ("exact:query_cut=3", "only 'seismic' takes options"),
    ("seismic:bogus=1", "unknown seismic option 'bogus=1'"),
    ("seismic:heap_factor=-1", "heap_factor must be positive"),
    ("seismic:n_postings=many", "n_postings must be an integer"),
])
def test_bad_factories_name_the_field(factory, match):
    with pytest.raises(InvalidError, match=match) as e:
        _spec(factory).validate()
    assert e.value.param == "factory"


def test_a_sparse_spec_scores_weights_as_they_are():
    with pytest.raises(InvalidError, match="metric must be 'ip'"):
        _spec(metric="l2").validate()
    with pytest.raises(InvalidError, match="normalized must be false"):
        CollectionSpec(kind="sparse", dim=VOCAB, normalized=True, factory="auto").validate()
    assert parse_sparse_factory("seismic:query_cut=5,heap_factor=0.7").search == {"query_cut": 5, "heap_factor": 0.7}
    assert parse_sparse_factory("auto").resolved(10) == "exact"


@pytest.fixture(scope="module")
def seismic_coll(tmp_path_factory):
    """A collection searched through a real Seismic index (and its exact twin, the reference)."""
    rng = np.random.default_rng(11)
    folder = tmp_path_factory.mktemp("seismic")
    ids = [f"d{i}" for i in range(400)]
    rows, meta = _rows(rng, 400, 5, 40), [{"g": i % 4} for i in range(400)]
    colls = {}
    for name, factory in (("approx", "seismic:n_postings=200,query_cut=10,heap_factor=0.8"), ("exact", "exact")):
        c = colls[name] = open_collection(folder, name, _spec(factory))
        c.add(ids, rows, metadata=meta)
        c.commit()
    yield colls, rng
    for c in colls.values():
        c.close()


def test_seismic_answers_live_matching_documents_with_exact_scores(seismic_coll):
    colls, rng = seismic_coll
    approx, exact = colls["approx"], colls["exact"]
    assert approx.stats()["index_type"].startswith("seismic")
    queries = _rows(rng, 8, 5, 20)
    for flt in (None, {"g": 2}):
        got = approx.search(queries, k=10, filter=flt)
        full = exact.search(queries, k=400, filter=flt)
        for hits, ref in zip(got, full):
            scores = {h.id: h.score for h in ref}
            assert hits and len(hits) <= 10
            for h in hits:  # scored exactly; only documents the filter keeps
                assert h.score == pytest.approx(scores[h.id], rel=1e-5)
                assert flt is None or h.metadata["g"] == 2
    # deleted documents are never answered, new ones are (scored exactly beside the index)
    best = approx.search(queries[:1], k=1)[0][0].id
    new = {"indices": queries[0]["indices"], "values": [100.0] * len(queries[0]["indices"])}
    for c in (approx, exact):
        c.delete([best])
        c.add(["new"], [new])
        c.commit()
    hits = approx.search(queries[:1], k=5)[0]
    assert hits[0].id == "new" and best not in {h.id for h in hits}
    with open_collection(approx.data_dir, "approx") as again:  # reopened: built again from the stored rows
        assert again.search(queries[:1], k=1)[0][0].id == "new"


def test_milvus_lite_sparse_search_equals_the_exact_faiss_search(tmp_path):
    """The same random rows, upserts and deletes in an exact FAISS sparse collection and in
    Milvus Lite: the same top k (every hit scores > 0 here: Milvus answers documents that share
    a token with the query), scores within float32 tolerance, with and without a filter; the
    same rows read back and the same bytes per document; after compaction and a reopen too."""
    rng = np.random.default_rng(21)
    ids = [f"d{i}" for i in range(300)]
    rows, meta = _rows(rng, 300, 5, 40), [{"g": i % 3} for i in range(300)]
    again, queries = _rows(rng, 30, 5, 40), _rows(rng, 12, 5, 30)
    colls = {"faiss": open_collection(tmp_path / "f", "sp", _spec()),
             "milvus": open_collection(tmp_path, "sp", _spec(), backend="milvus", milvus_uri=str(tmp_path / "m.db"))}
    try:
        for c in colls.values():
            c.add(ids, rows, texts=ids, metadata=meta)
            c.commit()
            c.add(ids[:30], again, metadata=meta[:30])
            c.delete(ids[100:120])
            c.commit()
        assert colls["milvus"].stats()["index_type"] == "SPARSE_INVERTED_INDEX"
        def same_top_k():
            for flt in (None, {"g": 1}):
                for k in (1, 10):
                    want = colls["faiss"].search(queries, k=k, filter=flt)
                    got = colls["milvus"].search(queries, k=k, filter=flt)
                    for w, g in zip(want, got):
                        assert len(g) == k and w[-1].score > 0
                        assert [h.id for h in g] == [h.id for h in w]
                        np.testing.assert_allclose([h.score for h in g], [h.score for h in w], rtol=1e-5)

        same_top_k()
        for i in ("d0", "d5", "d299"):
            a, b = colls["faiss"].get(i)["vector"], colls["milvus"].get(i)["vector"]
            assert a["indices"].tolist() == b["indices"].tolist()
            np.testing.assert_array_equal(a["values"], b["values"])
        assert colls["milvus"].stats()["bytes_per_doc"] == pytest.approx(colls["faiss"].stats()["bytes_per_doc"])
        for c in colls.values():
            c.compact()
        colls["milvus"].close()
        colls["milvus"] = open_collection(tmp_path, "sp", backend="milvus", milvus_uri=str(tmp_path / "m.db"))
        assert len(colls["milvus"]) == 280
        same_top_k()
    finally:
        for c in colls.values():
            c.close()


def test_seismic_is_refused_on_milvus_naming_the_factory(tmp_path):
    """Milvus searches a sparse collection by its own inverted index: ``auto`` and ``exact``;
    Seismic is the FAISS backend's, refused before anything is made."""
    uri = str(tmp_path / "m.db")
    with pytest.raises(InvalidError, match="Seismic runs on the FAISS backend only.*use 'auto' or 'exact'") as e:
        open_collection(tmp_path, "sp", _spec("seismic:query_cut=5"), backend="milvus", milvus_uri=uri)
    assert e.value.param == "factory"
    assert not (tmp_path / "m.db").exists()
