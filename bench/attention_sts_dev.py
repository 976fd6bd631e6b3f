"""Choose attention-head training settings on STS-B *dev* (never test).

Trains heads on STS-B train with a few settings, scores Spearman of cosine on the dev split
from cached token states, prints a table and writes bench/results/attention_sts_dev.json.

    .venv/bin/python bench/attention_sts_dev.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from scipy.stats import spearmanr

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.commands.train_attention import sts_pairs  # noqa: E402
from poolers import FrozenEncoder  # noqa: E402
from poolers.training import PairData, TrainConfig, cache_token_states, pad, train_head  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "stsb"
CACHE = ROOT / "bench" / "results" / "cache"

SETTINGS = {
    "value+score lr1e-3": dict(lr=1e-3),
    "value+score lr3e-4": dict(lr=3e-4),
    "score only lr1e-2": dict(lr=1e-2, value_projection=False),
    "value+score lr1e-3 wd0.01": dict(lr=1e-3, weight_decay=0.01),
}


def states_for(encoder, pairs):
    texts = sorted({t for p in pairs for t in p})
    states = cache_token_states(encoder, texts, "document", CACHE)
    pos = {t: i for i, t in enumerate(texts)}
    return states, [(pos[a], pos[b]) for a, b in pairs]


def spearman(head, states, idx, gold) -> float:
    with torch.no_grad():
        vec = torch.cat([head(*pad(states[s:s + 256]))[:, 0] for s in range(0, len(states), 256)])
    vec = torch.nn.functional.normalize(vec, dim=-1)
    cos = [(vec[a] * vec[b]).sum().item() for a, b in idx]
    return float(spearmanr(cos, gold).statistic)


def main() -> None:
    enc = FrozenEncoder()
    train, train_scores = sts_pairs(DATA, "train")
    dev, dev_scores = sts_pairs(DATA, "dev")
    tr_states, tr_idx = states_for(enc, train)
    dv_states, dv_idx = states_for(enc, dev)
    from poolers.attention import AttentionHead

    rows = [{"setting": "mean (untrained head)",
             "dev_spearman": spearman(AttentionHead(384).eval(), dv_states, dv_idx, dev_scores)}]
    for name, kw in SETTINGS.items():
        cfg = TrainConfig(objective="cosent", **kw)
        t0 = time.perf_counter()
        head, rep = train_head(PairData(tr_states, tr_states, tr_idx, train_scores), 384, cfg)
        rows.append({"setting": name, "dev_spearman": spearman(head, dv_states, dv_idx, dev_scores),
                     "best_epoch": rep.best_epoch, "train_seconds": round(time.perf_counter() - t0, 1)})
        print(rows[-1], flush=True)
    print("\n| setting | STS-B dev Spearman | best epoch | train s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['dev_spearman']:.4f} | {r.get('best_epoch', '')} | {r.get('train_seconds', '')} |")
    out = ROOT / "bench" / "results" / "attention_sts_dev.json"
    out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
