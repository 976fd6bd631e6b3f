"""Choose attention-head training settings on STS-B *dev* (never test).

Trains heads on STS-B train with a few settings, early-stopping on the STS-B dev split (the
step-0 head, which is mean pooling, is a candidate too), and reports the dev Spearman of the
kept head next to mean pooling's (selection-biased: the checkpoint was chosen on it), plus the
Spearman on 10% of train (seen in training: how well the head fits train). Rows are merged into
the JSON by setting name. Token
states come from the training cache. Prints a table and writes
bench/results/attention_sts_dev.json.

    .venv/bin/python bench/attention_sts_dev.py [setting ...]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from embedpool.app.datasets import load_sts  # noqa: E402
from embedpool.app.tables import render_table  # noqa: E402
from embedpool.poolers import FrozenEncoder  # noqa: E402
from embedpool.poolers.attention import AttentionHead  # noqa: E402
from embedpool.poolers.training import (PairData, TrainConfig, dev_metric, pair_states,  # noqa: E402
                                        split_dev, train_head)

DATA = ROOT.parent / "shared" / "data" / "stsb"
CACHE = ROOT / "bench" / "results" / "cache"

# every run: CoSENT, early stopping on STS-B dev Spearman, dev scored every 30 steps
SETTINGS = {
    "value+score lr1e-3": dict(lr=1e-3),
    "value+score lr1e-4": dict(lr=1e-4),
    "score only lr1e-3": dict(lr=1e-3, value_projection=False),
    "score only lr1e-4": dict(lr=1e-4, value_projection=False),
    "value+score lr1e-3 scale5": dict(lr=1e-3, cosent_scale=5.0),
    "value+score lr1e-3 select=loss": dict(lr=1e-3, select="loss"),
    "value+score lr1e-3 scale2": dict(lr=1e-3, cosent_scale=2.0),
    "value+score lr1e-3 scale10": dict(lr=1e-3, cosent_scale=10.0),
    "value+score lr3e-4 scale5": dict(lr=3e-4, cosent_scale=5.0),
    "score only lr1e-3 scale5": dict(lr=1e-3, cosent_scale=5.0, value_projection=False),
    "value+score lr1e-3 scale5 seed1": dict(lr=1e-3, cosent_scale=5.0, seed=1),
}


def pair_data(encoder, split: str) -> PairData:
    """The same caches `embedpool train-attention --sts` writes (sentence1s, sentence2s)."""
    rows = load_sts(DATA, split)
    return pair_states(encoder, [(a, b) for a, b, _ in rows], [s for _, _, s in rows],
                       query_role="document", cache_dir=CACHE)


def main() -> None:
    names = sys.argv[1:] or list(SETTINGS)
    enc = FrozenEncoder()
    train = pair_data(enc, "train")
    dev = pair_data(enc, "dev")
    carved = split_dev(len(train.pairs), 0.1, 0)[1]
    all_dev = list(range(len(dev.pairs)))
    mean_cfg = TrainConfig(objective="cosent")
    mean_head = AttentionHead(384).eval()
    rows = [{"setting": "mean (untrained head)",
             "dev_spearman": dev_metric(mean_head, dev, all_dev, mean_cfg)[1],
             "train10_spearman": dev_metric(mean_head, train, carved, mean_cfg)[1]}]
    print(rows[-1], flush=True)
    for name in names:
        cfg = TrainConfig(objective="cosent", eval_every=30, patience=6, **SETTINGS[name])
        t0 = time.perf_counter()
        head, rep = train_head(train, 384, cfg, dev=dev)
        rows.append({"setting": name, "dev_spearman": dev_metric(head, dev, all_dev, cfg)[1],
                     "train10_spearman": dev_metric(head, train, carved, cfg)[1],
                     "best_epoch": rep.best_epoch, "best_step": rep.best_step,
                     "steps_run": rep.history[-1]["step"], "train_seconds": round(time.perf_counter() - t0, 1),
                     "history": rep.history})
        print({k: v for k, v in rows[-1].items() if k != "history"}, flush=True)
    print("\n" + render_table(
        ["setting", "STS-B dev Spearman", "Spearman on 10% of train (seen)", "best step (epoch)", "train s"],
        [[r["setting"], f"{r['dev_spearman']:.4f}", f"{r['train10_spearman']:.4f}",
          f"{r['best_step']} ({r['best_epoch']})" if "best_step" in r else "", str(r.get("train_seconds", ""))]
         for r in rows], markdown=True))
    out = ROOT / "bench" / "results" / "attention_sts_dev.json"
    old = json.loads(out.read_text()) if out.exists() else []
    for r in old:  # rows written before the rename
        if "carved_spearman" in r:
            r["train10_spearman"] = r.pop("carved_spearman")
    merged = {r["setting"]: r for r in old if "train10_spearman" in r}
    merged.update({r["setting"]: r for r in rows})
    out.write_text(json.dumps(list(merged.values()), indent=2))


if __name__ == "__main__":
    main()
