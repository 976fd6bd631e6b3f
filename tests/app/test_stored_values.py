"""What a client stores, it reads back (issue 50), through a real server (uvicorn in a thread of
this process, on the session's model) on a FAISS folder and on Milvus Lite (the nine cases also
on a real Milvus 2.3 server, in `make test-slow`):

* the issue's nine metadata cases: each is stored and read back exactly (get, search, after a
  restart) or refused with a 422 naming the value's path and the limit, the collection unchanged;
  a batch with one bad document writes none of it;
* a collection that holds what is no longer accepted (written before the check, or edited on
  disk) still answers get, search and filters, the values rendered as docs/api.md says;
* a property (Hypothesis): upsert -> get -> search -> filter, then a restart -> get, returns what
  was sent, or the upsert was a 4xx and the collection is unchanged -- over JSON values and texts
  with Unicode's edge cases (NUL, combining marks, emoji, right-to-left text, lone surrogates),
  with small limits so that both sides of each are reached.
"""

from __future__ import annotations

import json
import math
import sqlite3
from contextlib import contextmanager
from datetime import timedelta
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from embedpool.app.server import create_app
from embedpool.app.settings import Settings
from embedpool.index import INT_MAX, INT_MIN, MAX_METADATA_BYTES, MAX_METADATA_DEPTH
from server_testutil import Uvicorn

BACKENDS = ["faiss", "milvus"]


@contextmanager
def serving(embedder, folder, backend: str, milvus_uri: str | None = None, **settings):
    """A client of a server on ``folder`` (its FAISS folders, or the Milvus Lite file in it, or
    ``milvus_uri``: a real Milvus server); leaving the block stops the server (the collections
    are closed), so serving the same folder again is a restart."""
    s = Settings(data_dir=str(folder), precision="fp32", backend=backend,
                 milvus_uri=milvus_uri or str(folder / "milvus.db"), **settings)
    with Uvicorn(create_app(s, embedder=embedder)) as url, httpx.Client(base_url=url, timeout=120) as client:
        yield client


def _exact(value) -> str:
    """``value`` as JSON that tells 1 from 1.0 and -0.0 from 0.0 (key order aside)."""
    return json.dumps(value, sort_keys=True)


def _doc_url(name: str, doc_id: str) -> str:
    return f"/collections/{name}/documents/" + quote(doc_id, safe="").replace(".", "%2E")


def _upsert(client: httpx.Client, name: str, raw_documents: str) -> httpx.Response:
    """POST the documents as this JSON text (it may hold what Python's json reads but no backend
    stores: 2^64, NaN, 1e400)."""
    return client.post(f"/collections/{name}/documents", content=('{"documents": %s}' % raw_documents).encode(),
                       headers={"Content-Type": "application/json"})


def _count(client: httpx.Client, name: str) -> int:
    r = client.get(f"/collections/{name}")
    assert r.status_code == 200, r.text
    return r.json()["documents"]


def _hits(client: httpx.Client, name: str, query: str, **body) -> list[dict]:
    r = client.post(f"/collections/{name}/search", json={"query": query, "k": 1000, **body})
    assert r.status_code == 200, r.text
    return r.json()["hits"]


def _deep(levels: int) -> dict:
    value: object = 1
    for _ in range(levels):
        value = {"a": value}
    return value  # type: ignore[return-value]


# ---------------------------------------------------------------------- the nine cases
BIG = "the 64-bit range every backend stores exactly, -(2^63-1) .. 2^63-1"
NINE = [  # (case, metadata as JSON text, None if stored, else (the 422's param, words of its message))
    ("2^64", '{"v": 18446744073709551616}', ("documents[0].metadata.v", BIG)),
    ("-2^64-1", '{"v": -18446744073709551617}', ("documents[0].metadata.v", BIG)),
    ("2^64 in a list", '{"v": [1, 18446744073709551616]}', ("documents[0].metadata.v[1]", BIG)),
    ("1e400", '{"v": 1e400}', ("documents[0].metadata.v", "Infinity is not a finite number")),
    ("NaN", '{"v": NaN}', ("documents[0].metadata.v", "NaN is not a finite number")),
    ("200-deep object", json.dumps(_deep(200)), None),
    ("empty key", '{"": "the empty key"}', None),
    ("5,000-character key", json.dumps({"k" * 5000: 1}), None),
    ("1 MB string", json.dumps({"s": "x" * 1_000_000}),
     ("documents[0].metadata", "1,000,008 bytes as compact JSON; the limit is max_metadata_bytes = 65,536")),
]


