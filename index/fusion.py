"""Hybrid search: fuse a vector ranking with a lexical (BM25) one. Pure functions on hit lists;
they know nothing about storage (as PyLate's ``rank/``).

Three fusions, as the systems users compare with (Elasticsearch / Qdrant / Milvus ``RRFRanker``;
Weaviate's ``relativeScoreFusion`` / NextPlaid's relative-score fusion; Qdrant's
distribution-based score fusion), each with one ``weight`` -- the vector side's share, Weaviate's
``alpha``: 1 is the vector ranking alone, 0 BM25 alone:

- ``rrf``: reciprocal rank fusion, ``weight / (60 + rank_vector) + (1 - weight) / (60 +
  rank_bm25)`` (ranks from 1; a document missing from a list gets nothing from it);
- ``score``: each list's scores min-max normalized to [0, 1] (distances -- ``l2`` -- negated
  first), then ``weight * vector + (1 - weight) * bm25``;
- ``zscore``: each list's scores standardized, ``(s - mean) / std`` over the list (distances
  negated first), shifted so that the list's lowest is 0 -- the value a document missing from
  the list gets -- then ``weight * vector + (1 - weight) * bm25``. A list whose scores are all
  equal (or a single hit) orders nothing and contributes nothing. Unlike Qdrant's DBSF (mean
  +- 3 std as the ends) a missing document is no worse than the list's last, so a document is
  not lifted merely for being in both lists.

Which weight: docs/evaluation.md measures them (``bench/hybrid_fusion.py``). No fixed weight keeps
a hybrid at or above its better side everywhere (0.5 fuses a useless vector side of long
documents at half strength), so ``embedpool eval`` can choose the weight on a labelled dev
split and store it in the collection (:data:`TUNED_PROPERTY`); a hybrid search that names no
fusion or weight uses the stored ones (:func:`stored_fusion`), else ``rrf`` at 0.5.

A side whose weight is 0 contributes no documents (the caller does not even search it), so a
weight of 0 or 1 gives exactly the other side's ranking.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from embedpool.errors import InvalidError

FUSIONS = ("rrf", "score", "zscore")
#: what a hybrid search that names neither uses, where the collection stores no tuned fusion
DEFAULT_FUSION, DEFAULT_WEIGHT = "rrf", 0.5
#: the collection property holding the fusion tuned for it: JSON ``{vector_mode: {"fusion",
#: "weight", ...what it was tuned on}}``
TUNED_PROPERTY = "hybrid_fusion"
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


def stored_fusion(raw: str | None, vector_mode: str) -> tuple[str, float] | None:
    """The ``(fusion, weight)`` a collection's :data:`TUNED_PROPERTY` value stores for
    ``vector_mode`` (``None``: nothing stored, or nothing usable)."""
    try:
        entry = json.loads(raw).get(vector_mode) if raw else None
        return check_fusion(entry["fusion"], entry["weight"]) if entry else None
    except (ValueError, TypeError, KeyError, AttributeError, InvalidError):
        return None


def tuned_entry(raw: str | None, vector_mode: str, fusion: str, weight: float, **about) -> str:
    """:data:`TUNED_PROPERTY`'s new value: ``raw`` with ``vector_mode``'s entry set."""
    try:
        table = json.loads(raw) if raw else {}
        table = table if isinstance(table, dict) else {}
    except ValueError:
        table = {}
    fusion, weight = check_fusion(fusion, weight)
    table[vector_mode] = {"fusion": fusion, "weight": weight, **about}
    return json.dumps(table, sort_keys=True)


def _normalized(scores: Sequence[float], lower_is_better: bool) -> list[float]:
    s = [-x for x in scores] if lower_is_better else list(scores)
    lo, hi = min(s), max(s)
    return [1.0] * len(s) if hi == lo else [(x - lo) / (hi - lo) for x in s]


def _standardized(scores: Sequence[float], lower_is_better: bool) -> list[float]:
    """z-scores over the list, shifted so its lowest is 0; all 0 for a list that orders nothing."""
    s = [-float(x) for x in scores] if lower_is_better else [float(x) for x in scores]
    mean = math.fsum(s) / len(s)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in s) / len(s))
    if not std > 0:
        return [0.0] * len(s)
    lo = min(s)
    return [(x - lo) / std for x in s]  # (x - mean) / std - (lo - mean) / std


def _parts(fusion: str, scores: Sequence[float], lower: bool) -> list[float]:
    if fusion == "rrf":
        return [1.0 / (RRF_K + r) for r in range(1, len(scores) + 1)]
    if fusion == "zscore":
        return _standardized(scores, lower)
    return _normalized(scores, lower)


def fuse(vector: Sequence, lexical: Sequence, k: int, fusion: str = "rrf", weight: float = 0.5,
         lower_is_better: bool = False) -> list:
    """The best ``k`` of two rankings of hits (objects with ``id`` and ``score``, best first),
    fused; each result is the first hit object seen for its id, with the fused ``score``.

    Args:
        vector, lexical: the two rankings.
        fusion: ``rrf``, ``score`` or ``zscore`` (module docstring).
        weight: the vector side's weight, 0..1.
        lower_is_better: the vector scores are distances (``l2``).
    """
    sides = []
    if weight > 0 and vector:
        sides.append((vector, weight, lower_is_better))
    if weight < 1 and lexical:
        sides.append((lexical, 1.0 - weight, False))
    scored = [(hits, w, _parts(fusion, [h.score for h in hits], lower)) for hits, w, lower in sides]
    # a side that orders nothing (zscore: all its scores equal) adds its documents last, so the
    # other side's ranking comes first and whole
    scored.sort(key=lambda side: not any(side[2]) and fusion == "zscore")
    fused: dict[str, float] = {}
    first: dict[str, object] = {}
    for hits, w, parts in scored:
        for h, p in zip(hits, parts):
            fused[h.id] = fused.get(h.id, 0.0) + w * p
            first.setdefault(h.id, h)
    order = sorted(first, key=lambda i: -fused[i])  # stable: ties keep vector, then lexical order
    out = []
    for i in order[:k]:
        h = first[i]
        out.append(type(h)(**{**h.__dict__, "score": fused[i]}))
    return out
