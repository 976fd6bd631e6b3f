"""Multi-vector collections: segments, precisions, MaxSim search modes, compaction."""

import json

import numpy as np
import pytest

from embedpool.errors import ConflictError, InvalidError
from embedpool.index import CollectionSpec, FaissCollection, dequantize, quantize
from index_testutil import managed_files, naive_maxsim, rand_docs, rand_unit, unit

DIM = 16


def mspec(**kw):
    return CollectionSpec(**{"kind": "multi", "model": "m", "pooler": "tokens", "dim": DIM, **kw})


def _ids(n, prefix="d"):
    return [f"{prefix}{i}" for i in range(n)]


@pytest.mark.parametrize("precision", ["float32", "float16", "int8"])
def test_round_trip_and_exhaustive_equals_naive(coll_dir, rng, precision):
    coll = FaissCollection.create(coll_dir, "m", mspec(precision=precision))
    docs = rand_docs(rng, 30, DIM)
    coll.add(_ids(20), docs[:20], texts=[f"t{i}" for i in range(20)])
    coll.commit()
    coll.add(_ids(10, "e"), docs[20:], metadata=[{"i": i} for i in range(10)])  # second segment
    coll.commit()
    queries = rand_docs(rng, 4, DIM, lo=2, hi=6)
    # reference: naive MaxSim on the stored (quantized) vectors
    stored = [dequantize(*quantize(d, precision)) for d in docs]
    names = _ids(20) + _ids(10, "e")
    ref = [sorted(((naive_maxsim(q, d), n) for d, n in zip(stored, names)), reverse=True)[:5]
           for q in queries]
    before = coll.search(queries, k=5)
    for r, want in zip(before, ref):
        assert [h.id for h in r] == [n for _, n in want]
        np.testing.assert_allclose([h.score for h in r], [s for s, _ in want], rtol=1e-4, atol=1e-4)
    coll.close()
    coll = FaissCollection.open(coll_dir, "m")
    after = coll.search(queries, k=5)
    assert [[(h.id, h.score, h.text, h.metadata) for h in r] for r in after] == \
           [[(h.id, h.score, h.text, h.metadata) for h in r] for r in before]
    assert coll.get("e3")["metadata"] == {"i": 3} and coll.get("d4")["text"] == "t4"
    np.testing.assert_array_equal(coll.get("e3")["vectors"], stored[23])
    st = coll.stats()
    assert st["documents"] == 30 and st["vectors"] == sum(len(d) for d in docs) and st["segments"] == 2
    assert coll.manifest["precision"] == precision
    coll.close()


def test_bytes_per_doc_by_precision(coll_dir, rng):
    docs = rand_docs(rng, 20, DIM, lo=10, hi=10)
    per = {}
    for p in ("float32", "float16", "int8"):
        c = FaissCollection.create(coll_dir, p, mspec(precision=p))
        c.add(_ids(20), docs)
        c.commit()
        per[p] = c.stats()["bytes_per_doc"]
        c.close()
    assert per["float32"] == 10 * DIM * 4 + 16
    assert per["float16"] == 10 * DIM * 2 + 16
    assert per["int8"] == 10 * (DIM + 4) + 16


