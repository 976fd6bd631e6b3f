"""Evaluation of poolers on the same pipeline, collections and retrieval path as the service:
BEIR retrieval (:mod:`.retrieval`), STS (:mod:`.sts`), synthetic long documents (:mod:`.long`), the
distractor stress test (:mod:`.stress`),
ranx metrics (:mod:`.metrics`), several models in one report (:mod:`.models`), and the report as a table, Markdown, JSON (:mod:`.report`) or a
plot (:mod:`.plot`). The datasets come from :mod:`app.datasets`."""

from embedpool.app.evaluation.long import evaluate_synthetic_long, synthetic_long
from embedpool.app.evaluation.scoring import METRICS, STAT_TESTS, score_runs
from embedpool.app.evaluation.models import evaluate_models, model_entries
from embedpool.app.evaluation.report import format_report, to_markdown, write_outputs
from embedpool.app.evaluation.beir import DEPTH, QueryVectors, evaluate_retrieval
from embedpool.app.evaluation.stress import evaluate_stress
from embedpool.app.evaluation.sts import evaluate_sts

__all__ = ["DEPTH", "METRICS", "STAT_TESTS", "QueryVectors", "evaluate_models", "evaluate_retrieval", "evaluate_stress",
           "evaluate_sts", "evaluate_synthetic_long", "model_entries", "format_report", "score_runs", "synthetic_long", "to_markdown",
           "write_outputs"]
