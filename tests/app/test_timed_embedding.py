"""Per-pooler timings of the index job and the evaluation (``app.timed_embedding.embed_by_plan``) come
from ``Embedder.embed``'s ``on_pool`` callback, so every pooler's own time is counted -- also
the role-aware ones the pipeline calls through ``pool_role`` (attention, cluster queries), whose
time a wrapper around ``pool`` never saw."""

from __future__ import annotations

import pytest

from embedpool.app.timed_embedding import embed_by_plan
from embedpool.poolers import EmbedOptions
from embedpool.poolers.base import REGISTRY

TEXTS = ["A cat sat on the mat.", "Stock markets fell sharply as investors sold shares.",
         "Heavy rain and storms are forecast for the weekend, " * 6]


@pytest.mark.parametrize("role", ["query", "document"])
def test_every_pooler_reports_its_own_pooling_time(embedder, role):
    # attention, cls, cluster, fde, landmark, layermean, max, maxpoolbert, mean, pooling, ...; not splade, which
    # refuses this model (no MLM head; tests/poolers/test_splade.py)
    specs = sorted(name for name, cls in REGISTRY.items() if not cls.sparse)
    calls: list[tuple[str, float]] = []
    res = embedder.embed(TEXTS, specs, role=role, on_pool=lambda s, sec: calls.append((s, sec)))
    assert {s for s, _ in calls} == set(specs) and all(sec > 0 for _, sec in calls)
    assert all(len(res.vectors[s]) == len(TEXTS) for s in specs)

    timed = embed_by_plan(embedder, TEXTS, specs, EmbedOptions(role=role))
    for s in specs:
        assert timed.pooling[s] > 0, f"{s}: no pooling time reported ({role})"
        assert timed.seconds[s] == pytest.approx(timed.forward[s] + timed.pooling[s])
    # the poolers of a plan share one forward pass: its time is the same for each of them
    standard = [s for s in specs if embedder.pooler(s).plan == embedder.pooler("mean").plan]
    assert len({timed.forward[s] for s in standard}) == 1
    assert {"mean", "cls", "max", "attention", "cluster", "tokens"} <= set(standard) and "landmark" not in standard
    # what a caller gets is what Embedder.embed gives
    for s in specs:
        for a, b in zip(timed.vectors[s], res.vectors[s]):
            assert a.shape == b.shape and abs(a - b).max() < 1e-5
