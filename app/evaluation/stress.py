"""The distractor stress test (``embedpool eval --stress distractors``): the diagnostic of GLOT and
of "pooling as vector quantization" on real data. Random distractor words are injected into the
documents (or the queries; for STS the second sentences, the first, or both) until a fraction
``r`` of each text's tokens are distractors, for every ``r`` asked (0% to 90%), and every pooler
is scored at every ratio with the evaluation it gets without stress (:func:`evaluate_retrieval`,
:func:`evaluate_sts`); ratio 0 is the clean score, the reference each curve falls from.

Injection (:func:`inject`): the distractors are whole words drawn at random from the other texts
of the same data (so they are real, in-domain words, not the texts' own), inserted at random
positions between the text's words, its own words kept in order. A text of ``n`` tokens (the
model's tokenizer, without special tokens) gets ``round(r * n / (1 - r))`` distractor tokens,
so that distractors are ``r`` of its tokens; words are drawn until that count is met exactly
(a word that would overshoot is redrawn). WordPiece and the other tokenizers of the encoders
this project runs split at whitespace, so the stressed text's token count is the sum of its
words'. A document longer than the model's window is truncated after injection, as every
document is: the window holds a fraction ``r`` of distractors on average.

Retrieval with stressed queries indexes the corpus once and re-embeds only the queries per
ratio; stressed documents re-index the corpus per ratio (use ``--max-docs`` for a slice).
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from embedpool.app.datasets import BeirData, Record
from embedpool.app.evaluation.beir import QueryVectors, evaluate_retrieval
from embedpool.app.evaluation.sts import evaluate_sts
from embedpool.app.tables import render_table
from embedpool.errors import InvalidError, import_extra

RATIOS = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9)
SIDES = ("documents", "queries", "both")
MAX_RATIO = 0.95  # r / (1 - r) distractor tokens per text token: 19x at 0.95


class Distractors:
    """Draws distractor words and counts tokens with the model's tokenizer.

    Args:
        tokenizer: the encoder's (Hugging Face) tokenizer.
        texts: where distractor words come from.
        seed: the draws' seed.
    """

    def __init__(self, tokenizer, texts: Sequence[str], seed: int = 0) -> None:
        self.tokenizer = tokenizer
        words = sorted({w for t in texts for w in t.split()})
        if not words:
            raise InvalidError("the stress test needs texts with words to draw distractors from")
        self.rng = random.Random(seed)
        if len(words) > 50_000:
            words = self.rng.sample(words, 50_000)
        counts = self.counts(words)
        self.words = [(w, c) for w, c in zip(words, counts) if c > 0]
        self.short = [w for w, c in self.words if c == 1]
        if not self.short:
            raise InvalidError("no one-token word to draw distractors from")

    def counts(self, words: Sequence[str]) -> list[int]:
        """Tokens of each word (no special tokens)."""
        if not words:
            return []
        ids = self.tokenizer(list(words), add_special_tokens=False, verbose=False)["input_ids"]
        return [len(x) for x in ids]

    def tokens(self, text: str) -> int:
        return sum(self.counts(text.split()))

    def inject(self, text: str, ratio: float) -> tuple[str, int, int]:
        """``text`` with distractor words making up ``ratio`` of its tokens: ``(stressed text,
        the text's tokens, the distractor tokens)``."""
        if not 0.0 <= ratio <= MAX_RATIO:
            raise InvalidError(f"a distractor ratio must be between 0 and {MAX_RATIO}, got {ratio}",
                               param="--stress-ratios")
        own = text.split()
        n = sum(self.counts(own))
        target = round(ratio * n / (1 - ratio)) if ratio else 0
        if not target:
            return text, n, 0
        added, got = [], 0
        while got < target:
            word, count = self.words[self.rng.randrange(len(self.words))]
            if got + count > target:  # redraw among one-token words: the count is met exactly
                word, count = self.short[self.rng.randrange(len(self.short))], 1
            added.append(word)
            got += count
        slots = sorted(self.rng.randrange(len(own) + 1) for _ in added)
        out, k = [], 0
        for i in range(len(own) + 1):
            while k < len(added) and slots[k] == i:
                out.append(added[k])
                k += 1
            if i < len(own):
                out.append(own[i])
        return " ".join(out), n, got


def check_ratios(ratios: Sequence[float]) -> list[float]:
    """The ratios asked, sorted, with 0 (the clean reference) first."""
    out = sorted({0.0, *(float(r) for r in ratios)})
    bad = [r for r in out if not 0.0 <= r <= MAX_RATIO]
    if bad:
        raise InvalidError(f"--stress-ratios must lie in [0, {MAX_RATIO}] (fractions of tokens), got {bad[0]}",
                           param="--stress-ratios")
    return out


def evaluate_stress(embedder, poolers: list[str], ratios: Sequence[float], *, side: str = "documents",
                    sts: list[tuple[str, str, float]] | None = None, data: BeirData | None = None,
                    seed: int = 0, info: dict | None = None, log: Callable[[str], None] | None = None,
                    **kw: Any) -> dict[str, Any]:
    """Score every pooler at every distractor ratio, on STS ``sts`` pairs or the BEIR ``data``.

    ``kw``: :func:`evaluate_retrieval`'s options (retrieval) or ``baseline`` (STS). Returns a
    report of ``task: stress`` whose rows are the plain evaluation's rows with ``ratio`` and the
    measured ``injected_fraction`` (distractor tokens over all tokens of the stressed texts)."""
    if side not in SIDES:
        raise InvalidError(f"--stress-side must be one of {', '.join(SIDES)}, got {side!r}", param="--stress-side")
    if (sts is None) == (data is None):
        raise InvalidError("the stress test runs on either STS pairs or a BEIR data set")
    ratios = check_ratios(ratios)
    log = log or (lambda m: None)
    tok = embedder.encoder.tokenizer
    if sts is not None:
        pool = Distractors(tok, [t for a, b, _ in sts for t in (a, b)], seed)
        reports = []
        for r in ratios:
            pool.rng.seed(f"{seed}-{r}")
            pairs, own, added = [], 0, 0
            for a, b, s in sts:
                if side in ("queries", "both"):
                    a, n, m = pool.inject(a, r)
                    own, added = own + n, added + m
                if side in ("documents", "both"):
                    b, n, m = pool.inject(b, r)
                    own, added = own + n, added + m
                pairs.append((a, b, s))
            log(f"stress {r:.0%}: {added} distractor tokens in {len(sts)} pairs")
            rep = evaluate_sts(embedder, pairs, poolers, baseline=kw.get("baseline"), seed=seed, info=info)
            reports.append(_tagged(rep, r, added, own))
        metric, base = "spearman", "sts"
    else:
        assert data is not None
        pool = Distractors(tok, [d.text for d in data.corpus] + list(data.queries.values()), seed)
        if side == "both":
            raise InvalidError("--stress-side both is for STS; on retrieval stress documents or queries",
                               param="--stress-side")
        reports = _retrieval(embedder, data, poolers, ratios, side, pool, seed, log, kw)
        metric, base = "ndcg@10", "retrieval"
    first = reports[0]
    return {**{k: v for k, v in first.items() if k not in ("results", "per_query", "index", "timings")},
            "task": "stress", "stress": "distractors", "base_task": base, "side": side, "metric": metric,
            "ratios": ratios, "results": [row for rep in reports for row in rep["results"]]}


def _tagged(report: dict, ratio: float, added: int, own: int) -> dict:
    frac = added / (added + own) if added + own else 0.0
    report["results"] = [{**row, "ratio": ratio, "injected_fraction": frac} for row in report["results"]]
    return report


def _retrieval(embedder, data: BeirData, poolers, ratios, side, pool: Distractors, seed, log, kw) -> list[dict]:
    reports = []
    index_dir = kw.pop("index_dir", None)
    with tempfile.TemporaryDirectory(prefix="embedpool-stress-") as tmp:
        queries = None  # documents stressed: the clean queries are embedded once
        for r in ratios:
            pool.rng.seed(f"{seed}-{r}")
            own = added = 0
            if side == "documents":
                corpus = []
                for d in data.corpus:
                    text, n, m = pool.inject(d.text, r)
                    corpus.append(Record(d.id, text, d.metadata))
                    own, added = own + n, added + m
                stressed = replace(data, corpus=corpus)
                where = Path(index_dir or tmp) / f"r{round(r * 100)}"
                if queries is None:
                    qids = list(data.qrels)
                    queries = QueryVectors(qids, [data.queries[q] for q in qids], kw.get("latency_queries", 32))
                qv = queries
            else:  # one index of the clean corpus; the queries are stressed
                texts = {}
                for q in data.qrels:
                    texts[q], n, m = pool.inject(data.queries[q], r)
                    own, added = own + n, added + m
                stressed = replace(data, queries=texts)
                where, qv = Path(index_dir or tmp) / "clean", None
            log(f"stress {r:.0%} ({side}): {added} distractor tokens")
            rep = evaluate_retrieval(embedder, stressed, poolers, index_dir=where, name="stress",
                                     query_vectors=qv, log=log, **kw)
            reports.append(_tagged(rep, r, added, own))
    return reports


# ------------------------------------------------------------------ report
def curves(report: dict) -> dict[str, dict[float, float]]:
    """Per pooler label: the metric at each ratio."""
    out: dict[str, dict[float, float]] = {}
    for row in report["results"]:
        out.setdefault(row["label"], {})[row["ratio"]] = row[report["metric"]]
    return out


def format_stress(report: dict, markdown: bool = False) -> str:
    """The metric of every pooler against the ratio, with each ratio's measured injected
    fraction, and the share of the clean score kept at the largest ratio."""
    ratios = report["ratios"]
    fractions = {row["ratio"]: row["injected_fraction"] for row in report["results"]}
    head = ["pooler"] + [f"{r:.0%} ({fractions[r]:.1%})" for r in ratios] + [f"kept at {ratios[-1]:.0%}"]
    rows = []
    for label, vals in curves(report).items():
        clean, last = vals.get(0.0), vals.get(ratios[-1])
        kept = "" if not clean or last is None else f"{last / clean:.1%}"
        rows.append([f"`{label}`" if markdown else label]
                    + [f"{vals[r]:.4f}" if r in vals else "" for r in ratios] + [kept])
    title = (f"distractor stress test, {report.get('dataset', '')} {report.get('split', '')} {report['base_task']} "
             f"({report['metric']}), distractors in the {report['side']}; columns: asked ratio (measured "
             f"injected fraction); model {report['model']}")
    return title + "\n" + ("\n" if markdown else "") + render_table(head, rows, markdown=markdown)


def plot_stress(report: dict, path: str | Path) -> None:
    """The metric against the ratio, one line per pooler, its clean score dotted."""
    matplotlib = import_extra("matplotlib", "eval", "--plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=120)
    for i, (label, vals) in enumerate(curves(report).items()):
        xs = sorted(vals)
        color = plt.cm.tab10(i % 10)
        ax.plot([100 * x for x in xs], [vals[x] for x in xs], marker="osD^v<>pXh*"[i % 11], color=color, label=label)
        ax.axhline(vals.get(0.0, float("nan")), color=color, linestyle=":", linewidth=0.8)
    ax.set_xlabel(f"distractor tokens in the {report['side']} (% of their tokens)")
    ax.set_ylabel(report["metric"])
    ax.set_title(f"{report.get('dataset', '')} {report.get('split', '')}: {report['metric']} under distractors "
                 "(dotted: clean)", fontsize=10)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
