"""A multi-vector collection being built holds in memory only the segment it is filling: the
token vectors of every committed segment are read from the files the commit wrote."""

import ctypes

import numpy as np
import psutil

from embedpool.index import FaissCollection, CollectionSpec
from index_testutil import naive_maxsim, unit

DIM = 384
DOCS, TOKENS = 40, 1000  # per commit: 40 x 1000 x 384 float32 = 61 MB


def _rss_mb() -> float:
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the system: RSS = memory in use
    return psutil.Process().memory_info().rss / 2**20


def _batch(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [unit(rng.standard_normal((TOKENS, DIM)).astype(np.float32)) for _ in range(DOCS)]


def test_committed_token_vectors_leave_memory(coll_dir):
    spec = CollectionSpec(kind="multi", model="m", pooler="tokens", dim=DIM)
    coll = FaissCollection.create(coll_dir, "m", spec)
    rss = []
    for c in range(4):
        coll.add([f"c{c}d{i}" for i in range(DOCS)], _batch(c))
        coll.commit()
        rss.append(_rss_mb())
    # 3 more commits of 61 MB each: held in memory, RSS would grow by ~183 MB
    assert rss[-1] - rss[0] < 50, rss
    assert coll.stats()["documents"] == 4 * DOCS and coll.stats()["segments"] == 4
    # compaction merges the segments into one that is again read from its file
    coll.delete(["c1d0"])
    coll.compact()
    assert coll.stats()["segments"] == 1 and _rss_mb() - rss[0] < 50
    # the vectors read back from the files are the ones added, and search is exact MaxSim
    first = _batch(0)
    np.testing.assert_array_equal(coll.get("c0d3")["vectors"], first[3])
    query = first[7][:5] + 0.01
    want = max(((naive_maxsim(query, d), f"c0d{i}") for i, d in enumerate(first)))
    hit = coll.search([query], k=1)[0][0]
    assert hit.id == want[1] and abs(hit.score - want[0]) < 1e-4
    np.testing.assert_array_equal(coll.get("c3d5")["vectors"], _batch(3)[5])
    coll.close()
