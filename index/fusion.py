"""Hybrid search: fuse a vector ranking with a lexical (BM25) one. Pure functions on hit lists;
they know nothing about storage (as PyLate's ``rank/``).

Two fusions, as the systems users compare with (Elasticsearch / Qdrant / Milvus ``RRFRanker``;
Weaviate's ``relativeScoreFusion`` / NextPlaid's relative-score fusion), both with one
``weight`` -- the vector side's share, Weaviate's ``alpha``: 1 is the vector ranking alone, 0
BM25 alone:

- ``rrf``: reciprocal rank fusion, ``weight / (60 + rank_vector) + (1 - weight) / (60 +
  rank_bm25)`` (ranks from 1; a document missing from a list gets nothing from it);
- ``score``: each list's scores min-max normalized to [0, 1] (distances -- ``l2`` -- negated
  first), then ``weight * vector + (1 - weight) * bm25``.

A side whose weight is 0 contributes no documents (the caller does not even search it), so a
weight of 0 or 1 gives exactly the other side's ranking.
"""

from __future__ import annotations

from collections.abc import Sequence

from embedpool.errors import InvalidError

FUSIONS = ("rrf", "score")
RRF_K = 60
#: how deep each side of a hybrid search is read before fusing (at least ``k``)
DEPTH = 100


def check_fusion(fusion: str, weight: float) -> tuple[str, float]:
    if fusion not in FUSIONS:
        raise InvalidError(f"fusion={fusion!r}: use one of {', '.join(FUSIONS)}", param="fusion")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0.0 <= float(weight) <= 1.0:
        raise InvalidError(f"weight={weight!r}: the vector side's weight is a number from 0 (BM25 only) "
                           "to 1 (vectors only)", param="weight")
    return fusion, float(weight)


def _normalized(scores: Sequence[float], lower_is_better: bool) -> list[float]:
    s = [-x for x in scores] if lower_is_better else list(scores)
    lo, hi = min(s), max(s)
    return [1.0] * len(s) if hi == lo else [(x - lo) / (hi - lo) for x in s]


def fuse(vector: Sequence, lexical: Sequence, k: int, fusion: str = "rrf", weight: float = 0.5,
         lower_is_better: bool = False) -> list:
    """The best ``k`` of two rankings of hits (objects with ``id`` and ``score``, best first),
    fused; each result is the first hit object seen for its id, with the fused ``score``.

    Args:
        vector, lexical: the two rankings.
        fusion: ``rrf`` or ``score`` (module docstring).
        weight: the vector side's weight, 0..1.
        lower_is_better: the vector scores are distances (``l2``).
    """
    sides = []
    if weight > 0 and vector:
        sides.append((vector, weight, lower_is_better))
    if weight < 1 and lexical:
        sides.append((lexical, 1.0 - weight, False))
    fused: dict[str, float] = {}
    first: dict[str, object] = {}
    for hits, w, lower in sides:
        parts = ([1.0 / (RRF_K + r) for r in range(1, len(hits) + 1)] if fusion == "rrf"
                 else _normalized([h.score for h in hits], lower))
        for h, p in zip(hits, parts):
            fused[h.id] = fused.get(h.id, 0.0) + w * p
            first.setdefault(h.id, h)
    order = sorted(first, key=lambda i: -fused[i])  # stable: ties keep vector, then lexical order
    out = []
    for i in order[:k]:
        h = first[i]
        out.append(type(h)(**{**h.__dict__, "score": fused[i]}))
    return out
