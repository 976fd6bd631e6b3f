"""The evaluation report as a terminal table, Markdown and JSON (tables by
:func:`app.tables.render_table`)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from embedpool.app.tables import render_table


def _cols(report: dict) -> list[tuple[str, str, Callable[[Any], str]]]:
    cols = _variant_cols(report)
    if "baseline_model" in report:  # several models (app/evaluation/models.py)
        fp = lambda x: "" if x is None else (f"{x:.2g}" if x < 0.001 else f"{x:.3f}")  # noqa: E731
        at = next(i for i, (k, _, _) in enumerate(cols) if k == "p_value") + 1
        cols = [("model", "model", str), *cols[:at], ("p_model", "p (vs " + report["baseline_model"] + ")", fp),
                *cols[at:]]
    return cols


def _variant_cols(report: dict) -> list[tuple[str, str, Callable[[Any], str]]]:
    f3 = lambda x: "" if x is None else f"{x:.4f}"  # noqa: E731
    fp = lambda x: "" if x is None else (f"{x:.2g}" if x < 0.001 else f"{x:.3f}")  # noqa: E731
    fb = lambda x: "" if x is None else f"{x:,.0f}"  # noqa: E731
    f1 = lambda x: "" if x is None else f"{x:,.1f}"  # noqa: E731
    if report["task"] == "sts":
        return [("pooler", "pooler", str), ("spearman", "Spearman", f3), ("pearson", "Pearson", f3),
                ("p_value", "p (vs " + report["baseline"] + ")", fp), ("vectors_per_doc", "vectors/sent", f1),
                ("bytes_per_doc", "bytes/sent", fb), ("encode_s", "encode s", f1)]
    cols = [("pooler", "pooler", str), ("mode", "mode", lambda x: x or "")]
    if report["task"] == "synthetic_long":
        cols.append(("distractors", "K", str))
    hybrid = [("p_vs_vector", "p vs its vector row", fp), ("p_vs_bm25", "p vs bm25", fp)] \
        if any("p_vs_vector" in r for r in report["results"]) else []
    return cols + [("ndcg@10", "nDCG@10", f3), ("recall@100", "R@100", f3), ("mrr@10", "MRR@10", f3),
                   ("map@100", "MAP@100", f3), ("p_value", "p nDCG (vs " + report["baseline"] + ")", fp), *hybrid,
                   ("vectors_per_doc", "vectors/doc", f1), ("bytes_per_doc", "bytes/doc", fb),
                   ("encode_s", "encode s", f1), ("query_latency_ms", "query ms", f1)]


def format_report(report: dict) -> str:
    if report["task"] == "stress":
        from embedpool.app.evaluation.stress import format_stress

        return format_stress(report)
    cols = _cols(report)
    rows = [[fmt(r.get(k)) for k, _, fmt in cols] for r in report["results"]]
    head = _headline(report)
    return head + "\n" + render_table([h for _, h, _ in cols], rows)


def _headline(report: dict) -> str:
    if report["task"] == "sts":
        return (f"STS {report.get('dataset', '')} {report.get('split', '')}: {report['pairs']} pairs, "
                f"model {report['model']} ({report['encoder_precision']}); p-values: {report['stat_test']}")
    if report["task"] == "synthetic_long":
        sl = report["synthetic_long"][0]
        what = (f"K = {', '.join(map(str, report['distractors']))}: {sl['needles']} long documents with a "
                f"needle + {sl['negatives']} haystack-only ones per K, {report['queries']} queries")
    else:
        what = f"{report['documents']} documents, {report['queries']} queries"
    return (f"{report['task']} {report.get('dataset', '')} {report.get('split', '')}: {what}, model {report['model']} "
            f"({report['encoder_precision']}); p-values: ranx {report['stat_test']} "
            f"({'paired t-test' if report['stat_test'] == 'student' else 'randomization test'}) vs {report['baseline']}")


def to_markdown(report: dict) -> str:
    if report["task"] == "stress":
        from embedpool.app.evaluation.stress import format_stress

        return "<!-- embedpool eval --stress -->\n\n" + format_stress(report, markdown=True) + "\n"
    cols = _cols(report)
    rows = [[f"`{r[k]}`" if k == "pooler" else fmt(r.get(k)) for k, _, fmt in cols] for r in report["results"]]
    lines = ["<!-- embedpool eval -->", "", _headline(report), "",
             render_table([h for _, h, _ in cols], rows, markdown=True)]
    if report["task"] == "synthetic_long":
        lines += ["", "nDCG@10 by number of distractors K:", "", _by_k(report)]
    return "\n".join(lines) + "\n"


def _by_k(report: dict) -> str:
    ks = report["distractors"]
    series: dict[tuple, dict[int, float]] = {}
    for r in report["results"]:
        series.setdefault((r["pooler"], r["mode"]), {})[r["distractors"]] = r["ndcg@10"]
    rows = [[f"`{p}`", m or ""] + [f"{vals[k]:.4f}" if k in vals else "" for k in ks]
            for (p, m), vals in series.items()]
    return render_table(["pooler", "mode"] + [f"K={k}" for k in ks], rows, markdown=True)


def write_outputs(report: dict, out: str | Path | None = None, markdown: str | Path | None = None,
                  plot: str | Path | None = None) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(_jsonable(report), indent=2) + "\n")
    if markdown:
        Path(markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(markdown).write_text(to_markdown(report))
    if plot:
        from embedpool.app.evaluation.plot import plot_report

        Path(plot).parent.mkdir(parents=True, exist_ok=True)
        plot_report(report, plot)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, float)):
        return None if not math.isfinite(float(x)) else float(x)
    if isinstance(x, np.integer):
        return int(x)
    return x
