"""``--companion-pooler fde``: the index job makes every multi-vector collection keep companion rows of
MUVERA FDEs, whose manifest records every FDE parameter; ``two_stage`` takes its candidates from
an FDE companion in FAISS Flat / HNSW / IVF and Milvus Lite HNSW / IVF with the same results;
query FDEs made with other parameters are refused. The real model, FAISS on disk and Milvus Lite."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_index_job import _corpus  # noqa: E402  (tests/app is on sys.path)

from embedpool.app.datasets import CorpusSource
from embedpool.app.indexing import IndexJob
from embedpool.errors import ConflictError
from embedpool.index import CollectionSpec, FORMAT_VERSION, open_collection

N_DOCS = 40
MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def test_index_job_with_fde_companion_and_two_stage_search(embedder, data_dir, tmp_path, monkeypatch, capsys):
    from embedpool.app import cli
    from embedpool.app.commands import search as search_cmd

    corpus = tmp_path / "corpus.jsonl"
    recs = _corpus(corpus, data_dir, 16, chars=400)
    d = tmp_path / "data"
    src = CorpusSource(str(corpus))
    with IndexJob(embedder, d, "sf", ["cluster:pool_factor=2"], companion_pooler="fde", factory="HNSW32",
                  source=src.describe(), progress=False, batch_docs=8) as job:
        summary = job.run(src.records(), total=src.count())
    fde = embedder.pooler("fde")
    kinds = {c["collection"]: (c["kind"], c["documents"], c["companion_pooler"]) for c in summary["collections"]}
    assert kinds == {"sf": ("multi", 16, fde.spec)}  # no second collection: sf keeps its companion rows
    with open_collection(d, "sf") as coll:  # the manifest pins every FDE parameter
        spec = coll.spec
        assert spec.companion_pooler == fde.spec and "k_sim=" in spec.companion_pooler and "seed=" in fde.spec
        assert spec.companion_dim == fde.output_dim(384) and spec.companion_factory == "HNSW32"
        assert spec.companion_rows == "document"
        assert coll.manifest["companion_pooler"] == fde.spec and coll.manifest["format_version"] == FORMAT_VERSION
        assert coll.stats()["companion_rows"] == 16
        np.testing.assert_allclose(coll.get(recs[3].id)["companion"][0],
                                   embedder.embed([recs[3].text], [fde.spec]).vectors[fde.spec][0], atol=1e-5)

    monkeypatch.setattr(search_cmd, "load_embedder", lambda settings: embedder)
    assert cli.main(["search", "--data-dir", str(d), "--collection", "sf", "--query", recs[5].text,
                     "--query", recs[11].text, "-k", "3", "--mode", "two_stage", "--candidates", "4"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["hits"][0]["id"] for x in lines] == [recs[5].id, recs[11].id]


@pytest.fixture(scope="module")
def embedded(embedder, data_dir, tmp_path_factory):
    corpus = tmp_path_factory.mktemp("fde") / "corpus.jsonl"
    recs = _corpus(corpus, data_dir, N_DOCS, chars=600)
    docs = embedder.embed([r.text for r in recs], ["tokens", "fde"], role="document")
    queries = [r.text.split(". ")[0] for r in recs[::5]]  # first sentences: near, not equal
    q = embedder.embed(queries, ["tokens", "fde"], role="query")
    return [r.id for r in recs], docs, q


def _with_fde_companion(folder, name, factory, fde_spec, dim, ids, docs, token_factory="HNSW32", **where):
    """A tokens collection keeping an FDE companion indexed by ``factory``, holding ``docs``."""
    spec = CollectionSpec(kind="multi", model=MODEL, pooler="tokens", dim=384, token_factory=token_factory,
                          companion_pooler=fde_spec, companion_dim=dim, companion_factory=factory)
    coll = open_collection(folder, name, spec, **where)
    coll.add(ids, docs.vectors["tokens"], pooler="tokens", companion=docs.matrix("fde"))
    coll.commit()
    return coll


def test_two_stage_fde_candidates_in_faiss_and_milvus_indexes_agree(embedder, embedded, tmp_path):
    ids, docs, q = embedded
    fde = embedder.pooler("fde")
    dim = fde.output_dim(384)
    milvus = {"backend": "milvus", "milvus_uri": str(tmp_path / "m.db")}
    colls = {f"faiss {f}": _with_fde_companion(tmp_path / "faiss", f"c{i}", f, fde.spec, dim, ids, docs)
             for i, f in enumerate(["IDMap2,Flat", "HNSW32", "IVF4,Flat"])}
    colls.update({f"milvus {f}": _with_fde_companion(tmp_path / "m", f"c{i}", f, fde.spec, dim, ids, docs, **milvus)
                  for i, f in enumerate(["HNSW32", "IVF4,Flat"])})
    try:
        exact = [[h.id for h in r] for r in colls["faiss IDMap2,Flat"].search(q.vectors["tokens"], k=10)]
        results = {}
        for name, coll in colls.items():
            hits = coll.search(q.vectors["tokens"], k=10, mode="two_stage", candidates=20,
                               companion_queries=q.matrix("fde"), companion_pooler=fde.spec)
            results[name] = [[h.id for h in r] for r in hits]
        ref = results["faiss IDMap2,Flat"]
        for name, r in results.items():
            assert r == ref, name
        # each query (a document's first sentence) finds its document first, as exhaustive MaxSim does
        assert [r[0] for r in ref] == [e[0] for e in exact] == ids[::5]

        # a query FDE made with other parameters is refused: by its pooler spec, and by its size
        other = embedder.pooler("fde:seed=1")
        other_q = embedder.embed(["a query"], [other.spec], role="query").matrix(other.spec)
        with pytest.raises(ConflictError, match=r"made with pooler 'fde:.*seed=1.*embed the queries with"):
            colls["faiss HNSW32"].search(q.vectors["tokens"][:1], mode="two_stage", companion_queries=other_q,
                                         companion_pooler=other.spec)
        small = embedder.embed(["a query"], ["fde:reps=2"], role="query").matrix("fde:reps=2")
        with pytest.raises(ConflictError, match="dimension"):
            colls["milvus HNSW32"].search(q.vectors["tokens"][:1], mode="two_stage", companion_queries=small)
    finally:
        for c in colls.values():
            c.close()


def test_dimensions_do_not_truncate_fde(embedder):
    """Matryoshka ``dimensions`` cut the model's vectors, never an FDE (its size is its own)."""
    r = embedder.embed(["some text"], ["mean", "fde"], dimensions=64)
    fde = embedder.pooler("fde")
    assert r.vectors["mean"][0].shape == (64,) and r.vectors["fde"][0].shape == (fde.output_dim(384),)
    assert embedder.output_dim("fde", 64) == fde.output_dim(384) and embedder.output_dim("mean", 64) == 64


