"""``embedpool train-pooler`` (also ``train-attention``, its first name): train the head of a
learned pooler (``attention``, ``glot``, ``attnstats`` or ``reinpool`` over the last layer, or
``multilayer`` over every layer) on a frozen encoder."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from embedpool.app import datasets
from embedpool.app.commands.common import add_data_sources, command
from embedpool.app.settings import from_args, load_embedder
from embedpool.errors import InvalidError, TooLargeError

MAX_STATE_BYTES = 8 * 2**30  # the training set's token states are held in memory


def register(sub) -> None:
    for name in ("train-pooler", "train-attention"):
        _register(sub, name)


def _register(sub, name: str) -> None:
    p = command(
        sub, name, run, help="train a learned pooler head (attention, multilayer, glot, attnstats, reinpool)"
        + ("; the first name of train-pooler" if name != "train-pooler" else ""),
        description="Train the head of a learned pooler on cached token states of a frozen encoder. "
                    "The output folder holds head.safetensors + head.json, used as "
                    "--pooler NAME:weights=DIR (NAME: the --pooler trained).")
    add_data_sources(p, ("--corpus", "unlabeled corpus (BEIR corpus.jsonl) for --self-supervised"))
    p.add_argument("--split", default="train", help="training split (default train; a dev part is carved from it)")
    p.add_argument("--dev-split", default=None,
                   help="early-stop on this split of --data/--sts (e.g. STS-B dev) instead of a part carved "
                        "from --split; never the test split")
    p.add_argument("--self-supervised", choices=["ict"], help="objective for --corpus (inverse cloze task)")
    p.add_argument("--max-docs", type=int, default=None, help="with --corpus: use at most this many documents")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--pooler", choices=["attention", "multilayer", "glot", "attnstats", "reinpool", "mixed", "gated",
                                        "gem", "ggem"],
                   default="attention",
                   help="attention: learned queries over the last layer's tokens; multilayer: over every "
                        "hidden layer's tokens, with learned layer weights; glot: token-similarity graph, GAT, "
                        "attentive readout; attnstats: attentive statistics (weighted mean and std); reinpool: "
                        "a policy that keeps some token vectors, trained by REINFORCE on nDCG@10; mixed: a learned "
                        "a * max + (1 - a) * mean; gated: the same with a computed per text; gem: generalized mean "
                        "with a learned exponent p; ggem: one p per group of channels (--heads G groups, default "
                        "16) (all start as mean pooling; reinpool as the mean of the token vectors)")
    p.add_argument("--samples", type=int, default=8,
                   help="reinpool: selections sampled per document for REINFORCE (default 8)")
    p.add_argument("--layer-lr", type=float, default=1.0, metavar="X",
                   help="multilayer: the layer weights' learning rate as a multiple of --lr")
    p.add_argument("--anchor", type=float, default=0.0, metavar="W",
                   help="pull the pooled vectors toward mean pooling's: adds W * mean(1 - cos(pooled, mean)) "
                        "to the loss, against over-fitting the training domain (0: off)")
    guard = p.add_mutually_exclusive_group()
    guard.add_argument("--guard-data", metavar="DIR",
                       help="a BEIR folder of another domain: never keep a checkpoint that scores significantly "
                            "below the untrained head (mean pooling) on its --guard-split (nDCG@10). Default: a "
                            "folder of the other kind beside the training data (see --no-guard)")
    guard.add_argument("--guard-sts", metavar="DIR", help="the same with an STS folder (Spearman)")
    guard.add_argument("--no-guard", action="store_true",
                       help="no guard. Without --guard-*, the command looks beside the training folder (in its "
                            "parent) for a folder of the other kind: an STS folder with a dev.tsv when training "
                            "on retrieval pairs or a corpus, a BEIR folder with qrels/train.tsv when training on "
                            "STS pairs; the first by name guards the training")
    p.add_argument("--guard-split", default=None,
                   help="split of the guard folder (default: dev for an STS guard, train for a BEIR guard); "
                        "never test")
    p.add_argument("--guard-tolerance", type=float, default=None, metavar="D",
                   help="refuse a checkpoint whose guard metric is more than D below the untrained head's "
                        "(default: refuse only a significant loss, one-sided p < 0.05: a paired t-test on "
                        "nDCG@10 per query, a paired bootstrap of Spearman)")
    p.add_argument("--distractors", type=float, default=0.0, metavar="R",
                   help="train under noise: random in-domain words make up R (0 to 0.95) of the tokens of every "
                        "training and dev text on --distractor-side, injected as `embedpool eval --stress "
                        "distractors` does (GLOT's diagnostic trains at the noise level it tests; 0: off)")
    p.add_argument("--distractor-side", choices=["documents", "queries", "both"], default="documents",
                   help="with --distractors: the texts that get them (documents: the positives, STS: the second "
                        "sentences; queries: the queries, STS: the first; default documents)")
    p.add_argument("--queries", type=int, default=1, help="output vectors per text (PMA-style)")
    p.add_argument("--heads", type=int, default=1,
                   help="attention heads: each pools its own slice of the state dimensions (must divide it); "
                        "reinpool: the policy's self-attention heads")
    p.add_argument("--no-value-projection", action="store_true", help="train the scoring only")
    p.add_argument("--roles", choices=["shared", "separate"], default=None,
                   help="one head for queries and documents, or a separate head for each (--data/--corpus; "
                        "default: separate for query/document pairs where the head has them, else shared)")
    p.add_argument("--select", choices=["metric", "loss"], default="metric",
                   help="keep the checkpoint with the best dev metric (nDCG@10 / Spearman; default) or dev loss; "
                        "the untrained head (= mean) is a candidate too")
    p.add_argument("--eval-every", type=int, default=None, metavar="STEPS",
                   help="score the dev split every STEPS optimizer steps as well as after each epoch "
                        "(default 0 = once an epoch; 30 for STS)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default per objective: 1e-3 for retrieval pairs and ICT, 3e-4 for STS)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--temperature", type=float, default=0.05, help="InfoNCE temperature")
    p.add_argument("--cosent-scale", type=float, default=None,
                   help="CoSENT scale on cosine similarities (default 5)")
    p.add_argument("--patience", type=int, default=None,
                   help="dev evaluations without a new best before stopping (default 3; 6 for STS)")
    p.add_argument("--dev-fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-state-bytes", type=int, default=MAX_STATE_BYTES, metavar="N",
                   help="refuse, before encoding, a training whose cached token states would take more than N "
                        f"bytes in memory (default {MAX_STATE_BYTES // 2**30} GiB; every layer's are 7x the last "
                        "layer's for all-MiniLM-L6-v2)")
    p.add_argument("--cache-dir", default=None, help="where token states are cached (default OUT/../.state-cache)")


@dataclass
class Texts:
    """What to train on: ``(query, document)`` pairs (STS: scored sentence pairs) and, for ICT,
    the corpus and its sentence spans."""

    objective: str
    pairs: list[tuple[str, str]]
    scores: list[float] | None = None
    docs: list[str] | None = None
    spans: list | None = None


def _pairs(beir: str | None, sts: str | None, split: str) -> Texts:
    """Pairs of ``split`` of the BEIR folder ``beir`` (qrels) or the STS folder ``sts`` (via
    :mod:`app.datasets`)."""
    if beir:
        return Texts("infonce", datasets.load_beir(beir, split).pairs())
    rows = datasets.load_sts(sts, split)
    return Texts("cosent", [(a, b) for a, b, _ in rows], [s for _, _, s in rows])


def guard_texts(args: argparse.Namespace) -> Texts | None:
    """The ``--guard-data`` / ``--guard-sts`` pairs (``None`` without a guard)."""
    if not (args.guard_data or args.guard_sts):
        return None
    split = args.guard_split or ("train" if args.guard_data else "dev")
    if split == "test":
        raise InvalidError("--guard-split test: early stopping must not look at a test split", param="--guard-split")
    return _pairs(args.guard_data, args.guard_sts, split)


def guard_beside(args: argparse.Namespace) -> tuple[str, Path] | None:
    """The default guard: the first folder (by name) beside the training data, in its parent, of
    the other kind: an STS folder with a ``dev.tsv`` for retrieval pairs or an ICT corpus, a BEIR
    folder with ``corpus.jsonl`` and ``qrels/train.tsv`` for STS pairs. Returns ``("sts" |
    "data", folder)``, or ``None`` when a guard was given, refused (``--no-guard``) or none is
    there. docs/attention.md measures why a guard is the default."""
    if args.no_guard or args.guard_data or args.guard_sts:
        return None
    own = Path(args.sts or args.data or Path(args.corpus).parent).resolve()
    want = "data" if args.sts else "sts"
    for folder in sorted(p for p in own.parent.iterdir() if p.is_dir() and p != own):
        if want == "sts" and (folder / "dev.tsv").is_file():
            return want, folder
        if want == "data" and (folder / "corpus.jsonl").is_file() and (folder / "qrels" / "train.tsv").is_file():
            return want, folder
    return None


def training_texts(args: argparse.Namespace) -> tuple[Texts, Texts | None]:
    """The training texts and the dev texts (``--dev-split``; ``None``: carved from training)."""
    if args.data or args.sts:
        train = _pairs(args.data, args.sts, args.split)
    else:
        from embedpool.poolers.training import ict_spans

        if args.self_supervised != "ict":
            raise InvalidError("--corpus needs --self-supervised ict", param="--corpus")
        # documents as retrieval evaluation reads them (title + " " + text, file order): their
        # token states are one cache shared with the evaluation
        docs = [r.text for r in datasets.load_corpus(args.corpus)][: args.max_docs]
        spans = ict_spans(docs, args.seed)
        train = Texts("infonce", [(sp.sentence, sp.rest) for sp in spans], docs=docs, spans=spans)
    dev = None
    if args.dev_split:
        if args.dev_split == "test":
            raise InvalidError("--dev-split test: early stopping must not look at the test split", param="--dev-split")
        if not (args.data or args.sts):
            raise InvalidError("--dev-split needs --data or --sts", param="--dev-split")
        dev = _pairs(args.data, args.sts, args.dev_split)
    if len(train.pairs) < 4:
        raise InvalidError(f"only {len(train.pairs)} training pairs found; need at least 4")
    return train, dev


def with_distractors(tokenizer, train: Texts, dev: Texts | None, ratio: float, side: str,
                     seed: int) -> tuple[Texts, Texts | None, float]:
    """``train`` and ``dev`` with distractor words making up ``ratio`` of the tokens of every text
    on ``side`` (:class:`app.evaluation.stress.Distractors`: words drawn from the training texts,
    inserted at random positions, the text's own words in order). A text that occurs in several
    pairs gets one stressed version, so the pairs still share it. Returns the two and the
    measured injected fraction (distractor tokens over all tokens of the stressed texts)."""
    from embedpool.app.evaluation.stress import MAX_RATIO, Distractors

    if not 0.0 < ratio <= MAX_RATIO:
        raise InvalidError(f"--distractors must be in (0, {MAX_RATIO}], got {ratio}", param="--distractors")
    if train.docs is not None:
        raise InvalidError("--distractors needs labelled pairs (--data or --sts), not --corpus", param="--distractors")
    pool = Distractors(tokenizer, [t for pair in train.pairs for t in pair], seed)
    pool.rng.seed(f"train-{seed}-{ratio}")
    counts = [0, 0]  # own, added

    def stress(texts: Texts) -> Texts:
        done: dict[str, str] = {}

        def one(text: str) -> str:
            if text not in done:
                done[text], own, added = pool.inject(text, ratio)
                counts[0] += own
                counts[1] += added
            return done[text]

        q, d = side in ("queries", "both"), side in ("documents", "both")
        pairs = [(one(a) if q else a, one(b) if d else b) for a, b in texts.pairs]
        return replace(texts, pairs=pairs)

    train = stress(train)
    dev = stress(dev) if dev is not None else None
    return train, dev, counts[1] / max(1, sum(counts))


def _states(encoder, train: Texts, others: list[Texts | None], cache: Path, all_layers: bool, max_bytes: int):
    """Token states of the training texts and of each of ``others`` (the dev and guard texts;
    ``None`` stays ``None``) as ``PairData``, from the state cache; every hidden layer's with
    ``all_layers``. Refused before encoding when they would take more than ``max_bytes``.

    Queries and documents are cached separately (the model may prompt them differently); STS
    pairs are symmetric and use the document role for both sides."""
    from embedpool.poolers.training import (PairData, cache_token_states, ict_positive_states, pair_states,
                                            query_role, state_bytes)

    if train.docs is not None:  # ICT: the sentences and their documents (positives are cut from those)
        texts = [a for a, _ in train.pairs] + train.docs
    else:
        texts = [t for pair in train.pairs for t in pair]
    texts += [t for x in others if x for pair in x.pairs for t in pair]
    need = state_bytes(encoder, list(dict.fromkeys(texts)), all_layers)
    if need > max_bytes:
        raise TooLargeError(
            f"the token states to train on take {need / 2**30:.1f} GiB{' with every layer' if all_layers else ''}, "
            f"over --max-state-bytes {max_bytes / 2**30:.1f} GiB: train on fewer pairs or documents "
            "(--max-docs), or raise --max-state-bytes if this machine has the memory", param="--max-state-bytes")
    if train.docs is not None:
        n_texts = len({a for a, _ in train.pairs}) + len(train.docs)
    else:
        n_texts = len({a for a, _ in train.pairs}) + len({b for _, b in train.pairs})
    n_texts += sum(len({a for a, _ in t.pairs}) + len({b for _, b in t.pairs}) for t in others if t)
    with tqdm(total=n_texts, desc="token states", unit="text", file=sys.stderr) as bar:
        def states(texts: Texts) -> PairData:
            return pair_states(encoder, texts.pairs, texts.scores, query_role=query_role(texts.objective),
                               cache_dir=cache, progress=bar.update, all_layers=all_layers)

        if train.docs is not None:
            # ICT: the sentences are encoded as queries; each positive is its document's cached
            # token states without the sentence's tokens (one pass over the corpus, shared
            # with evaluation, instead of encoding every "rest of the document" again)
            q_texts = sorted({sp.sentence for sp in train.spans})
            q_states = cache_token_states(encoder, q_texts, "query", cache, bar.update, all_layers)
            doc_states = cache_token_states(encoder, train.docs, "document", cache, bar.update, all_layers)
            q_pos = {t: i for i, t in enumerate(q_texts)}
            data = PairData(q_states, ict_positive_states(encoder, train.docs, doc_states, train.spans),
                            [(q_pos[sp.sentence], k) for k, sp in enumerate(train.spans)])
            del doc_states
        else:
            data = states(train)
        return data, [states(t) if t else None for t in others]


def _config(args: argparse.Namespace, objective: str):
    """The training configuration: the flags given, and the objective's defaults
    (:data:`poolers.training.OBJECTIVE_DEFAULTS`) for those left out."""
    from embedpool.poolers.training import OBJECTIVE_DEFAULTS, TrainConfig, default_roles

    tuned = {k: v for k, v in OBJECTIVE_DEFAULTS[objective].items() if getattr(args, k) is None}
    given = {k: getattr(args, k) for k in OBJECTIVE_DEFAULTS[objective] if getattr(args, k) is not None}
    return TrainConfig(objective=objective, pooler=args.pooler, queries=args.queries, heads=args.heads,
                       roles=args.roles or default_roles(objective, args.pooler),
                       value_projection=not args.no_value_projection, epochs=args.epochs,
                       batch_size=args.batch_size, weight_decay=args.weight_decay, temperature=args.temperature,
                       seed=args.seed, dev_fraction=args.dev_fraction, select=args.select, anchor=args.anchor,
                       layer_lr=args.layer_lr, guard_tolerance=args.guard_tolerance, samples=args.samples,
                       **tuned, **given)


def _train(data, dev, guard, hidden_size: int, cfg):
    from embedpool.poolers.training import train_head

    bar = tqdm(desc="training", unit="eval", file=sys.stderr)

    def on_eval(row: dict) -> None:
        bar.update(1)
        bar.set_postfix({k: f"{v:.4f}" for k, v in row.items()
                         if k.startswith(("train", "dev", "guard_")) and isinstance(v, float)})

    try:
        return train_head(data, hidden_size, cfg, on_eval, dev, guard)
    finally:
        bar.close()


def _summary(args: argparse.Namespace, out: Path, train: Texts, dev: Texts | None, report, cfg,
             states_s: float, train_s: float) -> dict:
    guard = args.guard_data or args.guard_sts
    return {
        "out": str(out), "pooler": f"{args.pooler}:weights={out}", "pairs": len(train.pairs),
        "dev_pairs": len(dev.pairs) if dev else None,
        "objective": train.objective, "roles": cfg.roles, "select": args.select, "anchor": args.anchor,
        "lr": cfg.lr, "cosent_scale": cfg.cosent_scale, "eval_every": cfg.eval_every, "patience": cfg.patience,
        "dev": (f"{args.dev_split} split" if args.dev_split
                else f"{args.dev_fraction:.0%} of the ICT pairs" if args.corpus
                else f"{args.dev_fraction:.0%} carved from {args.split}"),
        "dev_metric": report.metric,
        "step0_dev_metric": round(report.step0_dev_metric, 5), "best_dev_metric": round(report.best_dev_metric, 5),
        "step0_dev_loss": round(report.step0_dev_loss, 5), "best_dev_loss": round(report.best_dev_loss, 5),
        **({"guard": f"{guard} {args.guard_split or ('train' if args.guard_data else 'dev')}",
            "guard_rule": ("significant loss (p < 0.05)" if cfg.guard_tolerance is None
                           else f"more than {cfg.guard_tolerance:g} below"),
            "guard_metric": report.guard_metric, "step0_guard_metric": round(report.step0_guard_metric, 5),
            "best_guard_metric": round(report.best_guard_metric, 5)} if guard else {}),
        "best_epoch": report.best_epoch, "best_step": report.best_step,
        "epochs_run": max(r["epoch"] for r in report.history),
        "token_state_seconds": round(states_s, 1), "train_seconds": round(train_s, 1),
    }


def run(args: argparse.Namespace) -> int:
    from embedpool.poolers.training import Guard

    train, dev = training_texts(args)
    found = guard_beside(args)
    if found:
        setattr(args, f"guard_{found[0]}", str(found[1]))
        print(f"guarded by {found[1]} (a folder of the other kind beside the training data; --no-guard to train "
              "without)", file=sys.stderr)
    guard = guard_texts(args)
    encoder = load_embedder(from_args(args)).encoder
    injected = None
    if args.distractors:
        train, dev, injected = with_distractors(encoder.tokenizer, train, dev, args.distractors,
                                                args.distractor_side, args.seed)
    out = Path(args.out)
    cache = Path(args.cache_dir) if args.cache_dir else out.parent / ".state-cache"
    started = time.perf_counter()
    data, (dev_data, guard_data) = _states(encoder, train, [dev, guard], cache, args.pooler == "multilayer",
                                           args.max_state_bytes)
    states_s = time.perf_counter() - started
    t0 = time.perf_counter()
    cfg = _config(args, train.objective)
    head, report = _train(data, dev_data, Guard(guard_data, guard.objective) if guard else None,
                          encoder.hidden_size, cfg)
    train_s = time.perf_counter() - t0
    head.save(out, encoder=encoder.model_id, objective=train.objective, source=str(args.data or args.sts or args.corpus),
              split=args.split, dev_split=args.dev_split, self_supervised=args.self_supervised, seed=args.seed,
              best_epoch=report.best_epoch, best_step=report.best_step, anchor=args.anchor,
              guard=str(args.guard_data or args.guard_sts or "") or None,
              **({"distractors": args.distractors, "distractor_side": args.distractor_side} if injected is not None
                 else {}))
    summary = _summary(args, out, train, dev, report, cfg, states_s, train_s)
    if injected is not None:
        summary.update(distractors=args.distractors, distractor_side=args.distractor_side,
                       injected_fraction=round(injected, 5))
    summary["trainable_parameters"] = sum(t.numel() for t in head.parameters() if t.requires_grad)
    (out / "train_report.json").write_text(json.dumps({**summary, "history": report.history}, indent=2))
    if report.best_step == 0:
        print("no checkpoint beat the untrained head (= mean pooling) on dev; the saved head is "
              "the untrained one", file=sys.stderr)
    print(json.dumps(summary))
    return 0
