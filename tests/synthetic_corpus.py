"""Synthetic documents shaped like real ones, for measuring collections at sizes nobody can encode.

A :class:`SyntheticCorpus` draws from *real* multi-vector documents (e.g. SciFact abstracts
pooled with ``cluster:pool_factor=16`` by the real default model, passed in as arrays: this
module needs no model and imports numpy only, so the storage benchmark and the index tests can
both use it). Document ``j`` of the synthetic corpus:

- takes the vector count and the vectors of one real *base* document (so vectors per document
  follow the real distribution exactly);
- replaces each vector with probability ``mix`` by a vector of a second real document (new
  combinations of topics);
- perturbs every vector along the data's own directions, ``v + noise * (x - y)`` for two random
  real vectors ``x, y``, then normalizes it (isotropic noise would make the vectors less
  anisotropic than real embeddings are);
- has as companion the ``mean`` of its vectors, normalized -- what the mean pooler computes
  over a document's states (masked average, then the output normalization).

Documents are generated in fixed blocks of :data:`BLOCK` from ``(seed, block)``, so any range of
them is reproducible without generating what comes before (a fresh build of a subset is the
same documents as in the big build).

No embedpool command reaches it, so it is not in the installed package: it lives with the tests
(``tests/index/test_index_scale.py``), and ``bench/million.py`` and ``bench/filters.py`` put
``tests/`` on their path for it, as ``bench/scale.py`` does for the memory measurements.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

BLOCK = 1000


def normalize(x: np.ndarray) -> np.ndarray:
    return (x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)).astype(np.float32)


@dataclass
class Batch:
    """Documents ``start .. start + len(ids)``: ids, their vectors and their companion vectors."""

    start: int
    ids: list[str]
    docs: list[np.ndarray]  # [n_i, dim] float32, normalized
    companion: np.ndarray  # [n, dim] float32, normalized


class SyntheticCorpus:
    """An endless corpus of documents recombined from ``sources`` (see the module docstring).

    Args:
        sources: real documents, ``[n_i, dim]`` float32 vectors each (normalized).
        seed: the corpus; the same seed gives the same documents.
        mix: probability that a vector comes from a second real document.
        noise: step along ``x - y`` (two random real vectors) added to every vector.
    """

    def __init__(self, sources: list[np.ndarray], seed: int = 0, mix: float = 0.3,
                 noise: float = 0.3) -> None:
        if not sources:
            raise ValueError("no source documents")
        self.pool = normalize(np.concatenate(sources).astype(np.float32))
        self.lens = np.array([len(s) for s in sources], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lens)])
        self.dim = self.pool.shape[1]
        self.seed, self.mix, self.noise = seed, mix, noise

    @property
    def mean_vectors_per_doc(self) -> float:
        return float(self.lens.mean())

    def block(self, b: int) -> Batch:
        """Documents ``b * BLOCK .. (b + 1) * BLOCK``."""
        rng = np.random.default_rng([self.seed, b])
        n_src = len(self.lens)
        base = rng.integers(0, n_src, BLOCK)
        other = rng.integers(0, n_src, BLOCK)
        lens = self.lens[base]
        offs = np.concatenate([[0], np.cumsum(lens)])
        total = int(offs[-1])
        doc_of = np.repeat(np.arange(BLOCK), lens)
        rows = self.offsets[base][doc_of] + (np.arange(total) - offs[:-1][doc_of])
        swap = rng.random(total) < self.mix
        o = other[doc_of[swap]]
        rows[swap] = self.offsets[o] + (rng.random(int(swap.sum())) * self.lens[o]).astype(np.int64)
        x, y = rng.integers(0, len(self.pool), (2, total))
        v = self.pool[rows]
        v += self.noise * (self.pool[x] - self.pool[y])
        v = normalize(v)
        comp = normalize(np.add.reduceat(v, offs[:-1], axis=0) / lens[:, None])
        start = b * BLOCK
        return Batch(start, [f"d{start + i}" for i in range(BLOCK)], np.split(v, offs[1:-1]), comp)

    def batches(self, n_docs: int, keep=None) -> Iterator[Batch]:
        """The first ``n_docs`` documents, block by block; with ``keep`` (a function of the
        document number array returning a bool mask), only the documents it keeps."""
        for b in range((n_docs + BLOCK - 1) // BLOCK):
            bt = self.block(b)
            n = min(BLOCK, n_docs - bt.start)
            sel = np.arange(n)
            if keep is not None:
                sel = sel[keep(bt.start + sel)]
            yield Batch(bt.start, [bt.ids[i] for i in sel], [bt.docs[i] for i in sel], bt.companion[sel])


def nn_similarities(docs: list[np.ndarray], n_probe: int = 2000, seed: int = 0) -> np.ndarray:
    """For ``n_probe`` random vectors, the cosine of their nearest vector in *another* document
    (the statistic a token-level or MaxSim search depends on)."""
    flat = normalize(np.concatenate(docs))
    owner = np.repeat(np.arange(len(docs)), [len(d) for d in docs])
    rng = np.random.default_rng(seed)
    probe = rng.choice(len(flat), min(n_probe, len(flat)), replace=False)
    sims = flat[probe] @ flat.T
    sims[owner[probe][:, None] == owner[None, :]] = -np.inf
    return sims.max(axis=1)
