"""Score attention heads on SciFact from cached token states (one encoder pass, many heads).

`embedpool eval` encodes the 5,183-document corpus again for every run (30-50 min on the busy
2-core machine). This script caches the corpus' and the queries' token states once with
:func:`poolers.training.cache_token_states` (the same cache `embedpool train-pooler
--corpus` reads for ICT), pools them with each head, ranks the corpus exactly by cosine and
scores the runs with `app.evaluation.score_runs` (ranx nDCG@10 etc., paired t-test against
mean), i.e. the metrics and test of `embedpool eval`. Check: its mean row must reproduce
`embedpool eval`'s 0.6451.

    .venv/bin/python bench/attention_scifact_eval.py --split test \\
        --head shared=/tmp/heads/scifact --head ict=/tmp/heads/ict --out bench/results/attention_scifact_heads.json
    .venv/bin/python bench/attention_scifact_eval.py --cache-only   # fill the cache
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]

from embedpool.app.datasets import load_beir  # noqa: E402
from embedpool.app.evaluation import score_runs  # noqa: E402
from embedpool.app.tables import render_table  # noqa: E402
from embedpool.poolers import FrozenEncoder  # noqa: E402
from embedpool.poolers.attention import AttentionHead  # noqa: E402
from embedpool.poolers.training import pool_states, cache_token_states  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "scifact"
CACHE = ROOT / "bench" / "results" / "cache"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--split", default="test")
    ap.add_argument("--head", action="append", default=[], metavar="LABEL=DIR")
    ap.add_argument("--cache-only", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    data = load_beir(DATA, args.split)
    enc = FrozenEncoder()
    t0 = time.perf_counter()
    doc_texts = [r.text for r in data.corpus]  # corpus file order: the ICT cache key too
    docs = cache_token_states(enc, doc_texts, "document", CACHE)
    qids = list(data.queries)
    queries = cache_token_states(enc, [data.queries[q] for q in qids], "query", CACHE)
    print(f"token states: {len(docs)} documents, {len(queries)} queries, {time.perf_counter() - t0:.0f} s",
          file=sys.stderr, flush=True)
    if args.cache_only:
        return
    torch.set_num_threads(1)
    heads = {"mean": AttentionHead(enc.hidden_size).eval()}
    for item in args.head:
        label, _, path = item.partition("=")
        heads[label] = AttentionHead.load(path)
    runs = {}
    doc_ids = [r.id for r in data.corpus]
    with torch.no_grad():
        for label, head in heads.items():
            d = F.normalize(pool_states(head, docs, "document"), dim=-1)
            q = F.normalize(pool_states(head, queries, "query"), dim=-1)
            top = (q @ d.T).topk(100, dim=1)
            runs[label] = {qid: {doc_ids[j]: float(s) for s, j in zip(sv.tolist(), jv.tolist())}
                           for qid, sv, jv in zip(qids, top.values, top.indices)}
    scored = score_runs(data.qrels, runs, baseline="mean", stat_test="student")
    rows = []
    for label, r in scored.items():
        rows.append({"head": label, "path": dict(i.partition("=")[::2] for i in args.head).get(label),
                     **{k: round(v, 4) for k, v in r["metrics"].items()},
                     "p_ndcg@10": r["p_values"].get("ndcg@10")})
    print("\n" + render_table(
        ["head", "nDCG@10", "Recall@100", "MRR@10", "p (nDCG@10 vs mean, paired t)"],
        [[r["head"], f"{r['ndcg@10']:.4f}", f"{r['recall@100']:.4f}", f"{r['mrr@10']:.4f}",
          "" if r["p_ndcg@10"] is None else f"{r['p_ndcg@10']:.2g}"] for r in rows], markdown=True))
    if args.out:
        Path(args.out).write_text(json.dumps({"split": args.split, "queries": len(qids), "documents": len(docs),
                                              "rows": rows,
                                              "per_query_ndcg@10": {k: v["per_query"]["ndcg@10"]
                                                                    for k, v in scored.items()}}, indent=2))


if __name__ == "__main__":
    main()
