"""Milvus versions and all-or-nothing creation.

* The version table (:mod:`embedpool.index.milvus.versions`) for the versions users run, 2.3
  through 2.6, pinned with injected version strings: only a 2.3 server and Milvus Lite run here,
  so the decisions for 2.4, 2.5 and 2.6 are checked as decisions (and as the schemas they give).
* Each path that differs by version runs for real wherever this machine has it: on Milvus Lite
  (nullable fields, INVERTED) and, with a version injected, the stand-ins for missing text and
  metadata that servers before 2.5 need; on the real 2.3 server (``slow``) the whole path of 2.3.
* Creation is all-or-nothing on both backends: a creation that fails leaves nothing that is
  listed, opened or reused; remains of one that was killed are repaired by the next creation;
  collections left half-made by embedpool before this are repaired on open or refused.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

import milvus_lite  # noqa: F401 -- a dependency: the Lite cases must fail without it, not vanish

from embedpool.errors import InternalError, InvalidError, NotFoundError, UnavailableError
from embedpool.index import CollectionSpec, list_collections, open_collection
from embedpool.index.milvus import ClientPool, connection, creation, milvus_name, versions
from embedpool.index.milvus.schema import NULLS, schema
from embedpool.index.milvus.versions import features_of
from pymilvus import DataType
from index_testutil import rand_docs, rand_unit

DIM = 8
SINGLE = CollectionSpec(kind="single", model="m", pooler="mean", dim=DIM)
MULTI = CollectionSpec(kind="multi", model="m", pooler="tokens", dim=DIM, token_factory="Flat")
COMPANION = CollectionSpec(**{**MULTI.to_dict(), "companion_pooler": "mean", "companion_dim": 6,
                              "companion_rows": "document"})
SPARSE = CollectionSpec(kind="sparse", model="m", pooler="splade", dim=50, normalized=False, factory="auto")


# ------------------------------------------------------------------ the version table
@pytest.mark.parametrize("reported, want", [
    ("v2.3.5", dict(nullable=False, inverted_index=False, group_by=False, sparse=False, full_text=False,
                    hnsw_sq=False, struct_max_sim=False)),
    ("v2.4.13-hotfix", dict(nullable=False, inverted_index=True, group_by=True, sparse=True, full_text=False,
                            hnsw_sq=False, struct_max_sim=False)),
    ("v2.5.4", dict(nullable=True, inverted_index=True, group_by=True, sparse=True, full_text=True, hnsw_sq=False,
                    struct_max_sim=False)),
    ("v2.6.3", dict(nullable=True, inverted_index=True, group_by=True, sparse=True, full_text=True, hnsw_sq=True,
                    struct_max_sim=False)),
    ("v2.6.16", dict(nullable=True, inverted_index=True, group_by=True, sparse=True, full_text=True, hnsw_sq=True,
                     struct_max_sim=True)),
    ("Zilliz Cloud Vector Database(Compatible with Milvus 2.5)", dict(nullable=True, inverted_index=True)),
])
def test_features_by_version(reported, want):
    f = features_of(reported)
    assert not f.lite and f.query_window == 16_384
    assert {k: getattr(f, k) for k in want} == want
    assert f.scalar_index == ("INVERTED" if f.inverted_index else "Trie")


def test_milvus_lite_and_versions_out_of_range(caplog):
    lite = features_of("milvus_lite-3.2.2")
    assert lite.lite and lite.name == "Milvus Lite 3.2.2"
    assert lite.nullable and lite.inverted_index and lite.sparse and lite.query_window == 0 and not lite.struct_max_sim
    with pytest.raises(UnavailableError, match=r"Milvus 2\.2\.16 is older .*\(2\.3 through 2\.6"):
        features_of("v2.2.16")
    with caplog.at_level(logging.WARNING, "embedpool.index"):
        newer = features_of("v2.7.1")
        unread = features_of("nightly")
    assert newer.struct_max_sim and newer.nullable and unread.version[:2] == versions.NEWEST
    assert "newer than the versions" in caplog.text and "cannot read" in caplog.text


def test_hnsw_sq_is_refused_before_2_6_naming_what_works():
    for v in ("v2.3.5", "v2.5.4"):
        with pytest.raises(InvalidError, match=r"HNSW_SQ .* needs Milvus 2\.6 .* Milvus 2\.\d\.\d"):
            features_of(v).check_index_type("HNSW_SQ", "factory")
    features_of("v2.6.0").check_index_type("HNSW_SQ", "factory")
    features_of("v2.3.5").check_index_type("HNSW", "factory")


@pytest.fixture(scope="module")
def lite_client(tmp_path_factory):
    conn = ClientPool.acquire(str(tmp_path_factory.mktemp("schemas") / "s.db"), None)
    yield conn.client()
    ClientPool.release(conn)


@pytest.mark.parametrize("reported", ["v2.3.5", "v2.4.13", "v2.5.4", "v2.6.16"])
def test_schemas_by_version(lite_client, reported):
    """The fields and indexes each version gets: nullable text/metadata from 2.5 (before: not
    nullable, plus the nulls field), INVERTED on doc_id from 2.4 (before: Trie)."""
    f = features_of(reported)
    for spec in (SINGLE, MULTI):
        sch, index_params = schema(lite_client, spec, f)
        fields = {fld.name: fld for fld in sch.fields}
        assert fields["text"].nullable is f.nullable and fields["metadata"].nullable is f.nullable
        assert (NULLS in fields) is (not f.nullable)
        indexes = {i.field_name: i.index_type for i in index_params}
        if spec.kind == "multi":
            assert indexes["doc_id"] == ("INVERTED" if reported >= "v2.4" else "Trie")


@pytest.mark.parametrize("reported", ["v2.3.5", "v2.4.0", "v2.6.16", "milvus_lite-3.2.2"])
def test_a_sparse_collection_needs_sparse_vectors(lite_client, reported):
    """Sparse rows are a SPARSE_FLOAT_VECTOR under a SPARSE_INVERTED_INDEX of inner products from
    Milvus 2.4 (and on Milvus Lite); a 2.3 server's schema is refused naming ``kind``, the
    server's version and the version needed."""
    f = features_of(reported)
    if f.version[:2] == (2, 3):
        with pytest.raises(InvalidError, match=r"kind: sparse .* need Milvus 2\.4 or later, and the server is "
                                               r"Milvus 2\.3\.5; .*--backend faiss") as e:
            schema(lite_client, SPARSE, f)
        assert e.value.param == "kind"
        return
    sch, index_params = schema(lite_client, SPARSE, f)
    assert {fld.name: fld.dtype for fld in sch.fields}["vector"] == DataType.SPARSE_FLOAT_VECTOR
    indexes = {i.field_name: i.get_index_configs() for i in index_params}
    assert (indexes["vector"]["index_type"], indexes["vector"]["metric_type"]) == ("SPARSE_INVERTED_INDEX", "IP")


