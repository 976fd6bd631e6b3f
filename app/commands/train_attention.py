"""``embedpool train-attention``: train the attention pooler's head on a frozen encoder."""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from embedpool.app.cli import UsageError
from embedpool.app.settings import add_engine_args, from_args, load_embedder
from embedpool.errors import InvalidError


def register(sub) -> None:
    p = sub.add_parser(
        "train-attention", help="train a learned attention pooler head",
        description="Train the attention pooler on cached token states of a frozen encoder. "
                    "The output folder holds head.safetensors + head.json, used as "
                    "--pooler attention:weights=DIR.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", metavar="DIR", help="BEIR folder: (query, relevant document) pairs from qrels")
    src.add_argument("--sts", metavar="DIR", help="STS folder with <split>.tsv (sentence1, sentence2, score)")
    src.add_argument("--corpus", metavar="FILE", help="unlabeled corpus (BEIR corpus.jsonl) for --self-supervised")
    p.add_argument("--split", default="train", help="training split (default train; a dev part is carved from it)")
    p.add_argument("--dev-split", default=None,
                   help="early-stop on this split of --data/--sts (e.g. STS-B dev) instead of a part carved "
                        "from --split; never the test split")
    p.add_argument("--self-supervised", choices=["ict"], help="objective for --corpus (inverse cloze task)")
    p.add_argument("--max-docs", type=int, default=None, help="with --corpus: use at most this many documents")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--queries", type=int, default=1, help="output vectors per text (PMA-style)")
    p.add_argument("--heads", type=int, default=1,
                   help="attention heads: each pools its own slice of the state dimensions (must divide it)")
    p.add_argument("--no-value-projection", action="store_true", help="train the scoring only")
    p.add_argument("--roles", choices=["shared", "separate"], default="shared",
                   help="one head for queries and documents, or a separate head for each (--data/--corpus)")
    p.add_argument("--select", choices=["metric", "loss"], default="metric",
                   help="keep the checkpoint with the best dev metric (nDCG@10 / Spearman; default) or dev loss; "
                        "the untrained head (= mean) is a candidate too")
    p.add_argument("--eval-every", type=int, default=0, metavar="STEPS",
                   help="score the dev split every STEPS optimizer steps as well as after each epoch")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--temperature", type=float, default=0.05, help="InfoNCE temperature")
    p.add_argument("--cosent-scale", type=float, default=20.0, help="CoSENT scale on cosine similarities")
    p.add_argument("--patience", type=int, default=3)
    p.add_argument("--dev-fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default=None, help="where token states are cached (default OUT/../.state-cache)")
    add_engine_args(p)
    p.set_defaults(func=run)


def _jsonl(path: Path) -> dict[str, dict]:
    with open(path, encoding="utf-8") as f:
        return {str(o["_id"]): o for o in map(json.loads, f) if o}


def beir_pairs(folder: Path, split: str) -> list[tuple[str, str]]:
    corpus = _jsonl(folder / "corpus.jsonl")
    queries = _jsonl(folder / "queries.jsonl")
    pairs = []
    with open(folder / "qrels" / f"{split}.tsv", encoding="utf-8") as f:
        for row in csv.DictReader(f, delimiter="\t"):
            if int(row["score"]) > 0 and row["query-id"] in queries and row["corpus-id"] in corpus:
                d = corpus[row["corpus-id"]]
                pairs.append((queries[row["query-id"]]["text"], (d.get("title", "") + " " + d["text"]).strip()))
    return pairs


def sts_pairs(folder: Path, split: str) -> tuple[list[tuple[str, str]], list[float]]:
    pairs, scores = [], []
    with open(folder / f"{split}.tsv", encoding="utf-8") as f:
        for row in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
            pairs.append((row["sentence1"], row["sentence2"]))
            scores.append(float(row["score"]))
    return pairs, scores


def run(args: argparse.Namespace) -> int:
    from embedpool.poolers.training import (PairData, TrainConfig, cache_token_states, ict_positive_states, ict_spans,
                                  train_head)

    scores = None
    objective = "infonce"
    if args.data:
        pairs = beir_pairs(Path(args.data), args.split)
    elif args.sts:
        pairs, scores = sts_pairs(Path(args.sts), args.split)
        objective = "cosent"
    else:
        if args.self_supervised != "ict":
            raise UsageError("--corpus needs --self-supervised ict")
        # documents as retrieval evaluation reads them (title + " " + text, file order): their
        # token states are one cache shared with the evaluation
        docs = [((d.get("title") or "") + " " + (d.get("text") or "")).strip()
                for d in _jsonl(Path(args.corpus)).values()][: args.max_docs]
        spans = ict_spans(docs, args.seed)
        pairs = [(s.sentence, s.rest) for s in spans]
    dev_pairs, dev_scores = None, None
    if args.dev_split:
        if args.dev_split == "test":
            raise UsageError("--dev-split test: early stopping must not look at the test split")
        if args.data:
            dev_pairs = beir_pairs(Path(args.data), args.dev_split)
        elif args.sts:
            dev_pairs, dev_scores = sts_pairs(Path(args.sts), args.dev_split)
        else:
            raise UsageError("--dev-split needs --data or --sts")
    if len(pairs) < 4:
        raise InvalidError(f"only {len(pairs)} training pairs found; need at least 4")

    settings = from_args(args)
    embedder = load_embedder(settings)
    encoder = embedder.encoder
    out = Path(args.out)
    cache = Path(args.cache_dir) if args.cache_dir else out.parent / ".state-cache"
    started = time.perf_counter()
    # Queries and documents are cached separately (the model may prompt them differently);
    # STS pairs are symmetric and use the document role for both sides.
    q_role = "document" if objective == "cosent" else "query"

    def pair_data(pairs: list[tuple[str, str]], scores: list[float] | None, bar) -> PairData:
        q_texts = sorted({a for a, _ in pairs})
        d_texts = sorted({b for _, b in pairs})
        q_states = cache_token_states(encoder, q_texts, q_role, cache, bar.update)
        d_states = cache_token_states(encoder, d_texts, "document", cache, bar.update)
        q_pos = {t: i for i, t in enumerate(q_texts)}
        d_pos = {t: i for i, t in enumerate(d_texts)}
        return PairData(q_states, d_states, [(q_pos[a], d_pos[b]) for a, b in pairs], scores)

    n_texts = sum(len({a for a, _ in ps}) + len({b for _, b in ps}) for ps in (pairs, dev_pairs or []))
    if args.corpus:
        n_texts = len({a for a, _ in pairs}) + len(docs)
    with tqdm(total=n_texts, desc="token states", unit="text", file=sys.stderr) as bar:
        if args.corpus:
            # ICT: the sentences are encoded as queries; each positive is its document's cached
            # token states without the sentence's tokens (one pass over the corpus, shared
            # with evaluation, instead of encoding every "rest of the document" again)
            q_texts = sorted({sp.sentence for sp in spans})
            q_states = cache_token_states(encoder, q_texts, "query", cache, bar.update)
            doc_states = cache_token_states(encoder, docs, "document", cache, bar.update)
            q_pos = {t: i for i, t in enumerate(q_texts)}
            data = PairData(q_states, ict_positive_states(encoder, docs, doc_states, spans),
                            [(q_pos[sp.sentence], k) for k, sp in enumerate(spans)])
            del doc_states
        else:
            data = pair_data(pairs, scores, bar)
        dev = pair_data(dev_pairs, dev_scores, bar) if dev_pairs else None
    states_time = time.perf_counter() - started
    cfg = TrainConfig(objective=objective, queries=args.queries, heads=args.heads, roles=args.roles,
                      value_projection=not args.no_value_projection, epochs=args.epochs,
                      batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
                      temperature=args.temperature, cosent_scale=args.cosent_scale,
                      patience=args.patience, seed=args.seed, dev_fraction=args.dev_fraction,
                      select=args.select, eval_every=args.eval_every)
    bar = tqdm(desc="training", unit="eval", file=sys.stderr)

    def on_eval(row: dict) -> None:
        bar.update(1)
        bar.set_postfix({k: f"{v:.4f}" for k, v in row.items() if k.startswith(("train", "dev")) and v is not None})

    t0 = time.perf_counter()
    head, report = train_head(data, encoder.hidden_size, cfg, on_eval, dev)
    bar.close()
    train_time = time.perf_counter() - t0
    source = args.data or args.sts or args.corpus
    head.save(out, encoder=encoder.model_id, objective=objective, source=str(source), split=args.split,
              dev_split=args.dev_split, self_supervised=args.self_supervised, seed=args.seed,
              best_epoch=report.best_epoch, best_step=report.best_step)
    summary = {
        "out": str(out), "pairs": len(pairs), "dev_pairs": len(dev_pairs) if dev_pairs else None,
        "objective": objective, "roles": args.roles, "select": args.select,
        "dev": (f"{args.dev_split} split" if args.dev_split
                else f"{args.dev_fraction:.0%} of the ICT pairs" if args.corpus
                else f"{args.dev_fraction:.0%} carved from {args.split}"),
        "dev_metric": report.metric,
        "step0_dev_metric": round(report.step0_dev_metric, 5), "best_dev_metric": round(report.best_dev_metric, 5),
        "step0_dev_loss": round(report.step0_dev_loss, 5), "best_dev_loss": round(report.best_dev_loss, 5),
        "best_epoch": report.best_epoch, "best_step": report.best_step,
        "epochs_run": max(r["epoch"] for r in report.history),
        "token_state_seconds": round(states_time, 1), "train_seconds": round(train_time, 1),
        "pooler": f"attention:weights={out}",
    }
    (out / "train_report.json").write_text(json.dumps({**summary, "history": report.history}, indent=2))
    if report.best_step == 0:
        print("no checkpoint beat the untrained head (= mean pooling) on dev; the saved head is "
              "the untrained one", file=sys.stderr)
    print(json.dumps(summary))
    return 0
