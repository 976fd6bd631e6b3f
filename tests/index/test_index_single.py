"""Single-vector collections: persistence, upsert/delete, FAISS factories, bad input."""

import json

import numpy as np
import pytest

from embedpool.errors import ConflictError, InvalidError, NotFoundError
from embedpool.index import (
    CollectionSpec,
    FORMAT_VERSION,
    FaissCollection,
    delete_collection,
    list_collections,
)
from index_testutil import managed_files, rand_unit

DIM = 16
SPEC = CollectionSpec(kind="single", model="all-MiniLM-L6-v2", pooler="mean", dim=DIM)


def _fill(coll, rng, n=40, prefix="d"):
    x = rand_unit(rng, n, DIM)
    ids = [f"{prefix}{i}" for i in range(n)]
    coll.add(ids, x, texts=[f"text {i}" for i in ids], metadata=[{"n": i} for i in range(n)])
    return ids, x


def _snapshot(coll, queries):
    return coll.ids(), [[(h.id, round(h.score, 5), h.text, h.metadata) for h in r]
                        for r in coll.search(queries, k=5)]


def test_round_trip_save_open_equality(coll_dir, rng):
    coll = FaissCollection.create(coll_dir, "c", SPEC)
    ids, x = _fill(coll, rng)
    coll.commit()
    q = rand_unit(rng, 6, DIM)
    before = _snapshot(coll, q)
    coll.close()
    coll = FaissCollection.open(coll_dir, "c")
    assert _snapshot(coll, q) == before
    assert len(coll) == 40 and coll.ids() == ids
    doc = coll.get("d7")
    np.testing.assert_array_equal(doc["vector"], x[7])
    assert doc["text"] == "text d7" and doc["metadata"] == {"n": 7}
    top = coll.search(x[3:4], k=1)[0][0]
    assert top.id == "d3" and top.score == pytest.approx(1.0, abs=1e-5)
    m = json.loads((coll_dir / "c" / "manifest.json").read_text())
    assert m["format_version"] == FORMAT_VERSION and m["kind"] == "single" and m["model"] == "all-MiniLM-L6-v2"
    assert m["pooler"] == "mean" and m["dim"] == DIM and m["metric"] == "ip" and m["normalized"] is True
    assert m["factory"] == "IDMap2,Flat" and m["counts"] == {"documents": 40, "vectors": 40}
    assert coll.manifest["counts"]["documents"] == 40
    st = coll.stats()
    assert st["documents"] == 40 and st["bytes_on_disk"] > 40 * DIM * 4
    assert st["bytes_per_doc"] >= DIM * 4
    coll.close()


def test_upsert_replaces(coll_dir, rng):
    coll = FaissCollection.create(coll_dir, "c", SPEC)
    ids, x = _fill(coll, rng)
    coll.commit()
    new = rand_unit(rng, 1, DIM)
    coll.add(["d5"], new, texts=["replaced"], metadata=[{"v": 2}])
    for c in (coll, None):
        if c is None:
            coll.commit()
            coll.close()
            c = coll = FaissCollection.open(coll_dir, "c")
        assert len(c) == 40
        hits = c.search(new, k=3)[0]
        assert hits[0].id == "d5" and hits[0].text == "replaced" and hits[0].metadata == {"v": 2}
        assert hits[0].score == pytest.approx(1.0, abs=1e-5)
        # the old vector no longer finds d5
        assert all(h.id != "d5" or h.score < 0.99 for h in c.search(x[5:6], k=40)[0])
        np.testing.assert_array_equal(c.get("d5")["vector"], new[0])
    coll.close()


def test_delete_removes_from_results(coll_dir, rng):
    coll = FaissCollection.create(coll_dir, "c", SPEC)
    ids, x = _fill(coll, rng)
    coll.delete(["d1", "d2"])
    assert "d1" not in coll and len(coll) == 38
    assert all(h.id not in ("d1", "d2") for h in coll.search(x[1:3], k=40)[0])
    coll.commit()
    coll.close()
    coll = FaissCollection.open(coll_dir, "c")
    assert len(coll) == 38 and "d1" not in coll.ids()
    assert all(h.id not in ("d1", "d2") for r in coll.search(x[1:3], k=40) for h in r)
    with pytest.raises(NotFoundError) as e:
        coll.get("d1")
    assert isinstance(e.value, LookupError) and e.value.kind.value == "not_found"
    coll.close()


def test_delete_unknown_id_changes_nothing(coll_dir, rng):
    coll = FaissCollection.create(coll_dir, "c", SPEC)
    _fill(coll, rng)
    coll.commit()
    with pytest.raises(NotFoundError, match="nope"):
        coll.delete(["d0", "nope"])
    assert "d0" in coll and len(coll) == 40
    coll.close()


def test_uncommitted_changes_are_discarded_on_close(coll_dir, rng):
    coll = FaissCollection.create(coll_dir, "c", SPEC)
    _fill(coll, rng)
    coll.commit()
    _fill(coll, rng, n=5, prefix="late")
    coll.delete(["d0"])
    assert len(coll) == 44
    coll.close()
    coll = FaissCollection.open(coll_dir, "c")
    assert len(coll) == 40 and "d0" in coll and "late0" not in coll
    coll.close()


