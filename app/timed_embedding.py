"""Embedding with per-pooler timings, for the index job and the evaluation.

One ``Embedder.embed`` call (= one forward pass) per tokenization plan; each pooler's own time
comes from the ``on_pool`` callback of :meth:`poolers.Embedder.embed`, which times every pooler
(including the role-aware ones: ``attention`` with separate query/document heads, ``cluster``
leaving queries unpooled) where the pipeline calls it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from embedpool.poolers import EmbedOptions, Tokenized


@dataclass
class TimedEmbedding:
    """What :func:`embed_by_plan` returns.

    Attributes:
        vectors: per spec, one vector (or ``[n_i, D]`` array) per text.
        seconds: per spec, its plan's forward time plus its own pooling time -- the time it
            would take to encode with that pooler alone.
        pooling: per spec, its own pooling (and post-processing) time.
        forward: per spec, the forward time of its plan, shared by the plan's poolers.
        tokens: tokens through the encoder, all plans.
    """

    vectors: dict[str, list[np.ndarray]]
    seconds: dict[str, float]
    pooling: dict[str, float]
    forward: dict[str, float]
    tokens: int


def embed_by_plan(embedder, texts: list[str], specs: list[str], options: EmbedOptions, *,
                  on_batch: Callable[[int, int], None] | None = None,
                  tokenized: list[Tokenized] | None = None) -> TimedEmbedding:
    """Embed ``texts`` with every spec under ``options``: one ``Embedder.embed`` call (= one
    forward pass) per tokenization plan, timed per spec (see :class:`TimedEmbedding`).
    ``tokenized``: the texts as ``Embedder.measure`` tokenized them (with the same options),
    not tokenized again."""
    groups: dict[str, list[str]] = {}
    for s in dict.fromkeys(specs):
        groups.setdefault(embedder.pooler(s).plan.key, []).append(s)
    out = TimedEmbedding({}, {}, {}, {}, 0)
    for group in groups.values():
        own = dict.fromkeys(group, 0.0)

        def on_pool(spec: str, seconds: float) -> None:
            own[spec] += seconds

        t0 = time.perf_counter()
        res = embedder.embed(texts, group, options, on_batch=on_batch, on_pool=on_pool, tokenized=tokenized)
        shared = max(time.perf_counter() - t0 - sum(own.values()), 0.0)
        for s in group:
            out.vectors[s] = res.vectors[s]
            out.pooling[s] = own[s]
            out.forward[s] = shared
            out.seconds[s] = shared + own[s]
        out.tokens += res.tokens
    return out