@pytest.mark.parametrize("backend", [*BACKENDS, pytest.param("milvus-server", marks=pytest.mark.slow)])
def test_the_nine_metadata_cases_are_stored_or_refused_by_path(embedder, tmp_path, backend, request):
    """On a FAISS folder, Milvus Lite and (slow) a real Milvus 2.3 server (``make milvus-server``)."""
    stored = {"kept": {"v": INT_MAX, "w": INT_MIN}}
    where = {}
    if backend == "milvus-server":
        backend, where = "milvus", {"milvus_uri": request.getfixturevalue("milvus_server").uri}
    with serving(embedder, tmp_path, backend, **where) as c:
        c.delete("/collections/nine")  # left by an earlier run on the session's shared Milvus server
        assert c.post("/collections", json={"name": "nine"}).status_code == 201
        assert _upsert(c, "nine", json.dumps([{"id": "kept", "text": "kept", "metadata": stored["kept"]}])).status_code == 200
        for k, (case, raw, refusal) in enumerate(NINE):
            doc_id, text = f"case-{k}", f"case {k}: {case}"
            r = _upsert(c, "nine", '[{"id": "%s", "text": "%s", "metadata": %s}]' % (doc_id, text, raw))
            if refusal is None:
                assert r.status_code == 200, (case, r.text)
                sent = json.loads(raw)
                got = c.get(_doc_url("nine", doc_id))
                assert got.status_code == 200 and _exact(got.json()["metadata"]) == _exact(sent), case
                hit = next(h for h in _hits(c, "nine", text) if h["id"] == doc_id)
                assert (hit["text"], _exact(hit["metadata"])) == (text, _exact(sent)), case
                stored[doc_id] = sent
            else:
                param, words = refusal
                assert r.status_code == 422, (case, r.text)
                assert r.json()["param"] == param and words in r.json()["error"], (case, r.json())
                assert r.json()["error"].startswith(param + ": "), r.json()
                assert c.get(_doc_url("nine", doc_id)).status_code == 404, case
                assert _count(c, "nine") == len(stored), case
            # every answer that holds every document still renders (the issue: one bad value made them all 500)
            assert {h["id"] for h in _hits(c, "nine", "anything")} == set(stored), case
        # a batch with one bad document writes none of it, the good one included
        r = _upsert(c, "nine", '[{"id": "good", "text": "good"}, {"id": "bad", "text": "t", "metadata": {"x": [NaN]}}]')
        assert r.status_code == 422 and r.json()["param"] == "documents[1].metadata.x[0]", r.text
        assert c.get(_doc_url("nine", "good")).status_code == 404 and _count(c, "nine") == len(stored)
        r = c.post("/collections/nine/documents", json=[{"id": "é" * 300, "text": "t"}])  # a bare list: [0]
        assert r.status_code == 422 and r.json()["param"] == "[0].id" and "600 bytes as UTF-8" in r.text, r.text
        limits = c.get("/info").json()["limits"]
        assert (limits["max_metadata_depth"], limits["max_metadata_bytes"]) == (MAX_METADATA_DEPTH, MAX_METADATA_BYTES)
    with serving(embedder, tmp_path, backend, **where) as c:  # a restart between the write and the read
        assert _count(c, "nine") == len(stored)
        for doc_id, sent in stored.items():
            assert _exact(c.get(_doc_url("nine", doc_id)).json()["metadata"]) == _exact(sent), doc_id
        c.delete("/collections/nine")


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_limits_are_settings(embedder, tmp_path, backend):
    with serving(embedder, tmp_path, backend, max_metadata_depth=2, max_metadata_bytes=64) as c:
        assert c.post("/collections", json={"name": "lim"}).status_code == 201
        ok = [{"id": "a", "text": "a", "metadata": {"l": [1, 2], "s": "x" * 40}}]
        assert c.post("/collections/lim/documents", json={"documents": ok}).status_code == 200
        for meta, param, words in (({"l": [[1]]}, "documents[0].metadata.l[0]", "max_metadata_depth = 2"),
                                   ({"s": "x" * 60}, "documents[0].metadata", "the limit is max_metadata_bytes = 64")):
            r = c.post("/collections/lim/documents", json={"documents": [{"id": "b", "text": "b", "metadata": meta}]})
            assert r.status_code == 422 and r.json()["param"] == param and words in r.json()["error"], r.text
        assert _count(c, "lim") == 1


