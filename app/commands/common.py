"""Command-line flags that several subcommands share, each group defined once (the settings
flags -- model, precision, storage -- are in :mod:`app.settings`)."""

from __future__ import annotations

import argparse

PRECISIONS = ["float32", "float16", "int8"]


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


def add_job_args(p: argparse.ArgumentParser, commit_every: int) -> None:
    """The indexing job's flags (``embedpool index`` and the indexing inside ``embedpool eval``)."""
    p.add_argument("--commit-every", type=int, default=commit_every, metavar="N",
                   help=f"commit every N records (default {commit_every})")
    p.add_argument("--batch-docs", type=int, default=256, metavar="N",
                   help="records per embedding call (each is split into token-budget forward batches)")
    p.add_argument("--storage-precision", choices=PRECISIONS, default="float32",
                   help="storage of multi-vector token vectors")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def command(sub, name: str, run, *, help: str, description: str, storage: bool = False) -> argparse.ArgumentParser:
    """The parser of subcommand ``name`` running ``run(args)``, with the engine flags (and, with
    ``storage``, the storage flags) of :mod:`app.settings` in their own help sections."""
    from embedpool.app.settings import add_engine_args, add_storage_args

    p = sub.add_parser(name, help=help, description=description)
    p.set_defaults(func=run)
    add_engine_args(p.add_argument_group("engine"))
    if storage:
        add_storage_args(p.add_argument_group("storage"))
    return p
