"""One retrieval path: the HTTP route, ``embedpool search`` and the evaluation embed a query as
each collection's manifest says -- the companion's too, with its own pooler -- and give the same
hits.

The case that once split them: a two_stage search whose companion has another pooler than the
collection (``agree-own`` keeps ``max`` companion rows beside its token vectors); the query must
be embedded for the companion with that pooler, as its manifest says. A collection of an older
embedpool that names a separate companion collection is refused on two_stage by all three
surfaces alike, saying what to do."""

from __future__ import annotations

import json

import numpy as np
import pytest

from embedpool.app import retrieval
from embedpool.errors import InvalidError
from embedpool.index import CollectionSpec, open_collection
from embedpool.poolers import EmbedOptions

DOCS = [
    "A cat sat on the mat and purred.",
    "Cats sleep most of the day in the sun.",
    "Stock markets fell sharply as investors sold shares.",
    "The central bank raised interest rates again.",
    "A dog chased a red ball across the park.",
    "Heavy rain and storms are forecast for the weekend.",
    "The weather will be sunny and warm tomorrow.",
    "A recipe for bread: flour, water, salt and yeast.",
    "Quantum computers use qubits in superposition to solve some problems faster than classical "
    "computers, but they remain hard to build and error-prone at scale.",
    "Football fans filled the stadium for the final.",
    "ok",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen in the "
    "chloroplasts of plant cells; it is the base of almost every food chain on Earth.",
]
QUERIES = ["a kitten on a rug", "finance news", "rain this weekend", "baking", "sports match",
           "how do plants make food", "computing with qubits", "pets playing outside"]
K, CANDIDATES = 3, 3
#: metadata of DOCS: a year per document and a topic some lack
META = [{"year": 2000 + i, **({"topic": ["pets", "finance", "weather"][i % 3]} if i % 4 else {})}
        for i in range(len(DOCS))]
#: the search options of the cases besides (mode, candidates): lexical modes, fusion, filters
OPTIONS = {
    "plain": {},
    "bm25": {"mode": "bm25", "filter": {"year": {"$gte": 2002}}},
    "hybrid": {"mode": "hybrid", "vector_mode": "two_stage", "fusion": "rrf", "weight": 0.6,
               "filter": {"topic": {"$in": ["pets", "weather"]}}},
    "hybrid-score": {"mode": "hybrid", "fusion": "score", "weight": 0.3, "filter": {"topic": {"$ne": "finance"}}},
    "filtered": {"filter": {"$or": [{"year": {"$lt": 2004}}, {"topic": "weather"}]}},
}


@pytest.fixture(scope="module")
def collections(server):
    """On the test server: a tokens collection whose companion is ``max``-pooled, and a
    single-vector collection of unnormalized mean vectors under L2."""
    docs = [{"id": f"d{i}", "text": t, "metadata": META[i]} for i, t in enumerate(DOCS)]
    with server.client() as client:
        for name, body in (("agree-own", {"pooler": "tokens", "companion_pooler": "max"}),
                           ("agree-l2", {"pooler": "mean", "metric": "l2", "normalized": False})):
            r = client.post("/collections", json={"name": name, **body})
            assert r.status_code in (200, 201), r.text
            assert client.post(f"/collections/{name}/documents", json=docs).status_code == 200
    return ["agree-own", "agree-l2"]


def _http(client, name: str, mode: str, options: dict | None = None) -> list[list[str]]:
    r = client.post(f"/collections/{name}/search", json={"queries": QUERIES, "k": K, "mode": mode,
                                                          "candidates": CANDIDATES, "include_text": False,
                                                          **(options or {})})
    assert r.status_code == 200, r.text
    return [[h["id"] for h in hits] for hits in r.json()["results"]]