@pytest.mark.parametrize("change", [
    {"dim": DIM + 1}, {"kind": "multi"}, {"model": "other-model"}, {"pooler": "cls"},
    {"factory": "HNSW32"},
])
def test_manifest_mismatch_refused_and_data_unchanged(coll_dir, rng, change):
    coll = FaissCollection.create(coll_dir, "c", SPEC)
    _fill(coll, rng)
    coll.commit()
    q = rand_unit(rng, 3, DIM)
    before = _snapshot(coll, q)
    coll.close()
    other = CollectionSpec(**{**SPEC.to_dict(), **change})
    field = next(iter(change))
    with pytest.raises(ConflictError, match=field):
        FaissCollection.create(coll_dir, "c", other)
    with pytest.raises(ConflictError):
        FaissCollection.open_or_create(coll_dir, "c", other)
    coll = FaissCollection.open_or_create(coll_dir, "c", SPEC)  # same spec: returns the existing one
    assert _snapshot(coll, q) == before
    coll.close()


def test_add_mismatch_and_bad_input_change_nothing(coll_dir, rng):
    coll = FaissCollection.create(coll_dir, "c", SPEC)
    _fill(coll, rng)
    coll.commit()
    q = rand_unit(rng, 3, DIM)
    before = _snapshot(coll, q)
    good = rand_unit(rng, 2, DIM)
    nan = good.copy()
    nan[1, 3] = np.nan
    inf = good.copy()
    inf[0, 0] = np.inf
    cases = [
        (ConflictError, "dimension", dict(ids=["n0", "n1"], vectors=rand_unit(rng, 2, DIM + 2))),
        (ConflictError, "model", dict(ids=["n0", "n1"], vectors=good, model="bge-small")),
        (ConflictError, "pooler", dict(ids=["n0", "n1"], vectors=good, pooler="cls")),
        (ConflictError, "single-vector", dict(ids=["n0", "n1"], vectors=[good, good])),
        (ConflictError, "norm", dict(ids=["n0", "n1"], vectors=good * 3)),
        (InvalidError, "NaN", dict(ids=["n0", "n1"], vectors=nan)),
        (InvalidError, "NaN or infinity", dict(ids=["n0", "n1"], vectors=inf)),
        (InvalidError, "duplicate ids.*'n0'", dict(ids=["n0", "n0"], vectors=good)),
        (InvalidError, "2 ids but 3 vectors", dict(ids=["n0", "n1"], vectors=rand_unit(rng, 3, DIM))),
        (InvalidError, "JSON", dict(ids=["n0", "n1"], vectors=good, metadata=[{"x": object()}, None])),
        (InvalidError, "non-empty strings", dict(ids=["n0", 5], vectors=good)),
    ]
    for err, msg, kw in cases:
        with pytest.raises(err, match=msg):
            coll.add(**kw)
        assert isinstance(err("x"), ValueError)
    # each error names the argument at fault (what the HTTP layer reports as `param`); in metadata,
    # the path of the value at fault
    params = []
    for kw in (dict(ids=["n0", "n0"], vectors=good), dict(ids=["n0", "n1"], vectors=nan),
               dict(ids=["n0", "n1"], vectors=good, metadata=[{"x": object()}, None]),
               dict(ids=["n0", "n1"], vectors=good, pooler="cls")):
        with pytest.raises((InvalidError, ConflictError)) as e:
            coll.add(**kw)
        params.append(e.value.param)
    assert params == ["ids", "vectors", "metadata.x", "pooler"]
    assert _snapshot(coll, q) == before
    coll.commit()
    coll.close()
    coll = FaissCollection.open(coll_dir, "c")
    assert _snapshot(coll, q) == before
    with pytest.raises(ConflictError, match="dimension"):
        coll.search(rand_unit(rng, 1, DIM + 1))
    coll.close()


def test_hnsw_delete_filters_then_compact_rebuilds(coll_dir, rng):
    coll = FaissCollection.create(coll_dir, "h", CollectionSpec(kind="single", dim=DIM, factory="HNSW32"))
    ids, x = _fill(coll, rng, n=200)
    coll.commit()
    gone = [f"d{i}" for i in range(0, 200, 2)]
    coll.delete(gone)
    coll.add(["d1"], rand_unit(rng, 1, DIM))  # upsert: the old d1 vector becomes a tombstone
    assert coll.stats()["tombstones"] == 101
    hits = coll.search(x[:20], k=10)
    assert all(len(r) == 10 for r in hits)
    assert not {h.id for r in hits for h in r} & set(gone)
    coll.commit()
    coll.close()
    coll = FaissCollection.open(coll_dir, "h")
    assert coll.stats()["tombstones"] == 101 and len(coll) == 100
    hits = coll.search(x[:20], k=10)
    assert all(len(r) == 10 for r in hits) and not {h.id for r in hits for h in r} & set(gone)
    assert coll.search(x[3:4], k=1)[0][0].id == "d3"
    coll.compact()
    st = coll.stats()
    assert st["tombstones"] == 0 and st["documents"] == 100
    coll.close()
    coll = FaissCollection.open(coll_dir, "h")
    assert coll._vec.index.ntotal == 100 and coll.stats()["tombstones"] == 0
    assert coll.search(x[5:6], k=1)[0][0].id == "d5"
    assert managed_files(coll_dir / "h") == {coll._vec.file}
    coll.close()