def test_upsert_delete_and_compact(coll_dir, rng):
    coll = FaissCollection.create(coll_dir, "m", mspec(precision="float16"))
    docs = rand_docs(rng, 40, DIM, lo=3, hi=8)
    coll.add(_ids(40), docs)
    coll.commit()
    seg_file = next(p for p in (coll_dir / "m").iterdir() if p.name.endswith(".vec.npy"))
    ino = seg_file.stat().st_ino
    new = rand_unit(rng, 4, DIM)
    coll.add(["d3"], [new], texts=["new"])
    coll.delete(["d5", "d6"])
    q = [docs[5], docs[3], new]
    for c in (coll, "reopen"):
        if c == "reopen":
            coll.commit()
            # append-only: the first segment file was not rewritten by the second commit
            assert seg_file.stat().st_ino == ino
            coll.close()
            coll = FaissCollection.open(coll_dir, "m")
        hits = coll.search(q, k=40)
        assert all(h.id not in ("d5", "d6") for r in hits for h in r)
        assert len(hits[0]) == 38
        assert hits[2][0].id == "d3" and hits[2][0].text == "new"
        assert hits[1][0].id != "d3" or hits[1][0].score < len(docs[3]) - 1e-2
        assert coll.stats()["tombstones"] == 3
    def results():
        r = coll.search(q, k=10)
        return [[h.id for h in x] for x in r], np.array([[h.score for h in x] for x in r])

    ids_before, scores_before = results()
    coll.compact()
    st = coll.stats()
    assert st["tombstones"] == 0 and st["segments"] == 1 and st["documents"] == 38
    for reopen in (False, True):
        if reopen:
            coll.close()
            coll = FaissCollection.open(coll_dir, "m")
        ids_after, scores_after = results()
        assert ids_after == ids_before
        np.testing.assert_allclose(scores_after, scores_before, rtol=1e-5)
    assert len(managed_files(coll_dir / "m")) == 2  # one segment: .vec.npy + .aux.npz
    coll.close()


def _planted(rng, n_docs=300, dim=32, n_q=12):
    """Each document's tokens scatter around a topic direction; each query is a noisy subset of
    one document's tokens (so that document is the MaxSim top-1 and its pooled vector is close)."""
    topics = rand_unit(rng, n_docs, dim)
    docs = [unit(t + 0.8 * rand_unit(rng, int(rng.integers(4, 21)), dim)) for t in topics]
    targets = rng.choice(n_docs, n_q, replace=False)
    queries = []
    for t in targets:
        d = docs[t]
        take = d[rng.choice(len(d), min(4, len(d)), replace=False)]
        queries.append(unit(take + 0.3 * rng.standard_normal(take.shape).astype(np.float32) / np.sqrt(dim)))
    return docs, targets, queries


def test_tokens_and_two_stage_find_true_maxsim_top1(coll_dir, rng):
    dim = 32
    docs, targets, queries = _planted(rng, dim=dim)
    ids = _ids(len(docs))
    spec = CollectionSpec(kind="multi", dim=dim, companion_pooler="mean", companion_dim=dim)
    coll = FaissCollection.create(coll_dir, "toks", spec)
    coll.add(ids, docs, companion=unit(np.stack([d.mean(0) for d in docs])))  # the companion: a mean each
    coll.commit()
    exact = coll.search(queries, k=3, mode="exhaustive")
    truth = [r[0].id for r in exact]
    assert truth == [f"d{t}" for t in targets]  # planted documents are the true MaxSim top-1
    tok = coll.search(queries, k=3, mode="tokens", k_token=8)
    assert [r[0].id for r in tok] == truth
    assert [r[0].score for r in tok] == pytest.approx([r[0].score for r in exact], rel=1e-5)
    cq = unit(np.stack([q.mean(0) for q in queries]))
    two = coll.search(queries, k=3, mode="two_stage", candidates=20, companion_queries=cq)
    assert [r[0].id for r in two] == truth
    assert [r[0].score for r in two] == pytest.approx([r[0].score for r in exact], rel=1e-5)
    # the token index is saved by commit and reloaded
    coll.commit()
    coll.close()
    coll = FaissCollection.open(coll_dir, "toks")
    assert coll.stats()["token_index"] is True
    assert [r[0].id for r in coll.search(queries, k=3, mode="tokens", k_token=8)] == truth
    # documents added after the token index was built are found through it
    new = rand_unit(rng, 5, dim)
    coll.add(["fresh"], [new], companion=unit(new.mean(0, keepdims=True)))
    assert coll.search([new[:3]], k=1, mode="tokens", k_token=4)[0][0].id == "fresh"
    with pytest.raises(InvalidError, match="companion_queries"):
        coll.search(queries, mode="two_stage")
    with pytest.raises(InvalidError, match="unknown search mode"):
        coll.search(queries, mode="nope")
    coll.close()


