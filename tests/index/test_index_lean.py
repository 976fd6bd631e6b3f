"""A collection opened lean (issue 34, part 3): opening maps what a search reads per candidate
(token codes, scales, offsets) instead of reading it, builds the companion's id map only when
something needs it, and a long run of searches holds a bounded share of the mapped pages
(the page cache holds the rest). Small random collections; bench/million.py measures 1M."""

from __future__ import annotations

import numpy as np
import pytest

from embedpool.index import CollectionSpec, FaissCollection
from embedpool.index.faiss import multi
from index_testutil import rand_unit

DIM = 128


def _mapped_rss(pattern: str) -> int:
    """Bytes of this process's resident pages in mappings of files whose name contains
    ``pattern`` (/proc/self/smaps)."""
    total, current = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if len(head) >= 5 and "-" in head[0] and not line.startswith(("Rss", "Size")):
                current = pattern in line
            elif current and line.startswith("Rss:"):
                total += int(head[1]) * 1024
    return total


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    rng = np.random.default_rng(7)
    path = tmp_path_factory.mktemp("lean")
    spec = CollectionSpec(kind="multi", model="m", pooler="tokens", dim=DIM, precision="int8",
                          companion_pooler="mean", companion_dim=DIM, companion_factory="IVF16,SQ8")
    coll = FaissCollection.create(path, "c", spec)
    docs = [rand_unit(rng, int(rng.integers(20, 40)), DIM) for _ in range(4000)]
    means = np.stack([d.mean(0) / np.linalg.norm(d.mean(0)) for d in docs]).astype(np.float32)
    for a in range(0, len(docs), 1000):  # four commits: a companion base and deltas
        coll.add([f"d{i}" for i in range(a, a + 1000)], docs[a:a + 1000], companion=means[a:a + 1000])
        coll.commit()
    coll.close()
    return path, docs, means


def test_searches_hold_a_bounded_share_of_the_mapped_pages(built):
    path, docs, means = built
    coll = FaissCollection.open(path, "c")
    codes = sum(f.stat().st_size for f in (path / "c").glob("seg-*.vec.npy"))
    for seg in coll._vec.segments:  # what a search reads per candidate is mapped, not read
        assert isinstance(seg.codes, np.memmap) and isinstance(seg.scales, np.memmap)
        assert isinstance(seg.offsets, np.memmap)
    assert _mapped_rss(".vec.npy") < 0.05 * codes
    rng = np.random.default_rng(0)
    for i in rng.choice(len(docs), 80, replace=False):  # 80 x 50 candidates: 4,000 reranked
        hits = coll.search([docs[i][:8]], k=5, mode="two_stage", candidates=50,
                           companion_queries=means[i:i + 1])[0]
        assert hits[0].id == f"d{i}"
    # every document was a candidate about once: without drops most pages would be mapped
    assert _mapped_rss(".vec.npy") < 0.3 * codes, (_mapped_rss(".vec.npy"), codes)
    # an exhaustive search reads every page, and leaves none of them in this process
    hits = coll.search([docs[3][:8]], k=5, mode="exhaustive")[0]
    assert hits[0].id == "d3"
    assert _mapped_rss(".vec.npy") < 0.05 * codes
    assert _mapped_rss(".aux.npz") < 0.05 * codes
    coll.close()


def test_drops_happen_every_so_many_candidates(built, monkeypatch):
    path, docs, means = built
    monkeypatch.setattr(multi, "DROP_EVERY_DOCS", 10 ** 9)  # never: the mapped pages pile up
    coll = FaissCollection.open(path, "c")
    before = _mapped_rss(".vec.npy")
    for i in range(0, 4000, 50):
        coll.search([docs[i][:8]], k=5, mode="two_stage", candidates=50, companion_queries=means[i:i + 1])
    grown = _mapped_rss(".vec.npy") - before
    monkeypatch.setattr(multi, "DROP_EVERY_DOCS", 1)  # after every search
    coll.search([docs[0][:8]], k=5, mode="two_stage", candidates=50, companion_queries=means[:1])
    assert _mapped_rss(".vec.npy") < grown / 4
    coll.close()


def test_companion_id_map_is_built_when_needed(built, tmp_path):
    import shutil

    import faiss

    path, docs, means = built
    shutil.copytree(path / "c", tmp_path / "c")
    coll = FaissCollection.open(tmp_path, "c")
    ivf = faiss.extract_index_ivf(coll._vec.companion.index)
    assert ivf.direct_map.type == faiss.DirectMap.NoMap  # not built at open
    got = coll.get("d17")["companion"][0]  # reconstruct needs it
    assert ivf.direct_map.type == faiss.DirectMap.Hashtable
    assert float(got @ means[17]) > 0.99  # SQ8 codes of the mean added
    coll.close()
    coll = FaissCollection.open(tmp_path, "c")  # a delete needs it too (remove by id)
    coll.delete([f"d{i}" for i in range(0, 4000, 2)])
    coll.commit()
    coll.close()
    coll = FaissCollection.open(tmp_path, "c")  # tombstones: the live ids are read, not counted
    assert len(coll) == 2000
    hits = coll.search([docs[5][:8]], k=3, mode="two_stage", candidates=20, companion_queries=means[5:6])[0]
    assert hits[0].id == "d5" and all(int(h.id[1:]) % 2 for h in hits)
    hits = coll.search([docs[4][:8]], k=3, mode="two_stage", candidates=20, companion_queries=means[4:5])[0]
    assert "d4" not in [h.id for h in hits]
    coll.close()