def _cli(server, embedder, monkeypatch, capsys, name: str, mode: str, options: dict | None = None) -> list[list[str]]:
    from embedpool.app import cli
    from embedpool.app.commands import search as search_cmd

    monkeypatch.setattr(search_cmd, "load_embedder", lambda settings: embedder)
    o = dict(options or {})
    args = ["search", "--data-dir", str(server.data_dir), "--collection", name, "-k", str(K), "--mode",
            o.pop("mode", mode), "--candidates", str(CANDIDATES), "--no-text"]
    if "filter" in o:
        args += ["--filter", json.dumps(o.pop("filter"))]
    args += [x for k, v in o.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    assert cli.main(args + [x for q in QUERIES for x in ("--query", q)]) == 0
    return [[h["id"] for h in json.loads(line)["hits"]] for line in capsys.readouterr().out.splitlines()]


def _eval(server, embedder, name: str, mode: str, options: dict | None = None) -> list[list[str]]:
    """What ``embedpool eval`` runs: the queries embedded once per embedding the searches need
    (:class:`QueryVectors`), then :meth:`Search.run` on rows of them."""
    from embedpool.app.evaluation import QueryVectors

    o = {"mode": mode, **(options or {})}
    with open_collection(server.data_dir, name) as coll:
        search = retrieval.Search(coll, embedder.dim, k=K, candidates=CANDIDATES, **o)
        queries = QueryVectors([str(i) for i in range(len(QUERIES))], QUERIES, latency_queries=0)
        queries.ensure(embedder, search.embeddings())
        hits = [h for i in range(len(QUERIES)) for h in search.run(queries.vectors, [i], texts=QUERIES)]
    return [[h.id for h in hs] for hs in hits]


@pytest.mark.parametrize("name,mode,options", [
    ("agree-own", "exhaustive", "plain"), ("agree-own", "two_stage", "plain"), ("agree-own", "tokens", "plain"),
    ("agree-l2", "exhaustive", "plain"), ("agree-l2", "exhaustive", "bm25"), ("agree-own", "exhaustive", "hybrid"),
    ("agree-l2", "exhaustive", "hybrid-score"), ("agree-own", "two_stage", "filtered")])
def test_http_cli_and_eval_give_the_same_hits(collections, server, client, embedder, monkeypatch, capsys,
                                              name, mode, options):
    o = OPTIONS[options]
    http = _http(client, name, mode, o)
    assert _cli(server, embedder, monkeypatch, capsys, name, mode, o) == http
    assert _eval(server, embedder, name, mode, o) == http
    flt = o.get("filter")
    for hits in http:  # the filter holds: every hit matches it, and K come back where K match
        matching = [i for i in range(len(DOCS)) if _matches(flt, META[i])]
        assert all(int(h[1:]) in matching for h in hits)
        if o.get("mode") != "bm25":  # BM25 returns only documents with a query term
            assert len(hits) == min(K, len(matching))


def _matches(flt: dict | None, m: dict) -> bool:
    """The filters of OPTIONS, as plain Python."""
    if flt is None:
        return True
    return {"{'year': {'$gte': 2002}}": lambda: m["year"] >= 2002,
            "{'topic': {'$in': ['pets', 'weather']}}": lambda: m.get("topic") in ("pets", "weather"),
            "{'topic': {'$ne': 'finance'}}": lambda: m.get("topic") != "finance",
            "{'$or': [{'year': {'$lt': 2004}}, {'topic': 'weather'}]}": lambda: m["year"] < 2004
            or m.get("topic") == "weather"}[str(flt)]()


def test_bm25_over_http_is_the_collections_lexical_index(collections, client):
    """BM25 hits name the documents that share a query term (stemmed: 'sleeping' finds 'sleep'),
    best first; a query of stopwords only finds nothing."""
    r = client.post("/collections/agree-l2/search", json={"queries": ["sleeping cats", "the and of"], "k": 5,
                                                          "mode": "bm25"})
    assert r.status_code == 200, r.text
    first, stop = r.json()["results"]
    assert [h["id"] for h in first][:1] == ["d1"] and {h["id"] for h in first} == {"d0", "d1"} and stop == []
    assert first[0]["score"] > first[1]["score"] > 0


@pytest.mark.parametrize("body, message", [
    ({"filter": {"year": {"$gte": "soon"}}}, "filter: 'year': \\$gte 'soon' is not a number or an ISO 8601 date"),
    ({"filter": {"topic": {"$regex": "x"}}}, "unknown operator '\\$regex'"),
    ({"mode": "hybrid", "weight": 2}, "weight"),
    ({"mode": "nope"}, "mode"),
])
def test_bad_search_options_are_422_saying_what_is_wrong(collections, client, body, message):
    import re

    r = client.post("/collections/agree-l2/search", json={"query": "cats", **body})
    assert r.status_code == 422, r.text
    assert re.search(message, r.text), r.text


def test_delete_by_filter_over_http(server, client):
    name = "del-filter"
    assert client.post("/collections", json={"name": name, "pooler": "mean"}).status_code in (200, 201)
    docs = [{"id": f"d{i}", "text": t, "metadata": META[i]} for i, t in enumerate(DOCS)]
    assert client.post(f"/collections/{name}/documents", json=docs).status_code == 200
    r = client.post(f"/collections/{name}/documents/delete", json={"filter": {"topic": "finance"}})
    assert r.status_code == 200, r.text
    gone = {f"d{i}" for i, m in enumerate(META) if m.get("topic") == "finance"}
    assert r.json() == {"deleted": len(gone), "documents": len(DOCS) - len(gone)}
    hits = client.post(f"/collections/{name}/search", json={"query": "stock markets", "k": 20}).json()["hits"]
    assert {h["id"] for h in hits} == {f"d{i}" for i in range(len(DOCS))} - gone
    r = client.post(f"/collections/{name}/documents/delete", json={"ids": ["d0", "d0"]})
    assert r.json() == {"deleted": 1, "documents": len(DOCS) - len(gone) - 1}
    assert client.post(f"/collections/{name}/documents/delete", json={"filter": {"$or": 3}}).status_code == 422
    assert client.post(f"/collections/{name}/documents/delete", json={}).status_code == 422


def test_the_companion_is_searched_with_its_own_embedding(collections, server, client, embedder):
    """The two_stage hits are exact MaxSim over the companion's top candidates for the query
    embedded as the companion's manifest says (max pooling, role query) -- computed here from
    scratch with the embedder and numpy."""
    texts = {f"d{i}": t for i, t in enumerate(DOCS)}
    ids = list(texts)
    doc_max = embedder.embed(list(texts.values()), ["max"]).matrix("max")
    doc_tok = embedder.embed(list(texts.values()), ["tokens"]).vectors["tokens"]
    q_max = embedder.embed(QUERIES, ["max"], role="query").matrix("max")
    q_tok = embedder.embed(QUERIES, ["tokens"], role="query").vectors["tokens"]
    want = []
    for qm, qt in zip(q_max, q_tok):
        cand = np.argsort(-(doc_max @ qm), kind="stable")[:CANDIDATES]
        score = {ids[j]: retrieval.maxsim(qt, doc_tok[j]) for j in cand}
        want.append(sorted(score, key=lambda d: -score[d])[:K])
    assert _http(client, "agree-own", "two_stage") == want
    # ... and not exhaustive MaxSim: the candidates matter
    assert _http(client, "agree-own", "exhaustive") != want, "the test data must tell the two apart"


def test_two_stage_on_a_collection_naming_a_separate_companion_says_what_to_do(server, client, embedder, capsys,
                                                                                 monkeypatch):
    """A manifest of an older embedpool names a separate companion collection (``companion``),
    which embedpool no longer reads: the HTTP route and ``embedpool search`` refuse two_stage on
    it naming that collection and the way to a companion; every other mode still searches it."""
    from embedpool.app import cli
    from embedpool.app.commands import search as search_cmd

    spec = CollectionSpec(kind="multi", model="sentence-transformers/all-MiniLM-L6-v2", pooler="tokens", dim=384)
    open_collection(server.data_dir, "agree-old", spec).close()
    path = server.data_dir / "agree-old" / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "companion": "agree-comp"}))
    assert client.post("/collections/agree-old/documents", json=[{"id": "d0", "text": DOCS[0]}]).status_code == 200
    r = client.post("/collections/agree-old/search", json={"query": "x", "mode": "two_stage"})
    assert r.status_code == 422 and "'agree-comp'" in r.text and "--companion-pooler" in r.text, r.text
    assert client.post("/collections/agree-old/search", json={"query": "x"}).json()["hits"][0]["id"] == "d0"
    monkeypatch.setattr(search_cmd, "load_embedder", lambda settings: embedder)
    capsys.readouterr()
    assert cli.main(["search", "--data-dir", str(server.data_dir), "--collection", "agree-old", "--mode", "two_stage",
                     "--query", "x"]) == 2
    assert "'agree-comp'" in capsys.readouterr().err


def test_two_stage_without_a_companion_is_an_input_error(collections, client, server, embedder, capsys, monkeypatch):
    r = client.post("/collections/agree-l2/search", json={"query": "x", "mode": "two_stage"})
    assert r.status_code == 200  # a single-vector collection has no candidate stage: mode is moot
    r = client.post("/collections", json={"name": "agree-lonely", "pooler": "tokens", "companion_pooler": "none"})
    assert r.status_code in (200, 201), r.text
    r = client.post("/collections/agree-lonely/search", json={"query": "x", "mode": "two_stage"})
    assert r.status_code == 422 and "keeps no companion vectors" in r.json()["error"]
    with pytest.raises(InvalidError, match="unknown search mode"):
        retrieval.vector_mode("fast")
    assert retrieval.collection_embedding(CollectionSpec(dim=128, normalized=False), 384) == \
        retrieval.Embedding("", EmbedOptions(role="query", normalize=False, dimensions=128))
