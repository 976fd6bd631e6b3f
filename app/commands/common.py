"""Command-line flags that several subcommands share, each group defined once (the settings
flags -- model, precision, storage -- are in :mod:`app.settings`)."""

from __future__ import annotations

import argparse


def add_data_sources(p: argparse.ArgumentParser, *extra: tuple[str, str]) -> None:
    """``--data`` (BEIR) | ``--sts`` | each ``(flag, help)`` of ``extra``: one of them is required."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", metavar="DIR", help="BEIR folder: corpus.jsonl, queries.jsonl, qrels/<split>.tsv")
    src.add_argument("--sts", metavar="DIR", help="STS folder with <split>.tsv (sentence1, sentence2, score)")
    for flag, text in extra:
        src.add_argument(flag, metavar="DIR" if "corpus" not in flag else "FILE", help=text)


def add_candidate_args(p: argparse.ArgumentParser) -> None:
    """Multi-vector candidate generation: ``--candidates`` (two_stage), ``--k-token`` (tokens)."""
    p.add_argument("--candidates", type=int, default=100, help="two_stage: companion candidates per query")
    p.add_argument("--k-token", type=int, default=32, help="tokens mode: ANN neighbours per query token")


def add_fusion_args(p: argparse.ArgumentParser, evaluation: bool = False) -> None:
    """Hybrid search: ``--fusion`` and ``--weight`` (index.fusion); ``evaluation``: several
    fusions, a tuned weight (app.evaluation.fusion) and ``--tune-split``."""
    from embedpool.index import FUSIONS

    if evaluation:
        p.add_argument("--fusion", default="rrf", metavar="LIST",
                       help=f"hybrid rows: comma-separated fusions ({', '.join(FUSIONS)}), a row each; NAME:tuned "
                            "chooses its weight on --tune-split's queries and stores it in the collection "
                            "(default rrf)")
        p.add_argument("--weight", type=float, default=0.5,
                       help="hybrid: the vector side's weight, 0 (BM25 only) to 1 (vectors only); default 0.5")
        p.add_argument("--tune-split", default="train", metavar="SPLIT",
                       help="the labelled dev split (same corpus) a NAME:tuned fusion chooses its weight on "
                            "(default train; never the reported --split)")
        return
    p.add_argument("--fusion", choices=FUSIONS, default=None,
                   help="hybrid: reciprocal rank fusion (rrf), min-max (score) or z-score (zscore) normalized score "
                        "fusion; default: the fusion tuned for the collection (embedpool eval), else rrf")
    p.add_argument("--weight", type=float, default=None,
                   help="hybrid: the vector side's weight, 0 (BM25 only) to 1 (vectors only); default: the weight "
                        "tuned for the collection, else 0.5")


def add_job_args(p: argparse.ArgumentParser, commit_every: int) -> None:
    """The indexing job's flags (``embedpool index`` and the indexing inside ``embedpool eval``).
    Work is sized in tokens and bytes; the record counts are upper bounds (see
    :class:`app.indexing.IndexJob`)."""
    from embedpool.app.indexing import BATCH_TOKENS, COMMIT_BYTES
    from embedpool.precisions import STORAGE_PRECISIONS

    p.add_argument("--batch-tokens", type=int, default=BATCH_TOKENS, metavar="N",
                   help=f"tokens per embedding call, all windows counted (default {BATCH_TOKENS:,}); "
                        "a longer record is a call of its own")
    p.add_argument("--commit-bytes", type=int, default=COMMIT_BYTES, metavar="N",
                   help=f"commit once the vectors added since the last commit take N bytes as stored "
                        f"(default {COMMIT_BYTES >> 20} MiB)")
    p.add_argument("--commit-every", type=int, default=commit_every, metavar="N",
                   help=f"commit every N records at most (default {commit_every})")
    p.add_argument("--batch-docs", type=int, default=256, metavar="N",
                   help="records per embedding call at most (each call is split into token-budget forward "
                        "batches)")
    p.add_argument("--storage-precision", choices=STORAGE_PRECISIONS, default="float32",
                   help="storage of multi-vector token vectors")
    p.add_argument("--analyzer", default="english", metavar="SPEC",
                   help="the collections' BM25 index: a language (english, german, french, ...) with its stemmer "
                        "and stopwords, ':stem=false' / ':stopwords=false', or none (default english)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def job_options(args: argparse.Namespace) -> dict:
    """The :class:`app.indexing.IndexJob` keywords of :func:`add_job_args`' flags."""
    return {"commit_every": args.commit_every, "commit_bytes": args.commit_bytes, "batch_tokens": args.batch_tokens,
            "batch_docs": args.batch_docs, "storage_precision": args.storage_precision,
            "analyzer": args.analyzer, "progress": not args.no_progress}


def command(sub, name: str, run, *, help: str, description: str, storage: bool = False,
            storage_reads: bool = True, several_models: bool = False) -> argparse.ArgumentParser:
    """The parser of subcommand ``name`` running ``run(args)``, with the model flags (and, with
    ``storage``, the storage flags) of :mod:`app.settings` in their own help sections;
    ``storage_reads``: it reads collections to answer (the read-consistency flag);
    ``several_models``: ``--model`` may be repeated."""
    from embedpool.app.settings import add_model_args, add_storage_args

    p = sub.add_parser(name, help=help, description=description)
    p.set_defaults(func=run)
    add_model_args(p.add_argument_group("model"), several_models=several_models)
    if storage:
        add_storage_args(p.add_argument_group("storage"), reads=storage_reads)
    return p
