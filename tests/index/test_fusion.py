"""The fusions of hybrid search (index.fusion) on hand-made rankings, against their definitions:
an empty or constant side leaves the other side's order, the sides are symmetric, a weight of 1
or 0 is one side alone, and the z-score fusion's numbers worked out by hand here."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from embedpool.index.fusion import FUSIONS, fuse, stored_fusion, tuned_entry


@dataclass
class H:
    id: str
    score: float


def ranking(*pairs) -> list[H]:
    return [H(i, s) for i, s in pairs]


VEC = ranking(("a", 0.91), ("b", 0.85), ("c", 0.62), ("d", 0.60), ("e", 0.11))
LEX = ranking(("c", 14.0), ("f", 9.5), ("a", 3.0), ("g", 1.0))


def ids(hits) -> list[str]:
    return [h.id for h in hits]


@pytest.mark.parametrize("fusion", FUSIONS)
def test_an_empty_side_leaves_the_other_sides_order(fusion):
    for w in (0.2, 0.5, 0.9):
        assert ids(fuse(VEC, [], 10, fusion, w)) == ids(VEC)
        assert ids(fuse([], LEX, 10, fusion, w)) == ids(LEX)


@pytest.mark.parametrize("fusion", FUSIONS)
def test_weight_one_is_the_vector_side_and_zero_the_lexical_side(fusion):
    assert ids(fuse(VEC, LEX, 10, fusion, 1.0)) == ids(VEC)
    assert ids(fuse(VEC, LEX, 10, fusion, 0.0)) == ids(LEX)
    assert ids(fuse(VEC, LEX, 3, fusion, 1.0)) == ids(VEC)[:3]


def test_a_constant_side_orders_nothing_under_zscore():
    """All BM25 scores equal (or one hit): the fused order is the vector side's, whatever the
    weight, and the constant side's other documents follow."""
    flat = ranking(("x", 2.0), ("c", 2.0), ("y", 2.0))
    for w in (0.1, 0.5, 0.9):
        got = ids(fuse(VEC, flat, 10, "zscore", w))
        assert got[:len(VEC)] == ids(VEC) and got[len(VEC):] == ["x", "y"]
        assert ids(fuse(VEC, ranking(("x", 7.0)), 10, "zscore", w))[:len(VEC)] == ids(VEC)
        assert ids(fuse(flat, LEX, 10, "zscore", w))[:len(LEX)] == ids(LEX)


@pytest.mark.parametrize("fusion", FUSIONS)
def test_swapping_the_sides_and_the_weight_gives_the_same_scores(fusion):
    for w in (0.3, 0.5):
        one = {h.id: h.score for h in fuse(VEC, LEX, 10, fusion, w)}
        other = {h.id: h.score for h in fuse(LEX, VEC, 10, fusion, 1 - w)}
        assert one.keys() == other.keys()
        for i in one:
            assert one[i] == pytest.approx(other[i], rel=1e-12, abs=1e-15)
    # the same ranking on both sides at 0.5: the fused order is that ranking
    assert ids(fuse(VEC, VEC, 10, fusion, 0.5)) == ids(VEC)


def test_zscore_by_hand():
    """A = a 3, b 2, c 1: mean 2, std sqrt(2/3), shifted z: a 2/std, b 1/std, c 0.
    B = b 10, d 0: mean 5, std 5, shifted z: b 2, d 0. At weight w: a 2w/std, b w/std + 2(1-w),
    c 0, d 0 (ties keep the vector side's order first)."""
    a, b = ranking(("a", 3.0), ("b", 2.0), ("c", 1.0)), ranking(("b", 10.0), ("d", 0.0))
    std = math.sqrt(2 / 3)
    for w in (0.5, 0.8):
        got = {h.id: h.score for h in fuse(a, b, 10, "zscore", w)}
        want = {"a": 2 * w / std, "b": w / std + 2 * (1 - w), "c": 0.0, "d": 0.0}
        assert got == pytest.approx(want)
        assert ids(fuse(a, b, 10, "zscore", w)) == sorted(want, key=lambda i: -want[i])
    # distances (l2): smaller is better, so negated first
    dist = ranking(("a", 1.0), ("b", 2.0), ("c", 3.0))
    assert fuse(dist, [], 10, "zscore", 0.5, lower_is_better=True)[0].id == "a"
    assert {h.id: h.score for h in fuse(dist, b, 10, "zscore", 0.5, lower_is_better=True)} == \
        pytest.approx({h.id: h.score for h in fuse(a, b, 10, "zscore", 0.5)})


def test_a_stored_tuned_fusion_reads_back_per_vector_mode():
    raw = tuned_entry(None, "exhaustive", "zscore", 0.35, split="train")
    raw = tuned_entry(raw, "two_stage", "rrf", 1)
    assert stored_fusion(raw, "exhaustive") == ("zscore", 0.35)
    assert stored_fusion(raw, "two_stage") == ("rrf", 1.0)
    assert stored_fusion(raw, "tokens") is None
    for bad in (None, "", "not json", "[]", '{"exhaustive": {"fusion": "max", "weight": 0.3}}',
                '{"exhaustive": {"fusion": "rrf", "weight": 3}}'):
        assert stored_fusion(bad, "exhaustive") is None