# ------------------------------------------------------------------ each path, run for real
def _inject(monkeypatch, **changes):
    """Connections made from now on take the server's real features with ``changes``."""
    real = connection.features_of
    monkeypatch.setattr(connection, "features_of", lambda r: dataclasses.replace(real(r), **changes))


def _roundtrip(uri) -> dict[str, set[str]]:
    """Documents with and without text and metadata, read back through every read path;
    returns the Milvus fields of each kind's collection."""
    rng = np.random.default_rng(3)
    want = {"none": (None, None), "empty": ("", {}), "full": ("a text", {"k": [1, "x"]})}
    fields = {}
    for spec in (SINGLE, MULTI):
        with open_collection("unused", f"nulls-{spec.kind}", spec, backend="milvus", milvus_uri=uri) as coll:
            vecs = rand_unit(rng, 3, DIM) if spec.kind == "single" else rand_docs(rng, 3, DIM, 2, 4)
            coll.add(list(want), vecs, texts=[t for t, _ in want.values()], metadata=[m for _, m in want.values()])
            coll.commit()
            for i in want:
                d = coll.get(i)
                assert (d["text"], d["metadata"]) == want[i], i
            if spec.kind == "single":
                searches = {"single": coll.search(vecs[:1], k=3)[0]}
            else:
                searches = {m: coll.search([vecs[0]], k=3, mode=m)[0] for m in ("exhaustive", "tokens")}
            for mode, hits in searches.items():
                assert {h.id: (h.text, h.metadata) for h in hits} == want, mode
            fields[spec.kind] = {f["name"] for f in coll._client.describe_collection(coll._mname)["fields"]}
    return fields


def test_missing_text_and_metadata_without_nullable_fields(tmp_path, monkeypatch):
    """Before 2.5 (injected on Milvus Lite): stand-ins and the nulls field; None, "" and {} all
    read back as written."""
    _inject(monkeypatch, nullable=False)
    for kind, fields in _roundtrip(str(tmp_path / "n.db")).items():
        assert NULLS in fields, kind


def test_missing_text_and_metadata_with_nullable_fields(tmp_path):
    for kind, fields in _roundtrip(str(tmp_path / "n.db")).items():
        assert NULLS not in fields, kind