# ---------------------------------------------------------------------- what was stored before the check
def test_a_collection_holding_values_no_longer_accepted_still_answers(embedder, tmp_path):
    """A FAISS collection whose stored metadata holds an integer past 64 bits (an older
    embedpool stored it; here it is edited on disk), an object deeper than an answer can nest,
    and NaN: get, search (one query and several) and filters answer 200 with the document, the
    integers as their decimal strings, the deep part as its JSON text, NaN as null. (A Milvus
    collection cannot hold such integers: pymilvus never wrote them.)"""
    with serving(embedder, tmp_path, "faiss") as c:
        assert c.post("/collections", json={"name": "old"}).status_code == 201
        docs = [{"id": "a", "text": "an old document", "metadata": {"tag": "x"}},
                {"id": "b", "text": "a new document", "metadata": {"tag": "y"}}]
        assert c.post("/collections/old/documents", json=docs).status_code == 200
    edited = ('{"tag": "x", "v": 18446744073709551616, "l": [-18446744073709551617, 1], "nan": NaN, "deep": %s}'
              % json.dumps(_deep(300)))
    with sqlite3.connect(tmp_path / "old" / "docs.sqlite") as db:
        assert db.execute("UPDATE docs SET metadata = ? WHERE ext_id = 'a'", (edited,)).rowcount == 1

    def check(metadata: dict) -> None:
        assert (metadata["tag"], metadata["v"], metadata["l"], metadata["nan"]) == \
            ("x", "18446744073709551616", ["-18446744073709551617", 1], None)
        node, levels = metadata["deep"], 0
        while isinstance(node, dict):
            node, levels = node["a"], levels + 1
        assert isinstance(node, str) and 200 < levels < 300 and json.loads(node) == _deep(300 - levels)

    with serving(embedder, tmp_path, "faiss") as c:
        r = c.get("/collections/old/documents/a")
        assert r.status_code == 200, r.text
        check(r.json()["metadata"])
        hits = {h["id"]: h for h in _hits(c, "old", "an old document")}
        assert set(hits) == {"a", "b"} and hits["b"]["metadata"] == {"tag": "y"}
        check(hits["a"]["metadata"])
        r = c.post("/collections/old/search", json={"queries": ["old", "new"], "k": 5})
        assert r.status_code == 200, r.text
        for hit in (h for result in r.json()["results"] for h in result if h["id"] == "a"):
            check(hit["metadata"])
        assert [h["id"] for h in _hits(c, "old", "old", filter={"tag": "x"})] == ["a"]
        assert [h["id"] for h in _hits(c, "old", "old", filter={"tag": "y"})] == ["b"]


# ---------------------------------------------------------------------- the property
#: limits of the property's server: small, so that generated values reach both sides of each
DEPTH, BYTES = 3, 400
EDGE_CHARS = ["\x00", "\x01", "\n", "\t", '"', "'", "\\", "/", ".", "%", "?", "#", " ", "e\u0301", "\u0301",
              "🙂", "👩‍👩‍👧", "\u202e", "\u200f", "שלום", "مرحبا", "\ufeff", "\u2028", "ß", "\uffff", "$"]
SURROGATES = ["\ud800", "\udfff"]
chars = st.one_of(st.sampled_from(EDGE_CHARS), st.characters(codec="utf-8"))
good_texts = st.lists(chars, max_size=12).map("".join)
#: about one text in five holds a lone surrogate (what JSON's \\ud800 escape decodes to)
texts = st.one_of(good_texts, good_texts, good_texts, good_texts,
                  st.tuples(good_texts, st.sampled_from(SURROGATES), good_texts).map("".join))
keys = st.one_of(texts, st.sampled_from(["", "_embedpool_dates", "$eq", "k" * 300, "2024-01-31"]))
ints = st.one_of(st.integers(-(1 << 65), 1 << 65), st.integers(-1000, 1000),
                 st.sampled_from([INT_MIN, INT_MAX, INT_MIN - 1, INT_MAX + 1, (1 << 64) - 1, 1 << 64]))
floats = st.one_of(st.floats(), st.sampled_from([-0.0, 5e-324, 1.7976931348623157e308, 0.1, 1.0]))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts, st.just("2024-01-31T12:00:00Z"),
                    st.text(max_size=150))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
                      max_leaves=8)
metadata = st.one_of(st.none(), st.dictionaries(keys, values, max_size=5))
doc_ids = st.one_of(texts.filter(bool), st.sampled_from(["..", ".", "a/b", "é" * 300]))


