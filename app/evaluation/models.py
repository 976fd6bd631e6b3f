"""Poolers x models in one report: ``embedpool eval --model A --model B --pooler ...``.

Each model is loaded in turn (one encoder in memory at a time) and evaluated exactly as a
one-model run (:func:`evaluate_models` calls the same evaluation for each); the rows are joined
with a ``model`` column and labels ``MODEL: pooler [mode]``. Every row keeps its paired test
against the baseline pooler *of its model*; ``p_model`` adds the paired test against the same
pooler (and mode, and K) on the baseline model (the first ``--model``), on the same queries or
pairs:

- retrieval and synthetic long documents: per-query nDCG@10, the test ``--stat-test`` names, as
  ranx runs it between poolers -- ``student`` a paired t-test (``scipy.stats.ttest_rel``),
  ``fisher`` a paired randomization test (``scipy.stats.permutation_test``, 10,000 resamples);
- STS: the paired bootstrap of the Spearman difference that compares poolers
  (:func:`app.evaluation.sts._bootstrap_p`).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from embedpool.app.settings import model_entries  # noqa: F401  (the one parser of --model entries)
from embedpool.errors import InvalidError


def evaluate_models(models: Sequence[tuple[str, str | None]], load: Callable[[str | None], Any],
                    evaluate: Callable[[Any, str], dict], *, stat_test: str = "student",
                    log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """``evaluate(embedder, name)`` for every ``(name, path)`` of ``models`` (``load(path)`` makes
    the embedder, released before the next is loaded); the reports joined by :func:`combine`."""
    reports: dict[str, dict] = {}
    for name, path in models:
        if log:
            log(f"model {name}: {path or 'the packaged default'}")
        embedder = load(path)
        reports[name] = evaluate(embedder, name)
        del embedder
        gc.collect()
    return combine(reports, stat_test)


def _key(row: dict) -> tuple:
    """What makes two rows of different models the same variant."""
    return row["pooler"], row.get("mode"), row.get("distractors")


def _per_query(report: dict, row: dict) -> dict | None:
    per = report.get("per_query") or {}
    return per.get(row["label"])


def paired_p(a: dict[str, float] | Sequence[float], b: dict[str, float] | Sequence[float], test: str) -> float | None:
    """Two-sided p-value that per-query scores ``a`` and ``b`` (the same queries) differ."""
    from scipy import stats

    if isinstance(a, dict):
        common = [q for q in a if q in b]
        x, y = np.array([a[q] for q in common]), np.array([b[q] for q in common])
    else:
        x, y = np.asarray(a, float), np.asarray(b, float)
    if len(x) < 2:
        return None
    if np.allclose(x, y):
        return 1.0
    if test == "fisher":
        res = stats.permutation_test((x, y), lambda u, v: np.mean(u - v), permutation_type="samples",
                                     n_resamples=10_000, random_state=0)
        return float(res.pvalue)
    p = float(stats.ttest_rel(x, y).pvalue)
    return 1.0 if math.isnan(p) else p


def combine(reports: dict[str, dict], stat_test: str = "student") -> dict[str, Any]:
    """One report of several models' reports (same task, data, poolers): the rows of all, each
    with ``model``, ``label`` ``MODEL: ...`` and ``p_model`` (see the module docstring)."""
    from embedpool.app.evaluation.sts import _bootstrap_p

    names = list(reports)
    base_name = names[0]
    base = reports[base_name]
    tasks = {r["task"] for r in reports.values()}
    if len(tasks) > 1:
        raise InvalidError(f"the models' reports are of different tasks: {sorted(tasks)}")
    base_rows = {_key(r): r for r in base["results"]}
    results = []
    for name, rep in reports.items():
        for row in rep["results"]:
            out = {**row, "model": name, "label": f"{name}: {row['label']}", "p_model": None}
            other = base_rows.get(_key(row))
            if name != base_name and other is not None:
                if rep["task"] == "sts":
                    x, y = rep["per_pair"][row["label"]], base["per_pair"][other["label"]]
                    out["p_model"] = _bootstrap_p(np.asarray(rep["gold"]), np.asarray(x), np.asarray(y))
                else:
                    a, b = _per_query(rep, row), _per_query(base, other)
                    out["p_model"] = paired_p(a, b, stat_test) if a and b else None
            results.append(out)
    skip = ("results", "per_query", "per_pair", "gold", "model", "encoder_precision", "index", "timings")
    return {**{k: v for k, v in base.items() if k not in skip},
            "model": ", ".join(f"{n} ({r['model']})" for n, r in reports.items()),
            "models": {n: r["model"] for n, r in reports.items()},
            "encoder_precision": ", ".join(f"{n}: {r.get('encoder_precision')}" for n, r in reports.items()),
            "baseline_model": base_name,
            "per_model": {n: {k: v for k, v in r.items() if k in ("index", "timings", "baseline")}
                          for n, r in reports.items()},
            "results": results}
