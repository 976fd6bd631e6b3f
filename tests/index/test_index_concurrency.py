"""Searches in several threads while one thread adds, upserts and commits."""

import threading

import numpy as np
import pytest

from embedpool.index import FaissCollection, CollectionSpec
from index_testutil import rand_docs, rand_unit

DIM = 16
B = 20
BATCHES = 25


@pytest.mark.parametrize("kind", ["single", "multi"])
def test_concurrent_search_during_add_sees_whole_batches(coll_dir, rng, kind):
    coll = FaissCollection.create(coll_dir, "c", CollectionSpec(kind=kind, dim=DIM))
    if kind == "single":
        batches = [rand_unit(rng, B, DIM) for _ in range(BATCHES)]
        probe = batches[0][:1]
    else:
        batches = [rand_docs(rng, B, DIM, lo=1, hi=6) for _ in range(BATCHES)]
        probe = [batches[0][0]]

    def add(b):
        ids = [f"b{b}-{j}" for j in range(B)] + ([] if b == 0 else ["b0-1"])  # + an upsert
        vecs = batches[b] if kind == "single" else list(batches[b])
        extra = rand_unit(rng, 1, DIM) if kind == "single" else [rand_unit(rng, 2, DIM)]
        if b:
            vecs = np.concatenate([vecs, extra]) if kind == "single" else vecs + extra
        coll.add(ids, vecs, texts=[f"batch {b}"] * len(ids), metadata=[{"b": b}] * len(ids))

    add(0)
    coll.commit()
    errors, searches = [], [0]
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            try:
                (hits,) = coll.search(probe, k=B * BATCHES + 10)
                got = {}
                for h in hits:
                    assert h.text == f"batch {h.metadata['b']}"  # doc store in step with vectors
                    got.setdefault(int(h.id[1:].split("-")[0]), []).append(h.id)
                n = len(got)
                assert sorted(got) == list(range(n)), "batches seen are not a prefix"
                assert all(len(v) == B for b, v in got.items() if b > 0), "a partial batch is visible"
                assert len(got[0]) == B
                assert sum(h.id == "b0-1" for h in hits) == 1  # upserted doc appears exactly once
                assert hits[0].id == "b0-0"
                assert len(coll) >= n * B  # a later call may see more batches, never fewer
                searches[0] += 1
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)
                return

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for b in range(1, BATCHES):
            add(b)
            if b % 5 == 0:
                coll.commit()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not errors, repr(errors[0])
    assert searches[0] > 10
    coll.commit()
    coll.close()
    coll = FaissCollection.open(coll_dir, "c")
    assert len(coll) == B * BATCHES
    coll.close()
