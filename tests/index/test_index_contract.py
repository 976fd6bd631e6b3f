"""The storage contract, run over every backend: a FAISS folder and Milvus Lite (the real engine
in a temp .db; no mocks). Each test states one rule of :class:`embedpool.index.CollectionBase`
and checks that both backends keep it the same way -- the same answers, the same errors, the
same ``stats()`` keys -- so ``app/`` never needs to know which one it holds."""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest

from embedpool.index import (
    STATS_KEYS,
    Collection,
    CollectionBase,
    CollectionNotFoundError,
    CollectionSpec,
    DocumentNotFoundError,
    InvalidInputError,
    SpecMismatchError,
    delete_collection,
    list_collections,
    open_collection,
    read_collection_manifest,
)
from index_testutil import rand_docs, rand_unit

pytest.importorskip("milvus_lite")
from embedpool.index.milvus import ClientPool, MilvusCollection  # noqa: E402

DIM = 8
SINGLE = CollectionSpec(kind="single", model="m", pooler="mean", dim=DIM)
MULTI = CollectionSpec(kind="multi", model="m", pooler="tokens", dim=DIM, token_factory="Flat")
CONTRACT = {"add", "delete", "commit", "compact", "build_token_index", "get_property", "set_property",
            "get", "ids", "stats", "__len__", "__contains__", "refresh", "close"}


@pytest.fixture(scope="module")
def milvus_uri(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("contract") / "c.db")
    anchor = ClientPool.acquire(path, None)  # keep the engine up between tests
    yield path
    ClientPool.release(anchor)


@pytest.fixture(params=["faiss", "milvus"])
def where(request, tmp_path, milvus_uri):
    """``open_collection`` keyword arguments of one backend (a fresh FAISS folder per test; Milvus
    collections are dropped after it)."""
    kw = {"backend": request.param}
    if request.param == "milvus":
        kw["milvus_uri"] = milvus_uri
    yield {"data_dir": tmp_path / "data", **kw}
    if request.param == "milvus":
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
    for method in ("search", "candidate_ids", "manifest", "__enter__", "__exit__"):
        assert hasattr(CollectionBase, method)
    for cls in (Collection, MilvusCollection):
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
        with pytest.raises(DocumentNotFoundError, match="nothing was deleted"):
            coll.delete(["d1", "nope"])
        coll.delete(["d1", "d1"])  # duplicates in a delete are one delete
        assert "d1" not in coll and len(coll) == 11
        with pytest.raises(DocumentNotFoundError):
            coll.get("d1")
        with pytest.raises(SpecMismatchError, match="dimension"):
            coll.add(["z"], rand_unit(np.random.default_rng(1), 1, DIM + 1))
        with pytest.raises(InvalidInputError, match="duplicate"):
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
    with pytest.raises(InvalidInputError, match="closed"):
        coll.search(x[:1], k=1)


def test_multi_vector_search_modes_agree(where):
    comp = _open(where, "comp", SINGLE)
    coll = _open(where, "mv", CollectionSpec(**{**MULTI.to_dict(), "companion": "comp"}))
    try:
        ids, docs = _fill(coll)
        comp.add(ids, np.stack([d.mean(0) / np.linalg.norm(d.mean(0)) for d in docs]))
        comp.commit()
        coll.commit()
        q = [docs[4], docs[7]]
        cq = np.stack([d.mean(0) / np.linalg.norm(d.mean(0)) for d in q])
        for mode in ("exhaustive", "tokens", "two_stage"):
            hits = coll.search(q, k=2, mode=mode, companion_queries=cq, k_token=4, candidates=5)
            assert [h[0].id for h in hits] == ["d4", "d7"], mode
        assert coll.capabilities.supports_token_ann and not comp.capabilities.supports_token_ann
        coll.build_token_index()
        with pytest.raises(InvalidInputError, match="multi-vector collections only"):
            comp.build_token_index()
        assert coll.get("d4")["vectors"].shape == docs[4].shape
    finally:
        coll.close()
        comp.close()


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
        with pytest.raises(InvalidInputError, match="reserved"):
            again.set_property("embedpool.manifest", "{}")
        with pytest.raises(InvalidInputError, match="reserved"):
            again.set_property("", "x")
        with pytest.raises(InvalidInputError, match="strings"):
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
        with pytest.raises(CollectionNotFoundError):
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
    with pytest.raises(CollectionNotFoundError, match="no collection 'absent'"):
        read_collection_manifest(data_dir, "absent", **kw)
