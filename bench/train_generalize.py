"""Do trained pooler heads travel? Every head trained with 3 seeds on SciFact train and on STS-B
train, scored on SciFact test and STS-B test, with paired tests against `mean` and against the
last-layer `attention` head of the same seed.

Heads (each `embedpool train-pooler` as a user would run it, into bench/.heads/):

- `attention`: the last-layer head as the README trains it (SciFact: separate query/document
  heads; STS-B: CoSENT, stopped on STS-B dev);
- `multilayer`: the same settings with `--pooler multilayer` (every layer, learned layer weights);
- `multilayer+anchor` / `attention+anchor`: `--anchor W`, pulling the pooled vectors toward
  mean's (no extra data; W = 10 chosen on the dev splits, docs/attention.md);
- `multilayer-lr30` (+`anchor`): the layer weights at 30x the learning rate (`--layer-lr 30`);
- `multilayer+guard` / `attention+guard`: early stopping guarded by the *other* task's non-test
  split (trained on SciFact: STS-B dev; trained on STS-B: SciFact train), so no kept checkpoint
  scores below mean there;
- `attention+noise`, `glot+noise`, `attnstats+noise`: trained with distractor words making up
  90% of every training and dev document's tokens (`--distractors 0.9`), GLOT's diagnostic;
- `glot`, `attnstats`, `reinpool` (issue 32, docs/research-poolers.md): the same settings with
  `--pooler glot|attnstats|reinpool`; `reinpool` has one policy (shared roles, 4 attention heads)
  and trains by REINFORCE. With `reinpool` evaluated, the SciFact run also scores `tokens`
  (exact MaxSim) and untrained `reinpool` (the mean of the same token vectors), for the share of
  MaxSim's nDCG@10 one vector per document keeps.

`stress` runs `embedpool eval --stress distractors` (STS-B test, and a SciFact test slice with
distractors in the documents) on `mean`, `cls`, `max` and seed 0 of every head trained on that
set.

Scoring is `embedpool eval`: one SciFact run with every head (one forward pass serves them all;
nDCG@10, p by ranx's paired t-test against mean, and scipy's paired t-test on the same per-query
nDCG@10 against the attention head of the seed), and STS-B runs against mean and against each
seed's attention head (paired bootstrap of the Spearman difference). A head "holds out of
domain" when no seed loses significantly against mean (p < 0.05 with a lower score).

    .venv/bin/python bench/train_generalize.py sweep    # the anchor weight, on dev splits only
    .venv/bin/python bench/train_generalize.py train [--jobs 2]
    .venv/bin/python bench/train_generalize.py eval     # writes bench/results/train_generalize.json
    .venv/bin/python bench/train_generalize.py train --variants attention glot attnstats reinpool
    .venv/bin/python bench/train_generalize.py eval --variants attention glot attnstats reinpool \
        --out bench/results/research_poolers.json
    .venv/bin/python bench/train_generalize.py stress --variants attention glot attnstats reinpool
    # the command's defaults (issue 47 item 6), on another model (make models):
    .venv/bin/python bench/train_generalize.py --model models/all-mpnet-base-v2 train --jobs 2 \
        --variants attention multilayer attention+defaults multilayer+defaults glot+defaults attnstats+defaults
    .venv/bin/python bench/train_generalize.py --model models/all-mpnet-base-v2 eval --variants ...

Variants ending in ``+defaults`` are what a user gets from ``train-pooler`` with no tuning flags:
the objective's optimizer defaults and the guard the command finds beside the training data
(SciFact and STS-B are siblings, so each guards the other, refusing significant losses only).
Every other variant passes ``--no-guard`` (or names its guard) so it stays the run it was.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from scale import machine  # noqa: E402  (bench/ is on the path: the script's own folder)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
SCIFACT, STSB = str(DATA / "scifact"), str(DATA / "stsb")
HEADS = ROOT / "bench" / ".heads"
CACHE = ROOT / "bench" / "results" / "cache"
OUT = ROOT / "bench" / "results" / "train_generalize.json"
EMBEDPOOL = str(ROOT / ".venv" / "bin" / "embedpool")
SEEDS = (0, 1, 2)
ANCHOR = "10"
NOISE = "0.9"  # GLOT's diagnostic: 90% of the tokens are distractors

MODEL: list[str] = []  # --model M: ["--model", M] for every train-pooler and eval run
TRAIN = {  # the README's commands for the attention head
    "scifact": ["--data", SCIFACT, "--split", "train", "--roles", "separate"],
    "stsb": ["--sts", STSB, "--split", "train", "--dev-split", "dev", "--cosent-scale", "5", "--lr", "3e-4",
             "--eval-every", "30", "--patience", "6"],
}
GUARD = {"scifact": ["--guard-sts", STSB], "stsb": ["--guard-data", SCIFACT]}
# what a user types (issue 47 item 6): the command's own defaults, per objective, and the guard it
# finds beside the training data (SciFact and STS-B are siblings in ../shared/data)
DEFAULTS = {"scifact": ["--data", SCIFACT, "--split", "train"],
            "stsb": ["--sts", STSB, "--split", "train", "--dev-split", "dev"]}
VARIANTS = {
    "attention": lambda s: ["--pooler", "attention"],
    "attention+guard": lambda s: ["--pooler", "attention", *GUARD[s]],
    "attention+anchor": lambda s: ["--pooler", "attention", "--anchor", ANCHOR],
    "multilayer": lambda s: ["--pooler", "multilayer"],
    "multilayer+anchor": lambda s: ["--pooler", "multilayer", "--anchor", ANCHOR],
    "multilayer+anchor30": lambda s: ["--pooler", "multilayer", "--anchor", "30"],
    "multilayer+guard": lambda s: ["--pooler", "multilayer", *GUARD[s]],
    "multilayer-lr30": lambda s: ["--pooler", "multilayer", "--layer-lr", "30"],
    "multilayer-lr30+anchor": lambda s: ["--pooler", "multilayer", "--layer-lr", "30", "--anchor", ANCHOR],
    "glot": lambda s: ["--pooler", "glot"],
    # the command's defaults: DEFAULTS instead of TRAIN, the guard beside the data
    "attention+defaults": lambda s: ["--pooler", "attention"],
    "multilayer+defaults": lambda s: ["--pooler", "multilayer"],
    "glot+defaults": lambda s: ["--pooler", "glot"],
    "attnstats+defaults": lambda s: ["--pooler", "attnstats"],
    "attnstats": lambda s: ["--pooler", "attnstats"],
    "reinpool": lambda s: ["--pooler", "reinpool", "--roles", "shared", "--heads", "4"],
    # GLOT's diagnostic trains at the noise level it tests: distractors make up NOISE of every
    # training and dev document's tokens (train-pooler --distractors), scored by `stress`
    "attention+noise": lambda s: ["--pooler", "attention", "--distractors", NOISE],
    "glot+noise": lambda s: ["--pooler", "glot", "--distractors", NOISE],
    "attnstats+noise": lambda s: ["--pooler", "attnstats", "--distractors", NOISE],
}


def head_dir(trained_on: str, variant: str, seed: int) -> Path:
    return HEADS / f"{trained_on}-{variant}-s{seed}"


def spec(trained_on: str, variant: str, seed: int) -> str:
    pooler = variant.split("+")[0].split("-")[0]
    return f"{pooler}:weights={head_dir(trained_on, variant, seed)}"


def train_one(job: tuple[str, str, int, list[str]]) -> dict:
    trained_on, variant, seed, extra = job
    out = head_dir(trained_on, variant, seed)
    report = out / "train_report.json"
    if not report.exists():
        own = variant.endswith("+defaults")
        # since the guard beside the data became the default, the other variants say --no-guard
        # to stay the runs they were (unless they name their guard)
        guard = [] if own or "+guard" in variant else ["--no-guard"]
        cmd = [EMBEDPOOL, "train-pooler", *MODEL, *(DEFAULTS if own else TRAIN)[trained_on],
               *VARIANTS[variant](trained_on), *guard, *extra, "--seed", str(seed), "--out", str(out),
               "--cache-dir", str(CACHE)]
        print(" ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    row = {k: v for k, v in json.loads(report.read_text()).items() if k != "history"}
    print(f"{trained_on} {variant} seed {seed}: best step {row['best_step']}, dev {row['best_dev_metric']}"
          f" (step 0 {row['step0_dev_metric']}), {row['train_seconds']} s", file=sys.stderr, flush=True)
    return {"trained_on": trained_on, "variant": variant, "seed": seed, **row}


def train(args: argparse.Namespace) -> None:
    extra = {t: (args.stsb_args.split() if t == "stsb" else []) for t in TRAIN}
    jobs = [(t, v, s, extra[t]) for s in args.seeds for t in args.sets for v in args.variants]
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = {(r["trained_on"], r["variant"], r["seed"]): r for r in pool.map(train_one, jobs)}
    path = HEADS / "trainings.json"
    old = {(r["trained_on"], r["variant"], r["seed"]): r for r in json.loads(path.read_text())} if path.exists() else {}
    path.write_text(json.dumps(list({**old, **rows}.values()), indent=2))


def run_eval(data_flag: list[str], poolers: list[str], baseline: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        cmd = [EMBEDPOOL, "eval", *MODEL, *data_flag, "--split", "test", *[a for p in poolers for a in ("--pooler", p)],
               "--baseline", baseline, "--out", str(out), "--no-progress", "--latency-queries", "0"]
        print(" ".join(cmd[:6]), f"... {len(poolers)} poolers, baseline {baseline}", file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def evaluate(args: argparse.Namespace) -> None:
    variants = [v for v in VARIANTS if v in args.variants]
    assert "attention" in variants, "the attention heads are the comparison"
    heads = [(t, v, s) for s in args.seeds for t in args.trained_on for v in variants]
    specs = ["mean", *[spec(*h) for h in heads]]
    # MaxSim, and the mean of the same vectors (untrained reinpool); also without trained reinpool heads
    selection = ["tokens", "reinpool"] if "reinpool" in variants or args.selection else []
    scores: dict[tuple, dict] = {}  # (trained_on, variant, seed, evaluated_on) -> {score, p_mean, p_attention}
    mean_scores, sf, st, kept = {}, None, None, None
    if "scifact" in args.sets:
        sf, kept = _eval_scifact(args, variants, heads, specs, selection, scores, mean_scores)
    if "stsb" in args.sets:
        st = _eval_stsb(args, variants, heads, specs, scores, mean_scores)
    trainings = json.loads((HEADS / "trainings.json").read_text()) if (HEADS / "trainings.json").exists() else []
    table = summarize(scores, mean_scores, args.seeds, variants, trainings, args.sets, args.trained_on)
    args.out.write_text(json.dumps({
        "cpu": machine(), "encoder_precision": (sf or st)["encoder_precision"], "seeds": list(args.seeds),
        "anchor": ANCHOR, "stsb_train_args": args.stsb_args, "mean": mean_scores,
        "scifact_test": "nDCG@10, p: ranx paired t-test (vs mean), scipy ttest_rel (vs attention)",
        "stsb_test": st["stat_test"] if st else None, "summary": table,
        "runs": [{"trained_on": t, "variant": v, "seed": s, "evaluated_on": e, **r}
                 for (t, v, s, e), r in scores.items()],
        "trainings": trainings or None, "selection": kept,
    }, indent=2))
    print_table(table, mean_scores)
    if kept:
        print(json.dumps(kept, indent=2))


def _eval_scifact(args, variants, heads, specs, selection, scores, mean_scores) -> tuple[dict, dict | None]:
    """SciFact test: one run of every head (and of `tokens` and untrained `reinpool`)."""
    from scipy.stats import ttest_rel

    sf = run_eval(["--data", SCIFACT], specs + selection, "mean")
    by_label = {r["label"]: r for r in sf["results"]}
    per_query = sf["per_query"]
    qids = sorted(per_query["mean"])
    for t, v, s in heads:
        label, att = spec(t, v, s), spec(t, "attention", s)
        x = [per_query[label][q] for q in qids]
        y = [per_query[att][q] for q in qids]
        p_att = None if label == att or x == y else float(ttest_rel(x, y).pvalue)
        scores[(t, v, s, "scifact")] = {"score": by_label[label]["ndcg@10"], "p_mean": by_label[label]["p_value"],
                                        "p_attention": p_att}
    mean_scores["scifact"] = by_label["mean"]["ndcg@10"]
    kept = None
    if selection:
        maxsim, same = by_label["tokens [exhaustive]"]["ndcg@10"], by_label["reinpool"]["ndcg@10"]
        kept = {"tokens_maxsim": maxsim, "mean_of_token_vectors": same, "mean_of_token_vectors_share": same / maxsim,
                **{f"reinpool_{t}_s{s}_share": scores[(t, "reinpool", s, "scifact")]["score"] / maxsim
                   for t in args.trained_on for s in args.seeds if "reinpool" in variants}}
    return sf, kept


def _eval_stsb(args, variants, heads, specs, scores, mean_scores) -> dict:
    """STS-B test: one run of every head against mean, one per seed and training set against its attention head."""
    st = run_eval(["--sts", STSB], specs, "mean")
    st_rows = {r["label"]: r for r in st["results"]}
    mean_scores["stsb"] = st_rows["mean"]["spearman"]
    for t, v, s in heads:
        label = spec(t, v, s)
        scores[(t, v, s, "stsb")] = {"score": st_rows[label]["spearman"], "p_mean": st_rows[label]["p_value"],
                                     "p_attention": None}
    for s in args.seeds:  # against each seed's attention heads
        for t in args.trained_on:
            att = spec(t, "attention", s)
            mine = [spec(t, v, s) for v in variants if v != "attention"]
            rows = {r["label"]: r for r in run_eval(["--sts", STSB], [att, *mine], att)["results"]}
            for v in variants:
                if v != "attention":
                    scores[(t, v, s, "stsb")]["p_attention"] = rows[spec(t, v, s)]["p_value"]
    return st


def summarize(scores: dict, mean_scores: dict, seeds, variants, trainings: list[dict] = (),
              sets=tuple(TRAIN), trained_on=tuple(TRAIN)) -> list[dict]:
    made = {(r["trained_on"], r["variant"], r["seed"]): r for r in trainings}
    out = []
    for t in trained_on:
        for e in (x for x in ("scifact", "stsb") if x in sets):
            for v in variants:
                runs = [scores[(t, v, s, e)] for s in seeds]
                vals = [r["score"] for r in runs]
                p_mean = [r["p_mean"] for r in runs]
                p_att = [r["p_attention"] for r in runs]
                loses = [x < mean_scores[e] and p is not None and p < 0.05 for x, p in zip(vals, p_mean)]
                gains = [x > mean_scores[e] and p is not None and p < 0.05 for x, p in zip(vals, p_mean)]
                runs_t = [made.get((t, v, s), {}) for s in seeds]
                secs = [r["train_seconds"] for r in runs_t if "train_seconds" in r]
                params = {r.get("trainable_parameters") for r in runs_t} - {None}
                out.append({"trained_on": t, "evaluated_on": e, "in_domain": t == e, "variant": v,
                            "train_seconds_mean": statistics.mean(secs) if secs else None,
                            "trainable_parameters": params.pop() if len(params) == 1 else None,
                            "mean_of_seeds": statistics.mean(vals),
                            "std_of_seeds": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                            "scores": vals, "p_vs_mean": p_mean, "p_vs_attention": p_att,
                            "seeds_significant_gain": sum(gains), "seeds_significant_loss": sum(loses)})
    return out


def _p(ps: list) -> str:
    return "—" if all(p is None for p in ps) else " / ".join("—" if p is None else f"{p:.2g}" for p in ps)


def print_table(table: list[dict], mean_scores: dict) -> None:
    print("| trained on | scored on | head | mean ± std (3 seeds) | vs mean (`mean` = %s / %s) | p vs mean (per seed) | "
          "p vs attention (per seed) | seeds with a significant gain / loss vs mean | trainable parameters | "
          "training s (mean of seeds) |" % tuple(f"{mean_scores[k]:.4f}" if k in mean_scores else "—"
                                                  for k in ("scifact", "stsb")))
    print("|---|---|---|---:|---:|---|---|---|---:|---:|")
    for r in table:
        delta = 100 * (r["mean_of_seeds"] - mean_scores[r["evaluated_on"]])
        params, secs = r.get("trainable_parameters"), r.get("train_seconds_mean")
        print(f"| {r['trained_on']} | {r['evaluated_on']}{' (in domain)' if r['in_domain'] else ''} | {r['variant']} | "
              f"{r['mean_of_seeds']:.4f} ± {r['std_of_seeds']:.4f} | {delta:+.1f} | {_p(r['p_vs_mean'])} | "
              f"{_p(r['p_vs_attention'])} | {r['seeds_significant_gain']} / {r['seeds_significant_loss']} | "
              f"{'' if params is None else f'{params:,}'} | {'' if secs is None else f'{secs:.0f}'} |")


def stress(args: argparse.Namespace) -> None:
    """The distractor stress curves: `mean`, `cls`, `max` and seed 0 of every head trained on the set,
    on STS-B test and on a SciFact test slice (`--max-docs`), distractors in the documents."""
    runs = {"stsb": ["--sts", STSB], "scifact": ["--data", SCIFACT, "--max-docs", str(args.max_docs)]}
    out = {}
    for name, flags in ((n, f) for n, f in runs.items() if n in args.sets):
        specs = ["mean", "cls", "max", *[spec(name, v, args.seeds[0]) for v in args.variants]]
        path = ROOT / "bench" / "results" / f"stress_{name}{'_' + Path(MODEL[1]).name if MODEL else ''}.json"
        cmd = [EMBEDPOOL, "eval", *MODEL, *flags, "--split", "test", *[a for p in specs for a in ("--pooler", p)],
               "--stress", "distractors", "--stress-side", "documents", "--out", str(path),
               "--markdown", str(path.with_suffix(".md")), "--plot", str(path.with_suffix(".png")),
               "--no-progress", "--latency-queries", "0"]
        print(" ".join(cmd[:6]), f"... {len(specs)} poolers", file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        out[name] = json.loads(path.read_text())
        print(path.with_suffix(".md").read_text())


SWEEP = ("0", "2", "10", "30")


def sweep(args: argparse.Namespace) -> None:
    """Choose the anchor weight on dev splits only: seed 0 of the multilayer head per weight, the
    in-domain dev metric of the kept checkpoint and, observed through a guard that refuses nothing
    (tolerance 2), its metric on the other task's non-test split."""
    rows = []
    for t in TRAIN:
        for w in SWEEP:
            out = HEADS / f"sweep-{t}-a{w}"
            if not (out / "train_report.json").exists():
                subprocess.run([EMBEDPOOL, "train-pooler", *TRAIN[t], "--pooler", "multilayer", "--anchor", w,
                                *GUARD[t], "--guard-tolerance", "2", "--out", str(out), "--cache-dir", str(CACHE)],
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            r = json.loads((out / "train_report.json").read_text())
            rows.append({"trained_on": t, "anchor": float(w), **{k: r[k] for k in (
                "dev_metric", "step0_dev_metric", "best_dev_metric", "guard", "guard_metric", "step0_guard_metric",
                "best_guard_metric", "best_step", "train_seconds")}})
    (ROOT / "bench" / "results" / "train_anchor_sweep.json").write_text(json.dumps({"cpu": machine(), "rows": rows},
                                                                                   indent=2))
    print("| trained on | anchor W | in-domain dev (step 0 = mean) | other task's split (step 0 = mean) | best step |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['trained_on']} | {r['anchor']:g} | {r['best_dev_metric']:.4f} ({r['step0_dev_metric']:.4f}) | "
              f"{r['best_guard_metric']:.4f} ({r['step0_guard_metric']:.4f}) | {r['best_step']} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["sweep", "train", "eval", "table", "stress"])
    ap.add_argument("--max-docs", type=int, default=1000, help="stress: the SciFact test slice's documents")
    ap.add_argument("--sets", nargs="+", default=list(TRAIN), choices=list(TRAIN),
                    help="train / stress: these sets; eval: scored on these sets")
    ap.add_argument("--stsb-args", default="", help="train: extra train-pooler flags for STS-B (e.g. '--epochs 4')")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    ap.add_argument("--jobs", type=int, default=1, help="trainings at once (each on one thread)")
    ap.add_argument("--out", type=Path, default=OUT, help="eval: the report (default bench/results/train_generalize.json)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--trained-on", nargs="+", default=list(TRAIN), choices=list(TRAIN),
                    help="eval: only the heads trained on these sets (default both)")
    ap.add_argument("--selection", action="store_true",
                    help="eval: score `tokens` (exact MaxSim) and untrained `reinpool` on SciFact even without "
                         "trained reinpool heads")
    ap.add_argument("--model", help="model folder (default: the packaged all-MiniLM-L6-v2); heads go to "
                                    "bench/.heads/<folder name>/, the report to train_generalize_<folder name>.json")
    args = ap.parse_args()
    if args.model:
        global HEADS
        name = Path(args.model).name
        MODEL[:] = ["--model", args.model]
        HEADS = HEADS / name
        if args.out == OUT:
            args.out = OUT.with_name(f"{OUT.stem}_{name}.json")
    print(json.dumps(machine()), file=sys.stderr)
    if args.what == "sweep":
        sweep(args)
    elif args.what == "train":
        train(args)
    elif args.what == "eval":
        evaluate(args)
    elif args.what == "stress":
        stress(args)
    else:
        saved = json.loads(args.out.read_text())
        print_table(saved["summary"], saved["mean"])


if __name__ == "__main__":
    main()