def test_ivfpq_needs_enough_vectors_for_training(coll_dir, rng):
    spec = CollectionSpec(kind="single", dim=DIM, factory="IVF8,PQ4")
    coll = FaissCollection.create(coll_dir, "ivf", spec)
    with pytest.raises(InvalidError, match=r"at least 256 vectors.*has 100"):
        coll.add([f"d{i}" for i in range(100)], rand_unit(rng, 100, DIM))
    assert len(coll) == 0
    x = rand_unit(rng, 600, DIM)
    coll.add([f"d{i}" for i in range(600)], x)
    coll.add(["extra"], rand_unit(rng, 1, DIM))  # once trained, small batches are fine
    coll.delete(["d0"])
    coll.commit()
    coll.close()
    coll = FaissCollection.open(coll_dir, "ivf")
    assert len(coll) == 600 and "d0" not in coll
    hits = coll.search(x[1:11], k=5)
    assert np.mean([r[0].id == f"d{i + 1}" for i, r in enumerate(hits)]) >= 0.8  # PQ is approximate
    assert coll.get("d5")["vector"].shape == (DIM,)
    coll.close()


def test_bad_factory_is_refused(coll_dir):
    with pytest.raises(InvalidError, match="factory"):
        FaissCollection.create(coll_dir, "bad", CollectionSpec(kind="single", dim=DIM, factory="NoSuch99"))
    assert list_collections(coll_dir) == []


def test_not_a_collection_and_newer_format(coll_dir, rng):
    (coll_dir / "junk").mkdir(parents=True)
    (coll_dir / "junk" / "file.txt").write_text("hi")
    with pytest.raises(ConflictError, match="not an embedpool collection"):
        FaissCollection.open(coll_dir, "junk")
    with pytest.raises(ConflictError):
        FaissCollection.create(coll_dir, "junk", SPEC)
    with pytest.raises(NotFoundError, match="no collection 'missing'"):
        FaissCollection.open(coll_dir, "missing")
    coll = FaissCollection.create(coll_dir, "c", SPEC)
    _fill(coll, rng)
    coll.commit()
    coll.close()
    path = coll_dir / "c" / "manifest.json"
    m = json.loads(path.read_text())
    m["format_version"] = 99
    path.write_text(json.dumps(m))
    with pytest.raises(ConflictError, match="upgrade"):
        FaissCollection.open(coll_dir, "c")
    path.write_text("{not json")
    with pytest.raises(ConflictError):
        FaissCollection.open(coll_dir, "c")
    with pytest.raises(InvalidError, match="invalid collection name"):
        FaissCollection.open(coll_dir, "../etc")


def test_list_and_delete_collections(coll_dir, rng):
    for name in ("b", "a"):
        FaissCollection.create(coll_dir, name, SPEC).close()
    (coll_dir / "junk").mkdir()
    assert list_collections(coll_dir) == ["a", "b"]
    delete_collection(coll_dir, "a")
    assert list_collections(coll_dir) == ["b"]
    with pytest.raises(NotFoundError):
        delete_collection(coll_dir, "a")
    with pytest.raises(ConflictError):
        delete_collection(coll_dir, "junk")
    assert list_collections(coll_dir / "nowhere") == []


def test_one_writer_at_a_time(coll_dir, rng):
    a = FaissCollection.create(coll_dir, "c", SPEC)
    b = FaissCollection.open(coll_dir, "c")
    _fill(a, rng, n=5)
    with pytest.raises(ConflictError, match="one writer"):
        b.add(["x"], rand_unit(rng, 1, DIM))
    assert len(b) == 0  # b sees the committed state only
    a.commit()
    with pytest.raises(ConflictError, match="open it again"):
        b.add(["x"], rand_unit(rng, 1, DIM))
    b.close()
    b = FaissCollection.open(coll_dir, "c")
    assert len(b) == 5
    b.add(["x"], rand_unit(rng, 1, DIM))
    b.commit()
    a.close()
    b.close()


def test_refresh_picks_up_another_writers_commit(coll_dir, rng):
    writer = FaissCollection.create(coll_dir, "c", SPEC)
    reader = FaissCollection.open(coll_dir, "c")
    ids, x = _fill(writer, rng, n=10)
    assert reader.refresh() is False and len(reader) == 0
    writer.commit()
    assert reader.refresh() is True
    assert len(reader) == 10 and reader.search(x[2:3], k=1)[0][0].id == "d2"
    writer.close()
    reader.close()