def _unicode(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def storable(doc_id: str, text: str, meta) -> bool:
    """The rules of docs/api.md ("What can be stored"), restated independently of the code."""
    def ok(v, depth: int) -> bool:
        if isinstance(v, dict):
            return depth <= DEPTH and all(_unicode(k) and ok(x, depth + 1) for k, x in v.items())
        if isinstance(v, list):
            return depth <= DEPTH and all(ok(x, depth + 1) for x in v)
        if v is None or isinstance(v, bool):
            return True
        if isinstance(v, int):
            return INT_MIN <= v <= INT_MAX
        if isinstance(v, float):
            return math.isfinite(v)
        return _unicode(v)

    meta_ok = meta is None or (ok(meta, 1) and "_embedpool_dates" not in meta
                               and len(json.dumps(meta, ensure_ascii=False, separators=(",", ":")).encode()) <= BYTES)
    id_ok = _unicode(doc_id) and 0 < len(doc_id.encode()) <= 512
    return meta_ok and id_ok and _unicode(text)


def _filterable(meta) -> tuple[str, object] | None:
    """A top-level key and scalar value of ``meta`` a filter can name (non-empty, no ``$``, at most
    256 characters), if there is one."""
    for k, v in (meta or {}).items():
        if k and not k.startswith("$") and len(k) <= 256 and v is not None and not isinstance(v, (dict, list)):
            return k, v
    return None


@pytest.mark.parametrize("backend", BACKENDS)
def test_what_is_acknowledged_is_read_back(embedder, tmp_path, backend):
    """Upsert -> get -> search -> filter returns what was sent (ids, texts and metadata exactly),
    or the upsert is a 4xx and the collection is unchanged; after a restart, get returns every
    acknowledged document's last version. 100 examples, derandomized (the same each run)."""
    acknowledged: dict[str, tuple[str, object]] = {}
    outcomes = {"stored": 0, "refused": 0}
    with serving(embedder, tmp_path, backend, max_metadata_depth=DEPTH, max_metadata_bytes=BYTES) as c:
        assert c.post("/collections", json={"name": "prop"}).status_code == 201

        @hsettings(max_examples=100, deadline=timedelta(seconds=20), derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
        @given(doc_id=doc_ids, text=texts, meta=metadata)
        def round_trip(doc_id: str, text: str, meta) -> None:
            before = _count(c, "prop")
            body = json.dumps([{"id": doc_id, "text": text, "metadata": meta}])  # NaN, 2^64, \ud800 as sent
            r = _upsert(c, "prop", body)
            if r.status_code != 200:
                assert 400 <= r.status_code < 500 and r.json()["type"] == "validation_error", r.text
                assert not storable(doc_id, text, meta), r.text
                assert _count(c, "prop") == before
                if _unicode(doc_id) and doc_id:
                    old = c.get(_doc_url("prop", doc_id))
                    if doc_id in acknowledged:
                        assert (old.json()["text"], _exact(old.json()["metadata"])) == \
                            (acknowledged[doc_id][0], _exact(acknowledged[doc_id][1]))
                    else:
                        assert old.status_code == 404, old.text
                outcomes["refused"] += 1
                return
            assert storable(doc_id, text, meta), body
            acknowledged[doc_id] = (text, meta)
            outcomes["stored"] += 1
            got = c.get(_doc_url("prop", doc_id))
            assert got.status_code == 200, got.text
            assert (got.json()["id"], got.json()["text"], _exact(got.json()["metadata"])) == (doc_id, text, _exact(meta))
            hit = next(h for h in _hits(c, "prop", text or "empty") if h["id"] == doc_id)
            assert (hit["text"], _exact(hit["metadata"])) == (text, _exact(meta))
            if (kv := _filterable(meta)) is not None:
                ids = [h["id"] for h in _hits(c, "prop", "filtered", filter={kv[0]: kv[1]})]
                assert doc_id in ids, (kv, ids)

        round_trip()
        count = _count(c, "prop")
    assert outcomes["stored"] >= 5 and outcomes["refused"] >= 5, outcomes  # both sides were reached
    with serving(embedder, tmp_path, backend, max_metadata_depth=DEPTH, max_metadata_bytes=BYTES) as c:
        assert _count(c, "prop") == count == len(acknowledged)
        for doc_id, (text, meta) in acknowledged.items():
            got = c.get(_doc_url("prop", doc_id)).json()
            assert (got["text"], _exact(got["metadata"])) == (text, _exact(meta)), doc_id
