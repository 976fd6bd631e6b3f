"""``embedpool train-attention``: train the attention pooler's head on a frozen encoder."""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from app.settings import add_engine_args, from_args, load_embedder


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
    p.add_argument("--self-supervised", choices=["ict"], help="objective for --corpus (inverse cloze task)")
    p.add_argument("--max-docs", type=int, default=None, help="with --corpus: use at most this many documents")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--queries", type=int, default=1, help="output vectors per text (PMA-style)")
    p.add_argument("--heads", type=int, default=1, help="attention heads (only 1 is implemented)")
    p.add_argument("--no-value-projection", action="store_true", help="train the scoring only")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--temperature", type=float, default=0.05)
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
    from poolers.training import PairData, TrainConfig, cache_token_states, ict_pairs, train_head

    if args.heads != 1:
        raise ValueError("--heads > 1 is not implemented; use --queries k for k output vectors")
    scores = None
    objective = "infonce"
    if args.data:
        pairs = beir_pairs(Path(args.data), args.split)
    elif args.sts:
        pairs, scores = sts_pairs(Path(args.sts), args.split)
        objective = "cosent"
    else:
        if args.self_supervised != "ict":
            raise ValueError("--corpus needs --self-supervised ict")
        docs = [(d.get("title", "") + " " + d["text"]).strip() for d in _jsonl(Path(args.corpus)).values()]
        pairs = ict_pairs(docs[: args.max_docs], args.seed)
    if len(pairs) < 4:
        raise ValueError(f"only {len(pairs)} training pairs found; need at least 4")

    settings = from_args(args)
    embedder = load_embedder(settings)
    encoder = embedder.encoder
    out = Path(args.out)
    cache = Path(args.cache_dir) if args.cache_dir else out.parent / ".state-cache"
    started = time.perf_counter()
    # Queries and documents are cached separately (the model may prompt them differently);
    # STS pairs are symmetric and use the document role for both sides.
    q_role = "document" if objective == "cosent" else "query"
    q_texts = sorted({a for a, _ in pairs})
    d_texts = sorted({b for _, b in pairs})
    with tqdm(total=len(q_texts) + len(d_texts), desc="token states", unit="text", file=sys.stderr) as bar:
        q_states = cache_token_states(encoder, q_texts, q_role, cache, bar.update)
        d_states = cache_token_states(encoder, d_texts, "document", cache, bar.update)
    states_time = time.perf_counter() - started
    q_pos = {t: i for i, t in enumerate(q_texts)}
    d_pos = {t: i for i, t in enumerate(d_texts)}
    data = PairData(q_states, d_states, [(q_pos[a], d_pos[b]) for a, b in pairs], scores)
    cfg = TrainConfig(objective=objective, queries=args.queries,
                      value_projection=not args.no_value_projection, epochs=args.epochs,
                      batch_size=args.batch_size, lr=args.lr, temperature=args.temperature,
                      patience=args.patience, seed=args.seed, dev_fraction=args.dev_fraction)
    bar = tqdm(total=cfg.epochs, desc="training", unit="epoch", file=sys.stderr)

    def on_epoch(row: dict) -> None:
        bar.update(1)
        bar.set_postfix(train=f"{row['train_loss']:.4f}", dev=f"{row['dev_loss']:.4f}")

    t0 = time.perf_counter()
    head, report = train_head(data, encoder.hidden_size, cfg, on_epoch)
    bar.close()
    train_time = time.perf_counter() - t0
    source = args.data or args.sts or args.corpus
    head.save(out, encoder=encoder.model_id, objective=objective, source=str(source), split=args.split,
              self_supervised=args.self_supervised, seed=args.seed, best_epoch=report.best_epoch)
    summary = {
        "out": str(out), "pairs": len(pairs), "objective": objective,
        "step0_dev_loss": round(report.step0_dev_loss, 5), "best_dev_loss": round(report.best_dev_loss, 5),
        "best_epoch": report.best_epoch, "epochs_run": len(report.history),
        "token_state_seconds": round(states_time, 1), "train_seconds": round(train_time, 1),
        "pooler": f"attention:weights={out}",
    }
    (out / "train_report.json").write_text(json.dumps({**summary, "history": report.history}, indent=2))
    print(json.dumps(summary))
    return 0