def test_a_milvus_without_sparse_vectors_refuses_a_sparse_collection_and_makes_nothing(tmp_path, monkeypatch):
    """Milvus Lite taken as a server without sparse vectors (injected): the creation is refused
    before anything is made; the real Lite makes the same collection."""
    uri = str(tmp_path / "s.db")
    _inject(monkeypatch, sparse=False, lite=False, version=(2, 3, 5))
    with pytest.raises(InvalidError, match=r"need Milvus 2\.4 or later, and the server is Milvus 2\.3\.5") as e:
        open_collection("unused", "sp", SPARSE, backend="milvus", milvus_uri=uri)
    assert e.value.param == "kind" and _raw_names(uri) == []
    monkeypatch.undo()
    with open_collection("unused", "sp", SPARSE, backend="milvus", milvus_uri=uri) as coll:
        coll.add(["a"], [{"indices": [3, 7], "values": [0.5, 1.0]}])
        assert coll.search([{"indices": [7], "values": [2.0]}], k=1)[0][0].score == 2.0


# ------------------------------------------------------------------ all-or-nothing creation
def _raw_names(uri) -> list[str]:
    conn = ClientPool.acquire(uri, None)
    try:
        return sorted(conn.client().list_collections())
    finally:
        ClientPool.release(conn)


def test_a_failed_creation_leaves_nothing(tmp_path, monkeypatch, caplog):
    """The issue's 2.3 failure on Milvus Lite: a scalar index the engine refuses (Trie, injected
    as for a server before 2.4) fails the creation after the other pieces exist; every piece is
    dropped, and a creation with the right index succeeds."""
    uri = str(tmp_path / "c.db")
    _inject(monkeypatch, inverted_index=False)
    with caplog.at_level(logging.WARNING, "embedpool.index"):
        with pytest.raises(UnavailableError, match="creating collection 'cl'.*(?i:trie)"):
            open_collection("unused", "cl", COMPANION, backend="milvus", milvus_uri=uri)
    assert "what it had made in Milvus is dropped" in caplog.text
    assert _raw_names(uri) == []
    with pytest.raises(NotFoundError):
        open_collection("unused", "cl", backend="milvus", milvus_uri=uri)
    monkeypatch.undo()
    with open_collection("unused", "cl", COMPANION, backend="milvus", milvus_uri=uri) as coll:
        assert len(coll) == 0
    assert list_collections("unused", backend="milvus", milvus_uri=uri) == ["cl"]


def test_remains_of_a_killed_creation_are_repaired_by_the_next(tmp_path, monkeypatch, caplog):
    """A creation killed after its first step (the undo never runs) leaves a collection with an
    owner and no manifest: not listed, not opened; the next creation drops it and creates."""
    uri = str(tmp_path / "k.db")
    _inject(monkeypatch, inverted_index=False)
    monkeypatch.setattr(creation, "_undo", lambda *a: None)  # the process died
    with pytest.raises(UnavailableError):
        open_collection("unused", "k", MULTI, backend="milvus", milvus_uri=uri)
    assert milvus_name("k") in _raw_names(uri)
    monkeypatch.undo()
    assert list_collections("unused", backend="milvus", milvus_uri=uri) == []
    with pytest.raises(NotFoundError, match="creation is under way or stopped half-way"):
        open_collection("unused", "k", backend="milvus", milvus_uri=uri)
    monkeypatch.setattr(creation, "CREATION_WAIT", 0.0)
    with caplog.at_level(logging.WARNING, "embedpool.index"):
        with open_collection("unused", "k", MULTI, backend="milvus", milvus_uri=uri) as coll:
            coll.add(["a"], rand_docs(np.random.default_rng(0), 1, DIM, 2, 2))
            coll.commit()
            assert coll.ids() == ["a"]
    assert "stopped half-way" in caplog.text


def _legacy_gap(uri, name, spec, gap):
    """A collection as embedpool made it before creation was all-or-nothing, with one gap."""
    with open_collection("unused", name, spec, backend="milvus", milvus_uri=uri) as coll:
        client, mname = coll._client, coll._mname
        if gap == "doc_id index":
            client.release_collection(mname)
            client.drop_index(mname, "doc_id")
        else:
            client.drop_collection(mname + "__tokens")
        return coll


def test_a_legacy_collection_without_its_doc_id_index_gets_it_on_open(tmp_path, caplog):
    uri = str(tmp_path / "l.db")
    _legacy_gap(uri, "l", MULTI, "doc_id index")
    with caplog.at_level(logging.WARNING, "embedpool.index"):
        with open_collection("unused", "l", backend="milvus", milvus_uri=uri) as coll:
            assert coll._client.list_indexes(coll._mname, field_name="doc_id")
            coll.add(["a"], rand_docs(np.random.default_rng(0), 1, DIM, 2, 2))
            assert coll.ids() == ["a"]
    assert "lacks its index on doc_id" in caplog.text


