"""The scale benchmark's pieces, small (bench/million.py runs them at 1M documents):

- the synthetic documents (``tests/synthetic_corpus.py``) have the statistics of the real ones they
  are drawn from -- 200 SciFact abstracts pooled by the real model with ``cluster:pool_factor=16``;
- at 20k documents: append + commit never rewrites a committed file, opening reads no token
  pages, and compaction gives what a fresh build of the remaining documents gives.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from embedpool.index import FaissCollection, CollectionSpec
from synthetic_corpus import SyntheticCorpus, nn_similarities, normalize

POOLER = "cluster:pool_factor=16"
N_DOCS = 20_000


@pytest.fixture(scope="module")
def real(embedder, scifact_docs):
    """The real documents: their cluster vectors and their mean-pooler vectors."""
    res = embedder.embed(scifact_docs, [POOLER, "mean"], role="document")
    return ([np.asarray(v, np.float32) for v in res.vectors[POOLER]],
            np.stack([np.asarray(v, np.float32) for v in res.vectors["mean"]]))


def test_generator_matches_real_statistics(real):
    docs, means = real
    half = len(docs) // 2
    gen = SyntheticCorpus(docs, seed=1)
    synth = gen.block(0)
    # vectors per document: drawn from the real counts (mean within 5%, same range)
    lens = np.array([len(d) for d in synth.docs])
    real_lens = np.array([len(d) for d in docs])
    assert abs(lens.mean() / real_lens.mean() - 1) < 0.05
    assert lens.min() >= real_lens.min() and lens.max() <= real_lens.max()
    # norms: unit vectors, as the model's normalized output
    norms = np.linalg.norm(np.concatenate(synth.docs), axis=1)
    assert np.abs(norms - 1).max() < 1e-4
    # nearest-neighbour similarity (vector to the nearest vector of another document) among
    # half as many documents as there are sources (few share a source; at 1M documents from
    # 5,183 sources most do, see docs/scale.md): quantiles within 0.06 of the real ones'
    want = np.percentile(nn_similarities(docs[:half]), [10, 50, 90])
    got = np.percentile(nn_similarities(synth.docs[:half]), [10, 50, 90])
    assert np.abs(got - want).max() < 0.06, (got, want)
    # and not copies: a synthetic vector is not its source (the perturbation is real)
    assert np.percentile(nn_similarities(synth.docs[:100] + docs), 50) < 0.99
    # the companion (normalized mean of a document's vectors) stands in for the mean pooler:
    # on the real documents it is within cos 0.9 of the real mean for 90% of them
    approx = normalize(np.stack([d.mean(0) for d in docs]))
    assert np.percentile((approx * means).sum(1), 10) > 0.9
    # blocks are reproducible on their own
    np.testing.assert_array_equal(gen.block(3).companion, SyntheticCorpus(docs, seed=1).block(3).companion)


def _spec() -> CollectionSpec:
    return CollectionSpec(kind="multi", model="m", pooler=POOLER, dim=384, precision="int8",
                          companion_pooler="mean", companion_dim=384, companion_factory="IVF64,SQ8")


def _build(path: Path, gen: SyntheticCorpus, keep=None, commit_every: int = 5) -> FaissCollection:
    coll = FaissCollection.create(path, "c", _spec())
    for b, bt in enumerate(gen.batches(N_DOCS, keep)):
        coll.add(bt.ids, bt.docs, companion=bt.companion)
        if b % commit_every == commit_every - 1:
            coll.commit()
    coll.commit()
    return coll


def _files(folder: Path) -> dict[str, tuple[int, int, int]]:
    skip = {"docs.sqlite", "docs.sqlite-wal", "docs.sqlite-shm", "manifest.json", "writer.lock"}
    return {e.name: (e.stat().st_ino, e.stat().st_mtime_ns, e.stat().st_size)
            for e in os.scandir(folder) if e.name not in skip}


def test_append_commit_never_rewrites_committed_files(real, tmp_path):
    gen = SyntheticCorpus(real[0], seed=2)
    coll = FaissCollection.create(tmp_path, "c", _spec())
    seen: dict[str, tuple[int, int, int]] = {}
    for b, bt in enumerate(gen.batches(N_DOCS)):
        coll.add(bt.ids, bt.docs, companion=bt.companion)
        if b % 4 == 3:
            coll.commit()
            now = _files(tmp_path / "c")
            for name, st in seen.items():  # every committed file is still there, untouched
                assert now.get(name) == st, name
            seen = now
    assert len(seen) >= 10  # segments, a companion base and its deltas
    assert any(n.endswith(".delta.npz") for n in seen)
    coll.close()


def _lists(index) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every inverted list of an IVF index: (ids, codes), in stored order."""
    import faiss

    ivf = faiss.extract_index_ivf(index)
    il = ivf.invlists
    out = []
    for lst in range(ivf.nlist):
        n = il.list_size(lst)
        out.append((faiss.rev_swig_ptr(il.get_ids(lst), n).copy(),
                    faiss.rev_swig_ptr(il.get_codes(lst), n * il.code_size).copy()))
    return out


