"""The evaluation report as a PNG: the metric against bytes per document (one point per
pooler/mode), or for synthetic long documents against the number of distractors K."""

from __future__ import annotations

from pathlib import Path

from embedpool.errors import import_extra


def plot_report(report: dict, path: str | Path) -> None:
    if report["task"] == "stress":
        from embedpool.app.evaluation.stress import plot_stress

        return plot_stress(report, path)
    matplotlib = import_extra("matplotlib", "eval", "--plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = "spearman" if report["task"] == "sts" else "ndcg@10"
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=120)
    series: dict[str, list[dict]] = {}
    for r in report["results"]:
        series.setdefault(r["label"], []).append(r)
    markers = "osD^v<>pXh*"
    long_docs = report["task"] == "synthetic_long"
    for i, (label, rs) in enumerate(series.items()):
        style = {"marker": markers[i % len(markers)], "color": plt.cm.tab10(i % 10), "label": label}
        if long_docs:  # one line per pooler across the number of distractors K
            rs = sorted(rs, key=lambda r: r["distractors"])
            ax.plot([r["distractors"] for r in rs], [r[metric] for r in rs], **style)
        else:  # one point per pooler/mode
            ax.scatter([max(r["bytes_per_doc"], 1.0) for r in rs], [r[metric] for r in rs], s=40, zorder=3, **style)
    if long_docs:
        ax.set_xlabel("distractor documents K in each long document")
        ax.set_xticks(sorted({r["distractors"] for r in report["results"]}))
    else:
        ax.set_xscale("log")
        ax.set_xlabel("bytes per document (log scale)")
    ax.set_ylabel("Spearman (cosine)" if metric == "spearman" else "nDCG@10")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    against = "K" if long_docs else "bytes/doc"
    title = {"sts": "STS", "retrieval": "retrieval", "synthetic_long": "synthetic long documents"}[report["task"]]
    ax.set_title(f"{report.get('dataset', '')} {report.get('split', '')} {title}: {metric} vs {against}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
