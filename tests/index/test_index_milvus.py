"""Milvus backend against Milvus Lite (the real engine in a temp .db; no mocks).

One Milvus Lite database serves the module (an open "anchor" connection keeps its engine up, so
closing and reopening a collection is cheap); ``test_reopen_after_engine_restart`` uses its own
database and checks the engine really stops and restarts. The module's teardown checks that no
Milvus Lite engine is left running.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import milvus_lite  # noqa: F401 -- dependencies: if one is missing these tests must fail, not vanish
import pymilvus  # noqa: F401

from embedpool.errors import ConflictError, InvalidError, NotFoundError, UnavailableError
from embedpool.index import (
    MAX_METADATA_BYTES,
    CollectionSpec,
    FORMAT_VERSION,
    FaissCollection,
    MilvusCollection,
    delete_collection,
    list_collections,
    open_collection,
)
from embedpool.index.milvus import MANIFEST_KEY, ClientPool, embedpool_name, milvus_index, milvus_name  # noqa: E402
from index_testutil import rand_docs, rand_unit, unit  # noqa: E402

DIM = 16
SPEC = CollectionSpec(kind="single", model="all-MiniLM-L6-v2", pooler="mean", dim=DIM)
FIXTURE = Path(__file__).parent / "data" / "scifact_minilm_mean_200.npz"


def _lite_servers() -> dict:
    from milvus_lite.server_manager import server_manager_instance

    return dict(server_manager_instance._servers)


@pytest.fixture(scope="module")
def uri(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("milvus") / "test.db")
    anchor = ClientPool.acquire(path, None)  # keep the engine up for the whole module
    yield path
    ClientPool.release(anchor)
    assert not any(p.startswith(str(Path(path).parent)) for p in _lite_servers()), \
        "Milvus Lite engine still running after the last collection closed"


@pytest.fixture
def mv(uri, request):
    """Open-or-create a Milvus collection named after the test; closed and dropped afterwards."""
    made = []

    def make(name="c", spec=SPEC):
        full = re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)[:60] + f"-{name}"
        coll = open_collection("unused", full, spec, backend="milvus", milvus_uri=uri)
        made.append(coll)
        return coll

    yield make
    for coll in made:
        coll.close()
        try:
            delete_collection("unused", coll.name, backend="milvus", milvus_uri=uri)
        except NotFoundError:
            pass


def _fill(coll, rng, n=40, prefix="d"):
    x = rand_unit(rng, n, DIM)
    ids = [f"{prefix}{i}" for i in range(n)]
    coll.add(ids, x, texts=[f"text {i}" for i in ids], metadata=[{"n": i} for i in range(n)])
    return ids, x


# ---- single-vector --------------------------------------------------------------------------
def test_create_add_search_with_metadata(mv, rng):
    coll = mv()
    assert isinstance(coll, MilvusCollection) and coll.backend == "milvus"
    ids, x = _fill(coll, rng)
    hits = coll.search(x[:3], k=5)
    assert [r[0].id for r in hits] == ["d0", "d1", "d2"]
    top = hits[1][0]
    assert top.score == pytest.approx(1.0, abs=1e-5) and top.text == "text d1" and top.metadata == {"n": 1}
    assert all(len(r) == 5 and r[0].score >= r[-1].score for r in hits)
    assert len(coll) == 40 and coll.ids() == ids and "d7" in coll and "nope" not in coll
    doc = coll.get("d7")
    np.testing.assert_allclose(doc["vector"], x[7], rtol=0, atol=1e-7)
    assert doc["text"] == "text d7" and doc["metadata"] == {"n": 7}
    coll.add(["plain"], rand_unit(rng, 1, DIM))  # text and metadata are optional
    assert coll.get("plain")["text"] is None and coll.get("plain")["metadata"] is None


def test_upsert_replaces(mv, rng):
    coll = mv()
    ids, x = _fill(coll, rng)
    new = rand_unit(rng, 1, DIM)
    coll.add(["d3"], new, texts=["replaced"], metadata=[{"v": 2}])
    assert len(coll) == 40 and coll.ids()[-1] == "d3"  # a replaced document moves to the end
    top = coll.search(new, k=1)[0][0]
    assert (top.id, top.text, top.metadata) == ("d3", "replaced", {"v": 2})
    assert "d3" not in [h.id for h in coll.search(x[3:4], k=3)[0][:1]]


def test_delete_removes_and_unknown_id_changes_nothing(mv, rng):
    coll = mv()
    ids, x = _fill(coll, rng)
    coll.delete(["d5", "d6"])
    assert len(coll) == 38 and "d5" not in coll
    assert all(h.id not in ("d5", "d6") for h in coll.search(x[5:7], k=10)[0])
    with pytest.raises(NotFoundError, match="nothing was deleted"):
        coll.delete(["d7", "missing"])
    assert "d7" in coll and len(coll) == 38
    with pytest.raises(NotFoundError):
        coll.get("d5")


def test_bad_input_is_refused(mv, rng):
    coll = mv()
    with pytest.raises(ConflictError, match="dimension"):
        coll.add(["a"], rand_unit(rng, 1, DIM + 1))
    bad = rand_unit(rng, 2, DIM)
    bad[1, 0] = np.nan
    with pytest.raises(InvalidError, match="NaN"):
        coll.add(["a", "b"], bad)
    with pytest.raises(InvalidError, match="duplicate"):
        coll.add(["a", "a"], rand_unit(rng, 2, DIM))
    with pytest.raises(ConflictError, match="model"):
        coll.add(["a"], rand_unit(rng, 1, DIM), model="other-model")
    with pytest.raises(InvalidError, match="bytes"):
        coll.add(["a"], rand_unit(rng, 1, DIM), texts=["x" * 70_000])
    assert len(coll) == 0


def test_metadata_over_a_milvus_json_field_is_refused_before_anything_is_written(mv, rng, tmp_path):
    """A Milvus JSON field holds 65,536 bytes (Milvus Lite stores more, a server refuses it): the
    Milvus backend refuses more on both, measured as stored (with the instants of its dates), and
    writes nothing of the batch; a FAISS folder stores it."""
    coll = mv()
    at_limit = {"s": "x" * (MAX_METADATA_BYTES - len('{"s":""}'))}
    dated = {"d": "2024-01-31", "s": at_limit["s"][:-20]}  # fits as sent, not with its date's instant
    assert len(json.dumps(at_limit, separators=(",", ":"))) == MAX_METADATA_BYTES
    coll.add(["fits"], rand_unit(rng, 1, DIM), metadata=[at_limit])
    assert coll.get("fits")["metadata"] == at_limit
    for too_big in ({"s": at_limit["s"] + "x"}, dated):
        with pytest.raises(InvalidError, match="65,536") as e:
            coll.add(["ok", "big"], rand_unit(rng, 2, DIM), metadata=[{"v": 1}, too_big])
        assert "id 'big'" in e.value.message
        assert len(coll) == 1 and "ok" not in coll
    with FaissCollection.open_or_create(tmp_path, "f", SPEC) as faiss_coll:
        faiss_coll.add(["big"], rand_unit(rng, 1, DIM), metadata=[{"s": "x" * 200_000}])
        assert faiss_coll.get("big")["metadata"] == {"s": "x" * 200_000}


@pytest.mark.parametrize("factory", ["HNSW32", "IVF8,Flat", "IVF8,SQ8"])
def test_ann_factories(mv, rng, factory):
    coll = mv(spec=CollectionSpec(kind="single", dim=DIM, factory=factory))
    ids, x = _fill(coll, rng, n=320)  # >= 39 per IVF centroid: no FAISS training warning
    index_type, params, _ = milvus_index(factory)
    built = coll._client.describe_index(coll._mname, "vector")
    assert (built["index_type"], built["params"]) == (index_type, params)  # M / nlist reach Milvus
    found = [r[0].id for r in coll.search(x[:20], k=5)]
    assert sum(f == i for f, i in zip(found, ids[:20])) >= 18


def test_factory_mapping():
    assert milvus_index("IDMap2,Flat") == ("FLAT", {}, {})
    assert milvus_index("HNSW32") == ("HNSW", {"M": 32, "efConstruction": 40}, {"ef": 64})
    assert milvus_index("IVF256,Flat") == ("IVF_FLAT", {"nlist": 256}, {"nprobe": 64})
    assert milvus_index("IVF64,PQ16x8")[:2] == ("IVF_PQ", {"nlist": 64, "m": 16, "nbits": 8})
    with pytest.raises(InvalidError, match="no Milvus equivalent"):
        milvus_index("PCA32,Flat")
    for name in ("a", "scifact-mean", "x_y.z-1"):
        assert embedpool_name(milvus_name(name)) == name
    assert embedpool_name("someone_elses") is None


# ---- manifest -------------------------------------------------------------------------------
def test_manifest_travels_and_mismatch_refused(mv, uri, rng):
    coll = mv()
    _fill(coll, rng, n=5)
    coll.commit()
    m = coll.manifest
    assert m["format"] == "embedpool-collection" and m["backend"] == "milvus"
    assert (m["kind"], m["model"], m["pooler"], m["dim"]) == ("single", "all-MiniLM-L6-v2", "mean", DIM)
    assert m["counts"] == {"documents": 5, "vectors": 5}
    for other in (CollectionSpec(kind="single", model="all-MiniLM-L6-v2", pooler="cls", dim=DIM),
                  CollectionSpec(kind="single", model="all-MiniLM-L6-v2", pooler="mean", dim=8),
                  CollectionSpec(kind="multi", model="all-MiniLM-L6-v2", pooler="mean", dim=DIM)):
        with pytest.raises(ConflictError, match="different spec"):
            open_collection("unused", coll.name, other, backend="milvus", milvus_uri=uri)
    same = open_collection("unused", coll.name, SPEC, backend="milvus", milvus_uri=uri)
    assert len(same) == 5
    same.close()
    coll._client.alter_collection_properties(
        coll._mname, properties={MANIFEST_KEY: coll._client.describe_collection(coll._mname)
                                 ["properties"][MANIFEST_KEY].replace(f'"format_version": {FORMAT_VERSION}', '"format_version": 99')})
    with pytest.raises(ConflictError, match="newer"):
        open_collection("unused", coll.name, backend="milvus", milvus_uri=uri)


def test_properties_travel_with_the_collection(mv, uri, rng):
    """Side state (the indexing job's) is stored with the collection, survives a reopen and
    cannot overwrite the manifest."""
    coll = mv()
    _fill(coll, rng, n=3)
    assert coll.get_property("embedpool.indexjob") is None
    coll.set_property("embedpool.indexjob", '{"committed_records": 3}')
    coll.commit()  # rewrites the manifest property: other properties stay
    again = open_collection("unused", coll.name, backend="milvus", milvus_uri=uri)
    try:
        assert again.get_property("embedpool.indexjob") == '{"committed_records": 3}'
    finally:
        again.close()
    with pytest.raises(InvalidError, match="reserved"):
        coll.set_property(MANIFEST_KEY, "{}")
    with pytest.raises(InvalidError, match="strings"):
        coll.set_property("embedpool.indexjob", 3)
    assert coll.manifest["kind"] == "single" and len(coll) == 3

def test_foreign_and_missing_collections(uri, mv):
    from pymilvus import MilvusClient

    client = MilvusClient(uri)
    client.create_collection(milvus_name("foreign"), dimension=4)  # no embedpool manifest
    try:
        with pytest.raises(ConflictError, match="no embedpool manifest"):
            open_collection("unused", "foreign", backend="milvus", milvus_uri=uri)
        mv("listed")
        names = list_collections("unused", backend="milvus", milvus_uri=uri)
        assert "foreign" not in names and any(n.endswith("-listed") for n in names)
        with pytest.raises(NotFoundError, match="no collection 'absent'"):
            open_collection("unused", "absent", backend="milvus", milvus_uri=uri)
    finally:
        client.drop_collection(milvus_name("foreign"))


def test_reopen_after_engine_restart(tmp_path, rng):
    path = str(tmp_path / "own.db")
    kw = dict(backend="milvus", milvus_uri=path)
    coll = open_collection(tmp_path, "c", SPEC, **kw)
    ids, x = _fill(coll, rng)
    coll.delete(["d1"])
    coll.commit()
    q = rand_unit(rng, 4, DIM)
    before = [[(h.id, round(h.score, 5), h.text, h.metadata) for h in r] for r in coll.search(q, k=5)]
    coll.close()
    assert str(Path(path).resolve()) not in _lite_servers()  # engine stopped with the last close
    coll = open_collection(tmp_path, "c", **kw)
    assert coll.spec == SPEC and len(coll) == 39 and coll.ids() == [i for i in ids if i != "d1"]
    assert [[(h.id, round(h.score, 5), h.text, h.metadata) for h in r] for r in coll.search(q, k=5)] == before
    coll.close()
    assert str(Path(path).resolve()) not in _lite_servers()


def test_engine_death_fails_clearly_then_recovers(tmp_path, rng):
    """The Milvus Lite engine behind a .db (milvus-lite 3 runs it in this process, as a gRPC
    server) dies under an open collection: calls fail with a UnavailableError that says Milvus is
    unreachable; the next call starts a new engine for the same file, and the collection --
    loaded again -- answers as before. No restart of the process, no reopening by the caller."""
    path = str(tmp_path / "dies.db")
    coll = open_collection(tmp_path, "c", SPEC, backend="milvus", milvus_uri=path)
    try:
        ids, x = _fill(coll, rng)
        coll.commit()
        before = _ranked(coll.search(x[:3], k=5))
        server = _lite_servers()[str(Path(path).resolve())][0]
        server.stop(grace=0).wait(10)  # the engine's gRPC server is gone
        with pytest.raises(UnavailableError, match=r"Milvus at .*dies\.db is unreachable"):
            coll.search(x[:3], k=5)
        assert _ranked(coll.search(x[:3], k=5)) == before  # a new engine, the same data
        assert len(coll) == 40 and coll.get("d7")["text"] == "text d7"
        coll.add(["after"], rand_unit(rng, 1, DIM))
        assert "after" in coll
    finally:
        coll.close()
    assert str(Path(path).resolve()) not in _lite_servers()


def test_unreachable_server_is_a_backend_error():
    with pytest.raises(UnavailableError, match="cannot connect"):
        MilvusCollection.open("http://127.0.0.1:9", "c")


# ---- same results as FAISS ------------------------------------------------------------------
def _ranked(hits):
    return [[(h.id, h.score) for h in r] for r in hits]


def _assert_same_ranking(a, b, tol=1e-5):
    """Same ids in the same order, except where neighbours' scores tie within ``tol``."""
    for ra, rb in zip(a, b):
        assert len(ra) == len(rb)
        for (ia, sa), (ib, sb) in zip(ra, rb):
            assert sa == pytest.approx(sb, abs=tol)
            if ia != ib:  # a tie: the two ids must swap with equal scores
                assert dict(ra).get(ib, -9) == pytest.approx(sb, abs=tol)


def test_scifact_top10_equal_faiss_flat_and_milvus_flat(mv, tmp_path):
    """Mean-pooled MiniLM vectors of 200 SciFact documents and 40 test queries (fixture made by
    bench/scifact_data.py:write_test_fixture)."""
    z = np.load(FIXTURE)
    docs = z["docs"].astype(np.float32)
    docs /= np.linalg.norm(docs, axis=1, keepdims=True)
    queries = z["queries"].astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    ids = [str(i) for i in z["doc_ids"]]
    spec = CollectionSpec(kind="single", model="all-MiniLM-L6-v2", pooler="mean", dim=384)
    faiss_coll = open_collection(tmp_path, "flat", spec)  # backend="faiss" by default
    assert isinstance(faiss_coll, FaissCollection) and spec.factory == "IDMap2,Flat"
    milvus_coll = mv("flat", spec)
    assert milvus_coll.stats()["index_type"] == "FLAT"
    for coll in (faiss_coll, milvus_coll):
        coll.add(ids, docs)
    a, b = _ranked(faiss_coll.search(queries, k=10)), _ranked(milvus_coll.search(queries, k=10))
    _assert_same_ranking(a, b)
    assert sum([i for i, _ in x] == [i for i, _ in y] for x, y in zip(a, b)) >= 38  # ties aside
    faiss_coll.close()


# ---- multi-vector ---------------------------------------------------------------------------
@pytest.fixture
def multi_pair(mv, tmp_path, rng):
    """The same documents in a FAISS and a Milvus multi-vector collection (exact token index),
    each keeping a mean-pooled companion."""

    def make(precision="float32"):
        docs = rand_docs(rng, 60, DIM, lo=2, hi=10)
        ids = [f"d{i}" for i in range(60)]
        pooled = rand_unit(rng, 60, DIM) * 0.2 + np.stack([d.mean(0) for d in docs])
        pooled /= np.linalg.norm(pooled, axis=1, keepdims=True)
        multi = CollectionSpec(kind="multi", dim=DIM, precision=precision, token_factory="Flat",
                               companion_pooler="mean", companion_dim=DIM)
        out = {}
        for backend, open_ in (("faiss", lambda n, s: open_collection(tmp_path, n, s)),
                               ("milvus", mv)):
            m = open_(f"multi-{precision}", multi)
            m.add(ids, docs, texts=[f"t{i}" for i in ids], metadata=[{"i": i} for i in range(60)], companion=pooled)
            out[backend] = m
        q = [d[: max(1, len(d) // 2)] + 0.05 * rand_unit(rng, max(1, len(d) // 2), DIM)
             for d in (docs[3], docs[17], docs[42])]
        cq = np.stack([x.mean(0) for x in q])
        return out, q, cq / np.linalg.norm(cq, axis=1, keepdims=True), docs

    return make


@pytest.mark.parametrize("precision", ["float32", "int8"])
def test_multi_vector_modes_match_faiss(multi_pair, precision):
    out, q, cq, _ = multi_pair(precision)
    fm, mm = out["faiss"], out["milvus"]
    ex_f, ex_m = fm.search(q, k=5), mm.search(q, k=5)
    _assert_same_ranking(_ranked(ex_f), _ranked(ex_m))
    assert [r[0].id for r in ex_m] == ["d3", "d17", "d42"]
    assert ex_m[0][0].text == "td3" and ex_m[0][0].metadata == {"i": 3}
    _assert_same_ranking(_ranked(fm.search(q, k=5, mode="tokens", k_token=3)),
                         _ranked(mm.search(q, k=5, mode="tokens", k_token=3)))
    two_f = fm.search(q, k=5, mode="two_stage", candidates=10, companion_queries=cq)
    two_m = mm.search(q, k=5, mode="two_stage", candidates=10, companion_queries=cq)
    _assert_same_ranking(_ranked(two_f), _ranked(two_m))
    fm.close()


def test_multi_vector_upsert_delete_get(multi_pair):
    out, q, _, docs = multi_pair()
    mm = out["milvus"]
    assert len(mm) == 60 and mm.stats()["vectors"] == sum(len(d) for d in docs)
    np.testing.assert_allclose(mm.get("d5")["vectors"], docs[5], atol=1e-7)
    mm.add(["d3"], [docs[50][:3]], texts=["moved"], companion=unit(docs[50][:3].mean(0, keepdims=True)))
    got = mm.get("d3")
    assert got["vectors"].shape == (3, DIM) and got["text"] == "moved" and got["metadata"] is None
    assert len(mm) == 60 and mm.stats()["vectors"] == sum(len(d) for d in docs) - len(docs[3]) + 3
    mm.delete(["d17"])
    assert "d17" not in mm and all(h.id != "d17" for h in mm.search(q, k=60)[1])
    with pytest.raises(ConflictError, match="multi-vector"):
        mm.add(["x"], rand_unit(np.random.default_rng(0), 2, DIM))
    for m in out.values():
        if isinstance(m, FaissCollection):
            m.close()


def test_factory_defaults_to_faiss(tmp_path):
    coll = open_collection(tmp_path, "f", SPEC)
    assert isinstance(coll, FaissCollection) and coll.backend == "faiss"
    coll.close()
    assert list_collections(tmp_path) == ["f"] == list_collections(tmp_path, backend="faiss")
    delete_collection(tmp_path, "f")
    assert list_collections(tmp_path) == []
    with pytest.raises(InvalidError, match="unknown backend"):
        open_collection(tmp_path, "f", SPEC, backend="qdrant")


def test_full_scans_page_through_everything(mv, rng, monkeypatch):
    """ids() and exhaustive search read Milvus page by page (pk order); odd ids survive quoting."""
    import embedpool.index.milvus.collection as im

    ids = [f"k{i}" for i in range(120)] + ['we"ird\\id', "tab\there"]
    single = mv("s")
    single.add(ids, rand_unit(rng, len(ids), DIM))
    multi = mv("m", CollectionSpec(kind="multi", dim=DIM))
    docs = rand_docs(rng, len(ids), DIM, lo=1, hi=4)
    multi.add(ids, docs)
    q = [docs[5][:2], docs[-1]]
    whole = _ranked(multi.search(q, k=5))
    monkeypatch.setattr(im, "_SCAN_BYTES", 256 * 40)  # pages of 256 rows: several per scan
    assert single.ids() == ids and multi.ids() == ids
    assert _ranked(multi.search(q, k=5)) == whole and whole[1][0][0] == "tab\there"


# ---- the packed multi-vector layout (one row per document) ------------------------------------
def _rows_of(coll, doc_id: str) -> tuple[int, int]:
    """(document rows, token rows) of ``doc_id`` in Milvus, counted by the client itself."""
    from embedpool.index.milvus.schema import tokens_name

    client = coll._conn.client()
    mname = milvus_name(coll.name)
    flt = f'doc_id == "{doc_id}"'
    return tuple(len(list(client.query(n, filter=flt, output_fields=["pk"]))) for n in (mname, tokens_name(mname)))


@pytest.mark.parametrize("precision,row_elements", [("float32", None), ("int8", 1)])
def test_document_larger_than_a_row_round_trips_and_leaves_no_stray_rows(mv, rng, monkeypatch, tmp_path,
                                                                           precision, row_elements):
    """A 20,000-vector document does not fit one row (float32: 1.28 MB of codes, a row holds
    786 KB; int8 with rows of one element: 9 parts): get() returns its stored vectors, search
    finds it with FAISS's score, and replacing or deleting it leaves no stray rows."""
    import embedpool.index.milvus.schema as schema_mod
    from embedpool.index import dequantize, quantize

    if row_elements is not None:  # recorded in the manifest: reads use the creation's layout
        monkeypatch.setattr(schema_mod, "ROW_ELEMENTS", row_elements)
    spec = CollectionSpec(kind="multi", dim=DIM, precision=precision, token_factory="Flat",
                          companion_pooler="mean", companion_dim=DIM)
    coll = mv("big", spec)
    monkeypatch.setattr(schema_mod, "ROW_ELEMENTS", 16)
    big = rand_unit(rng, 20_000, DIM)
    small = rand_docs(rng, 5, DIM, lo=2, hi=6)
    ids = ["big", *(f"s{i}" for i in range(5))]
    comps = rand_unit(rng, len(ids), DIM)  # the companion: a vector per document
    faiss_coll = open_collection(tmp_path, "big", spec)
    for c in (coll, faiss_coll):
        c.add(ids, [big, *small], companion=comps)
    parts = coll._heads(["big"], ["parts"])["big"]["parts"]
    assert parts == (2 if precision == "float32" else 9)
    assert _rows_of(coll, "big") == (parts, 20_000)
    np.testing.assert_array_equal(coll.get("big")["vectors"], dequantize(*quantize(big, precision)))
    q = [big[[5, 10_000, 19_999]] + 0.01 * rand_unit(rng, 3, DIM), small[2]]
    comp = rand_unit(rng, 2, DIM)
    for kw in ({}, {"mode": "tokens", "k_token": 4}):
        got, want = coll.search(q, k=3, **kw), faiss_coll.search(q, k=3, **kw)
        assert [[h.id for h in r] for r in got] == [[h.id for h in r] for r in want]
        np.testing.assert_allclose([h.score for r in got for h in r], [h.score for r in want for h in r], atol=1e-5)
    two = coll.search(q, k=3, mode="two_stage", candidates=6, companion_queries=comp)
    assert [r[0].id for r in two] == ["big", "s2"]
    coll.add(["big"], [big[:3]], texts=["shorter now"], companion=comps[:1])  # 2 (9) parts -> 1, 20,000 tokens -> 3
    assert _rows_of(coll, "big") == (1, 3) and coll.get("big")["text"] == "shorter now"
    assert len(coll) == 6 and coll.stats()["vectors"] == 3 + sum(map(len, small))
    coll.add(["big"], [big], companion=comps[:1])  # and back: parts and token rows grow again
    assert _rows_of(coll, "big") == (parts, 20_000)
    coll.delete(["big"])
    assert _rows_of(coll, "big") == (0, 0) and "big" not in coll and coll.ids() == ids[1:]
    faiss_coll.close()


def test_multi_vector_collection_of_the_old_layout_is_refused_with_how_to_rebuild(mv, uri):
    """A multi-vector collection written one row per token vector (layout 1: its manifest has
    no ``milvus_layout``) is refused on open, the message says how to rebuild it; dropping works."""
    import json

    coll = mv("old", CollectionSpec(kind="multi", dim=DIM))
    name = coll.name
    client = coll._conn.client()
    manifest = json.loads(client.describe_collection(milvus_name(name))["properties"][MANIFEST_KEY])
    assert manifest["milvus_layout"]["version"] == 2
    del manifest["milvus_layout"]
    client.alter_collection_properties(milvus_name(name), properties={MANIFEST_KEY: json.dumps(manifest)})
    with pytest.raises(ConflictError, match=r"layout 1 \(one row per token vector\).*rebuild it.*"
                                                 r"embedpool index CORPUS --backend milvus"):
        MilvusCollection.open(uri, name)
    assert name in list_collections("unused", backend="milvus", milvus_uri=uri)  # listed, deletable
    # single-vector collections are unchanged: no layout key needed
    single = mv("old-single")
    client.alter_collection_properties(milvus_name(single.name), properties={MANIFEST_KEY: json.dumps(
        {k: v for k, v in json.loads(client.describe_collection(milvus_name(single.name))["properties"]
                                     [MANIFEST_KEY]).items() if k != "milvus_layout"})})
    MilvusCollection.open(uri, single.name).close()


def test_parts_of_two_writes_are_detected(mv, rng):
    """A crash between the parts of an upsert leaves parts of two versions: read as corrupt,
    naming the document, and repaired by adding it again."""
    from embedpool.errors import InternalError

    coll = mv("torn", CollectionSpec(kind="multi", dim=DIM, token_factory="Flat"))
    big = rand_unit(rng, 20_000, DIM)
    coll.add(["t"], [big])
    client = coll._conn.client()
    row = list(client.query(milvus_name(coll.name), filter='pk == "t#1"', output_fields=["*"]))[0]
    row.pop("sparse", None)  # Milvus makes it (the BM25 function of text)
    client.upsert(milvus_name(coll.name), [{**row, "seq": row["seq"] + 1}])
    with pytest.raises(InternalError, match="'t' has parts of different writes.*add the document again"):
        coll.get("t")
    coll.add(["t"], [big])
    np.testing.assert_array_equal(coll.get("t")["vectors"], big)


# ---- companion rows (spec.companion_pooler) ---------------------------------------------------
CDIM = 6
COMPANION = CollectionSpec(kind="multi", dim=DIM, token_factory="Flat", companion_pooler="mean",
                           companion_dim=CDIM, companion_rows="window")


def _companion_docs(rng, n=10):
    ids = [f"d{i}" for i in range(n)]
    return ids, rand_docs(rng, n, DIM, 1, 4), [rand_unit(rng, int(rng.integers(1, 5)), CDIM) for _ in ids]


def _companion_rows_of(coll, doc_id: str) -> list[str]:
    """The primary keys of ``doc_id``'s rows in the companion collection, read by the client."""
    from embedpool.index.milvus.schema import companion_rows_name

    rows = coll._conn.client().query(companion_rows_name(milvus_name(coll.name)), filter=f'doc_id == "{doc_id}"',
                                     output_fields=["pk"])
    return sorted(r["pk"] for r in rows)


def test_companion_rows_live_in_a_hidden_collection_dropped_with_it(mv, uri, rng):
    """The companion collection is made with the collection, never listed, holds exactly each
    document's rows and is dropped with it; collections without a companion have no such
    collection and the document-row schema they always had."""
    from embedpool.index.milvus.schema import companion_rows_name, tokens_name

    plain = mv("plain", CollectionSpec(kind="multi", dim=DIM))
    coll = mv("comp", COMPANION)
    client = coll._conn.client()
    mname, pname = milvus_name(coll.name), milvus_name(plain.name)
    assert client.has_collection(companion_rows_name(mname)) and not client.has_collection(companion_rows_name(pname))
    fields = lambda n: [f["name"] for f in client.describe_collection(n)["fields"]]  # noqa: E731
    # (sparse: the BM25 vectors Milvus' full-text function makes from text)
    assert fields(pname) == ["pk", "doc_id", "part", "parts", "n", "seq", "codes", "stub", "text", "metadata", "sparse"]
    assert fields(mname) == ["pk", "doc_id", "part", "parts", "n", "companion_rows", "seq", "codes", "stub", "text",
                             "metadata", "sparse"]
    assert fields(companion_rows_name(mname)) == ["pk", "doc_id", "vector"]
    assert client.describe_index(companion_rows_name(mname), "vector")["metric_type"] == "IP"
    names = list_collections("unused", backend="milvus", milvus_uri=uri)
    assert coll.name in names and not any("__" in n for n in names)
    ids, docs, comp = _companion_docs(rng)
    coll.add(ids, docs, companion=comp)
    coll.add(["d0"], [docs[0]], companion=[rand_unit(rng, 6, CDIM)])  # more rows, then fewer
    assert _companion_rows_of(coll, "d0") == [f"d0#{p}" for p in range(6)]
    coll.add(["d0"], [docs[0]], companion=[rand_unit(rng, 2, CDIM)])
    assert _companion_rows_of(coll, "d0") == ["d0#0", "d0#1"]
    coll.delete(["d0"])
    assert _companion_rows_of(coll, "d0") == []
    coll.close()
    delete_collection("unused", coll.name, backend="milvus", milvus_uri=uri)
    assert not any(n.startswith(mname) for n in client.list_collections())
    assert client.has_collection(tokens_name(pname))  # the other collection keeps its own


def test_companion_factory_maps_to_a_milvus_index(mv, rng):
    spec = CollectionSpec(**{**COMPANION.to_dict(), "companion_factory": "HNSW16"})
    coll = mv("hnsw", spec)
    from embedpool.index.milvus.schema import companion_rows_name

    built = coll._client.describe_index(companion_rows_name(milvus_name(coll.name)), "vector")
    assert (built["index_type"], built["params"]) == milvus_index("HNSW16")[:2]
    ids, docs, comp = _companion_docs(rng, 30)
    coll.add(ids, docs, companion=comp)
    q, cq = rand_docs(rng, 3, DIM, 2, 4), rand_unit(rng, 3, CDIM)
    assert _ranked(coll.search(q, k=5, mode="two_stage", companion_queries=cq, candidates=30)) == \
        _ranked(coll.search(q, k=5))
    with pytest.raises(InvalidError, match="spec.companion_factory: .*no Milvus equivalent"):
        mv("pca", CollectionSpec(**{**COMPANION.to_dict(), "companion_factory": "PCA4,Flat"}))


def test_grouping_refused_by_milvus_falls_back_to_over_fetching(mv, rng, monkeypatch):
    """Candidates come from one search grouped by document; where Milvus refuses to group, plain
    searches of ever more rows find the same documents (and grouping is not tried again)."""
    from pymilvus import MilvusClient
    from pymilvus.exceptions import MilvusException

    coll = mv("grp", COMPANION)
    ids, docs, comp = _companion_docs(rng, 40)
    crowd = rand_unit(rng, 1, CDIM)  # one document with 60 rows next to the first query
    comp[0] = crowd + 0.05 * rand_unit(rng, 60, CDIM)
    comp[0] /= np.linalg.norm(comp[0], axis=1, keepdims=True)
    coll.add(ids, docs, companion=comp)
    q, cq = rand_docs(rng, 3, DIM, 2, 4), np.concatenate([crowd, rand_unit(rng, 2, CDIM)])
    grouped = coll._companion_candidates(cq, 5)
    assert grouped[0][0] == "d0" and all(len(c) == 5 for c in grouped)
    calls = []
    search = MilvusClient.search

    def no_grouping(self, *args, **kwargs):
        calls.append(kwargs.get("group_by_field"))
        if kwargs.get("group_by_field"):
            raise MilvusException(code=1100, message="group by is not supported here")
        return search(self, *args, **kwargs)

    monkeypatch.setattr(MilvusClient, "search", no_grouping)
    assert coll._companion_candidates(cq, 5) == grouped and not coll._group_by
    assert calls[0] == "doc_id" and calls.count("doc_id") == 1  # tried once
    calls.clear()
    hits = coll.search(q, k=5, mode="two_stage", companion_queries=cq, candidates=5)
    assert calls and "doc_id" not in calls and [sorted(h.id for h in r) for r in hits] == [sorted(c) for c in grouped]


def test_companion_rows_survive_an_engine_restart(tmp_path, rng):
    path = str(tmp_path / "comp.db")
    kw = dict(backend="milvus", milvus_uri=path)
    coll = open_collection(tmp_path, "c", COMPANION, **kw)
    ids, docs, comp = _companion_docs(rng)
    coll.add(ids, docs, companion=comp)
    coll.commit()
    q, cq = rand_docs(rng, 2, DIM, 2, 4), rand_unit(rng, 2, CDIM)
    before = _ranked(coll.search(q, k=3, mode="two_stage", companion_queries=cq, candidates=2))
    coll.close()
    assert str(Path(path).resolve()) not in _lite_servers()  # the engine stopped
    coll = open_collection(tmp_path, "c", **kw)
    try:
        assert coll.stats()["companion_rows"] == sum(map(len, comp))
        np.testing.assert_allclose(coll.get("d3")["companion"], comp[3], atol=1e-6)
        assert _ranked(coll.search(q, k=3, mode="two_stage", companion_queries=cq, candidates=2)) == before
    finally:
        coll.close()