def test_multi_bad_input(coll_dir, rng):
    coll = FaissCollection.create(coll_dir, "m", mspec())
    coll.add(_ids(3), rand_docs(rng, 3, DIM))
    coll.commit()
    bad_nan = rand_unit(rng, 3, DIM)
    bad_nan[2, 0] = np.nan
    with pytest.raises(ConflictError, match="multi-vector"):
        coll.add(["x"], rand_unit(rng, 1, DIM))
    with pytest.raises(InvalidError, match="NaN"):
        coll.add(["x", "y"], [rand_unit(rng, 2, DIM), bad_nan])
    with pytest.raises(ConflictError, match="dimension"):
        coll.add(["x"], [rand_unit(rng, 2, DIM + 1)])
    with pytest.raises(InvalidError, match="empty"):
        coll.add(["x"], [np.zeros((0, DIM), np.float32)])
    with pytest.raises(InvalidError, match="keeps no companion vectors for two_stage"):
        coll.search([rand_unit(rng, 2, DIM)], mode="two_stage", companion_queries=rand_unit(rng, 1, DIM))
    assert coll.ids() == _ids(3)
    coll.close()


def test_empty_collection_search(coll_dir, rng):
    coll = FaissCollection.create(coll_dir, "m", mspec())
    assert coll.search([rand_unit(rng, 2, DIM)], k=3) == [[]]
    assert coll.search([rand_unit(rng, 2, DIM)], k=3, mode="tokens") == [[]]
    coll.close()
    s = FaissCollection.create(coll_dir, "s", CollectionSpec(kind="single", dim=DIM))
    assert s.search(rand_unit(rng, 2, DIM), k=3) == [[], []]
    s.close()


def test_a_collection_naming_a_separate_companion_opens_and_refuses_two_stage(coll_dir, rng):
    """A manifest of an older embedpool names a separate companion collection (``companion``),
    which embedpool no longer reads: the collection opens, writes and searches in every other
    mode; two_stage says what to do, naming that collection."""
    coll = FaissCollection.create(coll_dir, "old", mspec())
    docs = rand_docs(rng, 4, DIM)
    coll.add(_ids(4), docs)
    coll.commit()
    coll.close()
    path = coll_dir / "old" / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "companion": "old-mean"}))
    coll = FaissCollection.open(coll_dir, "old")
    assert coll.search([docs[2]], k=1)[0][0].id == "d2"
    coll.add(["d9"], [docs[0]])
    coll.commit()  # the manifest keeps what it named
    for _ in range(2):
        with pytest.raises(InvalidError, match="separate companion collection 'old-mean'.*no longer reads.*"
                                               "--companion-pooler") as e:
            coll.search([docs[2]], mode="two_stage", companion_queries=rand_unit(rng, 1, DIM))
        assert e.value.param == "mode"
        coll.close()
        coll = FaissCollection.open(coll_dir, "old")
    assert coll.spec == mspec() and len(coll) == 5
    coll.close()


def test_tokens_mode_with_trained_token_index(coll_dir, rng):
    docs = rand_docs(rng, 60, DIM, lo=3, hi=8)
    coll = FaissCollection.create(coll_dir, "ivf", mspec(token_factory="IVF4,Flat", precision="int8"))
    coll.add(_ids(60), docs)
    coll.build_token_index()
    coll.commit()
    coll.close()
    coll = FaissCollection.open(coll_dir, "ivf")
    exact = coll.search([docs[9], docs[33]], k=1)
    assert [r[0].id for r in exact] == ["d9", "d33"]
    assert [r[0].id for r in coll.search([docs[9], docs[33]], k=1, mode="tokens", k_token=4)] == ["d9", "d33"]
    coll.close()
