"""STS evaluation: Spearman (and Pearson) correlation of the similarity of each sentence pair
(cosine; normalized symmetric MaxSim for multi-vector poolers, :func:`app.retrieval.similarity`)
with the gold scores; significance against the baseline by a paired bootstrap over the pairs."""

from __future__ import annotations

from typing import Any

import numpy as np

from embedpool.app.timed_embedding import embed_by_plan
from embedpool.poolers import EmbedOptions
from embedpool.app.retrieval import similarity
from embedpool.errors import InvalidError


def _bootstrap_p(gold: np.ndarray, x: np.ndarray, y: np.ndarray, n: int = 2000, seed: int = 0) -> float:
    """Two-sided paired bootstrap p-value for Spearman(x) != Spearman(y) over the same pairs."""
    from scipy.stats import rankdata

    rng = np.random.default_rng(seed)
    diffs = np.empty(n)
    for i in range(n):
        idx = rng.integers(0, len(gold), len(gold))
        g = rankdata(gold[idx])
        diffs[i] = np.corrcoef(g, rankdata(x[idx]))[0, 1] - np.corrcoef(g, rankdata(y[idx]))[0, 1]
    p = 2 * min((diffs <= 0).mean(), (diffs >= 0).mean())
    return float(min(1.0, max(p, 1.0 / n)))


def _baseline_spec(embedder, specs: list[str], baseline: str | None) -> str:
    mean = embedder.canonical("mean")
    bc = embedder.canonical(baseline) if baseline else (mean if mean in specs else specs[0])
    if bc not in specs:
        raise InvalidError(f"--baseline {baseline!r} is not one of the evaluated poolers", param="--baseline")
    return bc


def evaluate_sts(embedder, pairs: list[tuple[str, str, float]], poolers: list[str], *,
                 baseline: str | None = None, name: str = "sts", info: dict | None = None,
                 seed: int = 0) -> dict[str, Any]:
    """Score every pooler on the ``(sentence1, sentence2, score)`` pairs; the report's rows
    are one per pooler (see :mod:`app.evaluation.report`)."""
    from scipy.stats import pearsonr, spearmanr

    sentences = list(dict.fromkeys([p[0] for p in pairs] + [p[1] for p in pairs]))
    pos = {s: i for i, s in enumerate(sentences)}
    specs = list(dict.fromkeys(embedder.canonical(p) for p in poolers))
    labels: dict[str, str] = {}
    for p in poolers:
        labels.setdefault(embedder.canonical(p), p)
    # Both sides of a pair are the same kind of text: embed them all as documents, so a
    # document-side pooler (cluster) pools them as it would pool a corpus.
    emb = embed_by_plan(embedder, sentences, specs, EmbedOptions(role="document"))
    gold = np.array([p[2] for p in pairs])
    preds, rows = {}, []
    for s in specs:
        v = emb.vectors[s]
        multi = bool(embedder.pooler(s).multi_vector)
        preds[s] = np.array([similarity(v[pos[a]], v[pos[b]], multi) for a, b, _ in pairs])
        n_vec = sum(len(x) if multi else 1 for x in v)
        rows.append({"pooler": labels[s], "mode": None, "label": labels[s], "kind": "multi" if multi else "single",
                     "spearman": float(spearmanr(gold, preds[s]).statistic),
                     "pearson": float(pearsonr(gold, preds[s]).statistic),
                     "bytes_per_doc": 4.0 * embedder.output_dim(s) * n_vec / len(sentences),
                     "vectors_per_doc": n_vec / len(sentences), "encode_s": round(emb.seconds[s], 3)})
    bc = _baseline_spec(embedder, specs, baseline)
    for s, r in zip(specs, rows):
        r["p_value"] = None if s == bc else _bootstrap_p(gold, preds[s], preds[bc], seed=seed)
    return {"task": "sts", **(info or {}), "model": embedder.model_id,
            "encoder_precision": getattr(embedder.encoder, "precision", None),
            "pairs": len(pairs), "sentences": len(sentences), "baseline": labels[bc],
            "stat_test": "paired bootstrap (2000 resamples) of the Spearman difference", "results": rows,
            # what a comparison across models pairs (app/evaluation/models.py)
            "gold": gold.tolist(), "per_pair": {labels[s]: preds[s].tolist() for s in specs}}