def test_companion_deltas_load_as_faiss_adds_them(real, tmp_path):
    """Opening reads the companion's base and its deltas into lists allocated once at their
    final size; the lists (ids, codes, order), the row count and the search results are those
    of FAISS' own ``read_index`` + ``add_sa_codes`` of every delta file, also after deletions
    (tombstones in the files, removed on load)."""
    import faiss

    gen = SyntheticCorpus(real[0], seed=5)
    coll = _build(tmp_path, gen, commit_every=2)
    gone = [f"d{i}" for i in range(N_DOCS) if i % 7 == 2]
    coll.delete(gone)
    coll.commit()
    coll.close()
    folder = tmp_path / "c"
    deltas = sorted(folder.glob("companion-*.delta.npz"), key=lambda f: int(f.name.split("-")[1].split(".")[0]))
    base = [f for f in folder.glob("companion-*") if not f.name.endswith(".delta.npz")]
    assert len(deltas) >= 3 and len(base) == 1
    ref = faiss.read_index(str(base[0]))
    for d in deltas:
        with np.load(d) as z:
            ref.add_sa_codes(z["rows"], z["ids"])
    again = FaissCollection.open(tmp_path, "c")
    got = again._vec.companion.index
    live_rows = np.concatenate([ids for ids, _ in _lists(got)])
    ref_rows = np.concatenate([ids for ids, _ in _lists(ref)])
    dead = np.setdiff1d(ref_rows, live_rows)
    assert len(dead) == len(gone)  # one companion row per document
    faiss.extract_index_ivf(ref).set_direct_map_type(faiss.DirectMap.Hashtable)
    ref.remove_ids(dead)
    assert got.ntotal == ref.ntotal == N_DOCS - len(gone)
    for (gi, gc), (ri, rc) in zip(_lists(got), _lists(ref), strict=True):
        np.testing.assert_array_equal(gi, ri)
        np.testing.assert_array_equal(gc, rc)
    q = real[1][:20]
    faiss.extract_index_ivf(ref).nprobe = faiss.extract_index_ivf(got).nprobe
    (dg, ig), (dr, ir) = got.search(q, 10), ref.search(q, 10)
    np.testing.assert_array_equal(ig, ir)
    np.testing.assert_array_equal(dg, dr)
    again.close()


_OPEN = """
import ctypes, json, sys
import faiss, numpy as np
from embedpool.index import FaissCollection
def rss():
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return int(open("/proc/self/statm").read().split()[1]) * 4096
base = rss()
c = FaissCollection.open(sys.argv[1], "c")
print(json.dumps({"growth": rss() - base, "docs": len(c)}))
"""


def test_open_reads_no_vector_pages_and_compaction_equals_fresh_build(real, tmp_path):
    gen = SyntheticCorpus(real[0], seed=3)
    coll = _build(tmp_path / "a", gen)
    codes = sum(f.stat().st_size for f in (tmp_path / "a" / "c").glob("seg-*.vec.npy"))
    comp = sum(f.stat().st_size for f in (tmp_path / "a" / "c").glob("companion-*"))
    out = subprocess.run([sys.executable, "-c", _OPEN, str(tmp_path / "a")], capture_output=True,
                         text=True, check=True)
    got = json.loads(out.stdout)
    assert got["docs"] == N_DOCS
    # the companion index is loaded (it is searched whole); the token codes are not
    assert got["growth"] < comp + 0.1 * codes, (got, comp, codes)

    gone = [f"d{i}" for i in range(N_DOCS) if i % 10 == 3]
    coll.delete(gone)
    coll.commit()
    coll.compact()
    fresh = _build(tmp_path / "b", gen, keep=lambda n: n % 10 != 3)
    assert coll.ids() == fresh.ids() and len(coll) == N_DOCS - len(gone)
    assert coll.stats()["segments"] == 1 and coll.stats()["tombstones"] == 0
    rng = np.random.default_rng(0)
    for i in rng.choice(coll.ids(), 200, replace=False):
        np.testing.assert_array_equal(coll.get(i)["vectors"], fresh.get(i)["vectors"])
    for q in real[0][:5]:
        a, b = coll.search([q], k=10)[0], fresh.search([q], k=10)[0]
        assert [h.id for h in a] == [h.id for h in b]
        np.testing.assert_allclose([h.score for h in a], [h.score for h in b], atol=1e-5)
    # the compacted collection reopens to the same state (its companion without deltas)
    coll.close()
    again = FaissCollection.open(tmp_path / "a", "c")
    assert again.ids() == fresh.ids()
    assert not list((tmp_path / "a" / "c").glob("*.delta.npz"))
    again.close()
    fresh.close()
