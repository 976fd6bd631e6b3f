"""Deterministic add/upsert/delete/commit workload for the crash-safety test.

Run as a script (``python index_crash_workload.py DATA_DIR KIND``), it opens or creates the
collection, continues after the batches already committed, and prints ``committed <b>`` after
each ``commit()`` returns, until it is killed.
"""

from __future__ import annotations

import sys

import numpy as np

from embedpool.index import FaissCollection, CollectionSpec
from index_testutil import rand_unit

B = 30
DIM = 32
NAME = "crash"


def spec(kind: str) -> CollectionSpec:
    if kind == "single":
        return CollectionSpec(kind="single", model="m", pooler="mean", dim=DIM)
    return CollectionSpec(kind="multi", model="m", pooler="tokens", dim=DIM, precision="int8")


def batch(b: int, kind: str):
    """Batch b: B new documents plus an upsert of b{b-1}-0; then b{b-1}-1 is deleted."""
    rng = np.random.default_rng(10_000 + b)
    ids = [f"b{b}-{j}" for j in range(B)] + ([f"b{b - 1}-0"] if b else [])
    if kind == "single":
        vecs = rand_unit(rng, len(ids), DIM)
    else:
        vecs = [rand_unit(rng, int(rng.integers(1, 6)), DIM) for _ in ids]
    texts = [f"{i}@{b} {term(i, b)}" for i in ids]
    deletes = [f"b{b - 1}-1"] if b else []
    return ids, vecs, texts, deletes


def term(doc_id: str, b: int) -> str:
    """A word only this version of this document has (what its lexical hits are checked by)."""
    return f"w{doc_id.replace('-', 'x')}v{b}"


def expected(c: int, kind: str) -> dict:
    """id -> (text, vector(s)) after batches 0..c-1 were committed."""
    state: dict = {}
    for b in range(c):
        ids, vecs, texts, deletes = batch(b, kind)
        for i, v, t in zip(ids, vecs, texts):
            state[i] = (t, v)
        for d in deletes:
            del state[d]
    return state


def committed_batches(coll: FaissCollection) -> list[int]:
    return sorted(int(i[1:].split("-")[0]) for i in coll.ids() if i.endswith("-2"))


def main() -> None:
    data_dir, kind = sys.argv[1], sys.argv[2]
    coll = FaissCollection.open_or_create(data_dir, NAME, spec(kind))
    b = len(committed_batches(coll))
    print(f"start {b}", flush=True)
    while True:
        ids, vecs, texts, deletes = batch(b, kind)
        coll.add(ids, vecs, texts=texts, metadata=[{"batch": b}] * len(ids))
        if deletes:
            coll.delete(deletes)
        coll.commit()
        print(f"committed {b}", flush=True)
        b += 1


if __name__ == "__main__":
    main()
