"""Retrieval metrics and paired significance tests, from ``ranx``."""

from __future__ import annotations

import math
import os
import sys
import warnings
from typing import Any

import numpy as np

from embedpool.errors import InvalidError, import_extra

METRICS = ("ndcg@10", "recall@100", "mrr@10", "map@100")
STAT_TESTS = ("student", "fisher")
_NO_DOC = "\x00no-result"


def score_runs(qrels: dict[str, dict[str, int]], runs: dict[str, dict[str, dict[str, float]]],
               baseline: str | None = None, stat_test: str = "student",
               metrics: tuple[str, ...] = METRICS) -> dict[str, dict[str, Any]]:
    """Mean metrics per run (ranx) and, against ``baseline``, paired p-values per metric
    (ranx ``compare``: ``student`` paired t-test or ``fisher`` randomization test).

    Returns ``{label: {"metrics": {m: mean}, "per_query": {m: {qid: score}}, "p_values": {m: p}}}``
    (``p_values`` empty for the baseline itself)."""
    if stat_test not in STAT_TESTS:
        raise InvalidError(f"stat test must be one of {', '.join(STAT_TESTS)}", param="--stat-test")
    if "numba" not in sys.modules:
        # ranx's numba kernels: one thread starts ~3x faster on a busy 2-core machine and the
        # problems here are far too small to gain from more
        os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import_extra("ranx", "eval", "Scoring runs")
        from ranx import Qrels, Run, compare, evaluate

        rq = Qrels.from_dict(qrels)
        rruns = {}
        for label, run in runs.items():
            # exactly the judged queries, each with an entry (an empty result is a placeholder
            # document no qrels name, so it scores 0): ranx needs no make_comparable pass, which
            # would JIT-compile more of numba's typed-dict methods (slow to start)
            full = {q: (run.get(q) or {_NO_DOC: 0.0}) for q in qrels}
            rruns[label] = Run.from_dict(full, name=label)
        out: dict[str, dict[str, Any]] = {}
        for label, rr in rruns.items():
            evaluate(rq, rr, list(metrics), return_mean=False)
            per = {m: {q: float(v) for q, v in rr.scores[m].items()} for m in metrics}
            out[label] = {"metrics": {m: float(np.mean(list(per[m].values()))) for m in metrics},
                          "per_query": per, "p_values": {}}
        if baseline is not None and len(rruns) > 1:
            if baseline not in rruns:
                raise InvalidError(f"baseline {baseline!r} is not among the runs", param="--baseline")
            labels = [baseline] + [x for x in rruns if x != baseline]
            rep = compare(rq, [rruns[x] for x in labels], list(metrics), stat_test=stat_test)
            comp = rep.to_dict()[baseline]["comparisons"]
            for x in labels[1:]:
                pv = {}
                for m in metrics:
                    p = float(comp[x][m])
                    if math.isnan(p):  # identical per-query scores: no difference at all
                        same = out[x]["per_query"][m] == out[baseline]["per_query"][m]
                        p = 1.0 if same else p
                    pv[m] = p
                out[x]["p_values"] = pv
    return out
