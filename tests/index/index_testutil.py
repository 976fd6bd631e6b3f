"""Helpers for the index tests (synthetic unit vectors; no model needed)."""

from __future__ import annotations

import numpy as np


def unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def rand_unit(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    return unit(rng.standard_normal((n, dim)))


def rand_docs(rng: np.random.Generator, n: int, dim: int, lo: int = 1, hi: int = 12) -> list[np.ndarray]:
    return [rand_unit(rng, int(rng.integers(lo, hi + 1)), dim) for _ in range(n)]


def naive_maxsim(query: np.ndarray, doc: np.ndarray) -> float:
    """Reference MaxSim written the slow, obvious way (float64)."""
    total = 0.0
    for qt in np.asarray(query, dtype=np.float64):
        total += max(float(np.dot(qt, dt)) for dt in np.asarray(doc, dtype=np.float64))
    return total


def managed_files(folder) -> set[str]:
    import re
    pat = re.compile(r"^(vectors-\d+\.faiss|tokens-\d+\.faiss|seg-\d+\.(vec\.npy|aux\.npz))(\.tmp)?$")
    return {p.name for p in folder.iterdir() if pat.match(p.name)}