def test_a_legacy_half_made_collection_is_remade_when_empty_and_refused_when_not(tmp_path, caplog):
    uri = str(tmp_path / "h.db")
    _legacy_gap(uri, "h", MULTI, "tokens")
    with caplog.at_level(logging.WARNING, "embedpool.index"):
        with open_collection("unused", "h", MULTI, backend="milvus", milvus_uri=uri) as coll:
            coll.add(["a"], rand_docs(np.random.default_rng(0), 1, DIM, 2, 2))
            coll.commit()
            assert coll.search([rand_unit(np.random.default_rng(1), 2, DIM)], k=1, mode="tokens")[0][0].id == "a"
    assert "left half-made" in caplog.text and "dropping it and creating it again" in caplog.text
    conn = ClientPool.acquire(uri, None)
    try:
        conn.client().drop_collection(milvus_name("h") + "__tokens")  # now it holds a document
    finally:
        ClientPool.release(conn)
    with pytest.raises(InternalError, match="incomplete .* holds documents; delete it"):
        open_collection("unused", "h", backend="milvus", milvus_uri=uri)


def test_a_failed_faiss_creation_leaves_nothing(tmp_path, monkeypatch):
    """FAISS: a folder is built under a hidden name and renamed into place; a failure while it
    is built leaves no collection, and the next creation succeeds."""
    from embedpool.index.faiss import folders

    data = tmp_path / "data"
    real = folders.write_durable_bytes

    def fail(path, *a, **k):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(folders, "write_durable_bytes", fail)
    with pytest.raises(OSError, match="injected"):
        open_collection(data, "f", SINGLE)
    assert list_collections(data) == [] and [p.name for p in data.iterdir()] == []
    with pytest.raises(NotFoundError):
        open_collection(data, "f")
    monkeypatch.setattr(folders, "write_durable_bytes", real)
    with open_collection(data, "f", SINGLE) as coll:
        assert len(coll) == 0
    assert list_collections(data) == ["f"]


# ------------------------------------------------------------------ the real 2.3 server (slow)
def _drop_all(uri):
    from embedpool.index import delete_collection

    for name in list_collections("unused", backend="milvus", milvus_uri=uri):
        delete_collection("unused", name, backend="milvus", milvus_uri=uri)


@pytest.mark.slow
def test_the_2_3_server_stores_missing_values_and_indexes_doc_id_with_trie(milvus_server):
    f = features_of(milvus_server.version())
    assert f.version[:2] == (2, 3) and not f.nullable and f.scalar_index == "Trie"
    try:
        for kind, fields in _roundtrip(milvus_server.uri).items():
            assert NULLS in fields, kind
        conn = ClientPool.acquire(milvus_server.uri, None)
        try:
            index = conn.client().describe_index(milvus_name("nulls-multi"), "doc_id")
        finally:
            ClientPool.release(conn)
        assert index["index_type"].lower() == "trie", index
    finally:
        _drop_all(milvus_server.uri)


@pytest.mark.slow
def test_the_2_3_server_refuses_a_sparse_collection_naming_both_versions(milvus_server):
    uri = milvus_server.uri
    with pytest.raises(InvalidError, match=r"need Milvus 2\.4 or later, and the server is Milvus 2\.3\.\d+") as e:
        open_collection("unused", "sp", SPARSE, backend="milvus", milvus_uri=uri)
    assert e.value.param == "kind"
    assert not [n for n in _raw_names(uri) if n.startswith(milvus_name("sp"))]


@pytest.mark.slow
def test_the_issue_failure_on_the_2_3_server_leaves_nothing(milvus_server, monkeypatch):
    """INVERTED asked of 2.3 (injected: what embedpool did before it read versions) fails the
    creation with the server's own message, and nothing is left; without the injection the
    same collection is made."""
    uri = milvus_server.uri
    _inject(monkeypatch, inverted_index=True)
    with pytest.raises(UnavailableError, match="index type not match"):
        open_collection("unused", "issue", COMPANION, backend="milvus", milvus_uri=uri)
    assert not [n for n in _raw_names(uri) if n.startswith(milvus_name("issue"))]
    monkeypatch.undo()
    try:
        with open_collection("unused", "issue", COMPANION, backend="milvus", milvus_uri=uri) as coll:
            assert len(coll) == 0 and coll.stats()["companion_rows"] == 0
    finally:
        _drop_all(uri)
