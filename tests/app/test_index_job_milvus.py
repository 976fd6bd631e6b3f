"""`embedpool index` / `embedpool search` with ``--backend milvus`` against Milvus Lite (the real
engine in a temp .db; the real model): the job writes Milvus collections with its state stored
in them, resumes, refuses changed settings, and search finds the documents."""

from __future__ import annotations

import json

import pytest

import milvus_lite  # noqa: F401 -- a dependency: if it is missing these tests must fail, not vanish

from embedpool.app.datasets import CorpusSource  # noqa: E402
from embedpool.app.indexing import JOB_PROPERTY, IndexJob  # noqa: E402
from embedpool.index import MilvusCollection, delete_collection, list_collections, open_collection  # noqa: E402
from test_index_job import _corpus  # noqa: E402  (tests/app is on sys.path: pytest's rootdir-less import)


def test_index_and_search_cli_on_milvus(embedder, data_dir, tmp_path, monkeypatch, capsys):
    from embedpool.app import cli
    from embedpool.app.commands import index as index_cmd, search as search_cmd

    monkeypatch.setattr(index_cmd, "load_embedder", lambda settings: embedder)
    monkeypatch.setattr(search_cmd, "load_embedder", lambda settings: embedder)
    corpus = tmp_path / "corpus.jsonl"
    recs = _corpus(corpus, data_dir, 12, chars=300)
    d, db = str(tmp_path / "data"), str(tmp_path / "milvus" / "m.db")
    where = ["--data-dir", d, "--backend", "milvus", "--milvus-uri", db]
    assert cli.main(["index", str(corpus), *where, "--collection", "sf", "--pooler", "tokens",
                     "--commit-every", "5", "--batch-docs", "5", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "12 records" in out and "in Milvus at " + db in out
    assert list_collections(d, backend="milvus", milvus_uri=db) == ["sf"]  # it keeps its mean companion rows
    assert not (tmp_path / "data" / "sf").exists()  # no FAISS folder, no job file beside Milvus
    for mode in ("exhaustive", "two_stage", "tokens"):
        assert cli.main(["search", *where, "--collection", "sf", "--query", recs[3].text,
                         "--query", recs[7].text, "-k", "3", "--mode", mode]) == 0
        lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert [x["hits"][0]["id"] for x in lines] == [recs[3].id, recs[7].id], mode
        assert lines[0]["hits"][0]["text"] == recs[3].text
    # the job state lives in the collection: a rerun resumes (nothing to do) ...
    coll = open_collection(d, "sf", backend="milvus", milvus_uri=db)
    assert isinstance(coll, MilvusCollection)
    state = json.loads(coll.get_property(JOB_PROPERTY))
    assert state["committed_records"] == 12 and state["last_id"] == recs[-1].id
    assert len(coll) == 12 and coll.ids() == [r.id for r in recs]
    assert (coll.spec.companion_pooler, coll.stats()["companion_rows"]) == ("mean", 12)
    coll.close()
    assert cli.main(["index", str(corpus), *where, "--collection", "sf", "--pooler", "tokens",
                     "--no-progress", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["indexed_this_run"] == 0
    # ... a rerun with other settings is refused (exit 2) ...
    assert cli.main(["index", str(corpus), *where, "--collection", "sf", "--pooler", "tokens",
                     "--text-field", "title", "--no-progress"]) == 2
    assert "different settings" in capsys.readouterr().err
    # ... and dropping the collection drops its state: the next run indexes everything again
    delete_collection(d, "sf", backend="milvus", milvus_uri=db)
    src = CorpusSource(str(corpus))
    with IndexJob(embedder, d, "sf", ["tokens"], source=src.describe(), progress=False,
                  backend="milvus", milvus_uri=db) as job:
        s = job.run(src.records(), total=src.count())
    assert s["indexed_this_run"] == 12
    assert {c["collection"]: (c["documents"], c["companion_pooler"]) for c in s["collections"]} == {"sf": (12, "mean")}


def test_search_refuses_an_empty_collection(tmp_path, capsys):
    """An indexing run that wrote nothing is not answered with no hits and exit 0: the search
    says the collection is empty (exit 2, as for a missing one)."""
    from embedpool.app import cli
    from embedpool.index import CollectionSpec

    d, db = str(tmp_path / "data"), str(tmp_path / "m.db")
    spec = CollectionSpec(kind="single", model="sentence-transformers/all-MiniLM-L6-v2", pooler="mean", dim=384)
    open_collection(d, "empty", spec, backend="milvus", milvus_uri=db).close()
    where = ["--data-dir", d, "--backend", "milvus", "--milvus-uri", db]
    assert cli.main(["search", *where, "--collection", "empty", "--query", "anything"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "collection 'empty' has no documents to search" in out.err
    assert cli.main(["search", *where, "--collection", "missing", "--query", "anything"]) == 2
    assert "no collection 'missing'" in capsys.readouterr().err