def _scored(results) -> list[list[tuple[str, float]]]:
    return [[(h.id, h.score) for h in r] for r in results]


def _assert_same_hits(got, want, tol=1e-5):
    """Same ids in the same order, MaxSim scores within ``tol``."""
    assert [[i for i, _ in r] for r in got] == [[i for i, _ in r] for r in want]
    np.testing.assert_allclose([s for r in got for _, s in r], [s for r in want for _, s in r], atol=tol)


def test_milvus_packed_multi_vector_search_equals_faiss_exhaustive_maxsim(embedder, embedded, tmp_path):
    """The packed Milvus layout (one row per document) on a SciFact slice of real token states:
    exhaustive and two_stage (the FDE companion rows in Milvus) give FAISS's exhaustive MaxSim -- same ids,
    scores within 1e-5 -- and two_stage with 20 candidates gives FAISS's two_stage."""
    ids, docs, q = embedded
    fde = embedder.pooler("fde")
    dim = fde.output_dim(384)
    milvus = {"backend": "milvus", "milvus_uri": str(tmp_path / "m.db")}
    colls = {b: _with_fde_companion(tmp_path / b, "mv", "IDMap2,Flat" if b == "faiss" else "HNSW32", fde.spec, dim,
                                    ids, docs, token_factory="Flat", **w)
             for b, w in (("faiss", {}), ("milvus", milvus))}
    try:
        assert colls["milvus"].stats()["vectors"] == colls["faiss"].stats()["vectors"] > N_DOCS
        qt = q.vectors["tokens"]

        def two_stage(b, n):
            return _scored(colls[b].search(qt, k=10, mode="two_stage", candidates=n,
                                           companion_queries=q.matrix("fde"), companion_pooler=fde.spec))

        exact = _scored(colls["faiss"].search(qt, k=10))
        _assert_same_hits(_scored(colls["milvus"].search(qt, k=10)), exact)
        _assert_same_hits(two_stage("milvus", N_DOCS), exact)  # every document a candidate
        _assert_same_hits(two_stage("milvus", 20), two_stage("faiss", 20))
        _assert_same_hits(_scored(colls["milvus"].search(qt, k=10, mode="tokens", k_token=8)),
                          _scored(colls["faiss"].search(qt, k=10, mode="tokens", k_token=8)))
        np.testing.assert_allclose(colls["milvus"].get(ids[7])["vectors"], docs.vectors["tokens"][7], atol=0)
    finally:
        for c in colls.values():
            c.close()
