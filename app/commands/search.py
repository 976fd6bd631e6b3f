"""``embedpool search``: embed a query with the collection's own model and pooler and print hits,
through the one retrieval path (:mod:`app.retrieval`) the HTTP route and the evaluation use."""

from __future__ import annotations

import argparse
import json
import sys

from embedpool.app.commands.common import add_candidate_args, add_fusion_args, command
from embedpool.app.settings import from_args, load_embedder
from embedpool.errors import InvalidError
from embedpool.index import ALL_MODES, SEARCH_MODES


def register(sub) -> None:
    p = command(
        sub, "search", run, help="search a collection and print JSON hits",
        description="Embed each --query with the model and pooler recorded in the collection's manifest "
                    "and print one JSON line per query: {\"query\": ..., \"hits\": [{\"id\", \"score\", "
                    "\"text\", \"metadata\"}, ...]}.", storage=True)
    p.add_argument("--collection", required=True, metavar="NAME")
    p.add_argument("--query", action="append", required=True, metavar="TEXT", help="query text, repeatable")
    p.add_argument("-k", type=int, default=10, help="hits per query (default 10)")
    p.add_argument("--mode", choices=ALL_MODES, default="exhaustive",
                   help="bm25 (the collection's lexical index), hybrid (BM25 fused with --vector-mode), or the "
                        "multi-vector candidate generation (default exhaustive)")
    p.add_argument("--vector-mode", choices=SEARCH_MODES, default="exhaustive",
                   help="hybrid on a multi-vector collection: its vector mode (default exhaustive)")
    add_fusion_args(p)
    p.add_argument("--filter", metavar="JSON", help="metadata filter, e.g. '{\"year\": {\"$gte\": 2020}}' "
                                                   "(docs/api.md#metadata-filters)")
    add_candidate_args(p)
    p.add_argument("--no-text", action="store_true", help="leave document texts out of the output")


def run(args: argparse.Namespace) -> int:
    from embedpool.app.retrieval import Search, retrieve
    from embedpool.index import open_collection

    settings = from_args(args)
    with open_collection(settings.data_dir, args.collection, **settings.store(reads=True)) as coll:
        _require_documents(coll, args.collection)
        # BM25 alone embeds nothing: no model to load
        embedder = None if args.mode == "bm25" else load_embedder(from_args(args, model=_model_of(coll, args)))
        plan = Search(coll, embedder.natural_dim if embedder else coll.spec.dim, k=args.k, mode=args.mode,
                      candidates=args.candidates, k_token=args.k_token, filter=args.filter,
                      vector_mode=args.vector_mode, fusion=args.fusion, weight=args.weight)
        hits = retrieve(embedder, args.query, plan)
    out = sys.stdout
    for text, hs in zip(args.query, hits):
        out.write(json.dumps({"query": text, "collection": args.collection,
                              "mode": args.mode if plan.multi or plan.lexical else "single",
                              "hits": [{"id": h.id, "score": round(float(h.score), 6),
                                        **({} if args.no_text else {"text": h.text}),
                                        "metadata": h.metadata} for h in hs]}) + "\n")
    return 0


def _require_documents(coll, name: str) -> None:
    """An empty collection is refused (not found: exit 2, as a missing one) rather than answered with no hits: on
    the command line it is almost always an indexing run that wrote nothing (the HTTP API, whose
    clients add documents as they go, answers an empty list)."""
    if len(coll) == 0:
        from embedpool.errors import NotFoundError

        raise NotFoundError(f"collection {name!r} has no documents to search (created "
                            f"{coll.manifest.get('created', '?')}); index documents into it first "
                            "(embedpool index CORPUS --collection ...), or check that the indexing run succeeded",
                            param="--collection")


def _model_of(coll, args: argparse.Namespace) -> str:
    """The collection's model; ``--model`` may only name it again."""
    spec = coll.spec
    if args.model and args.model != spec.model:
        from embedpool.poolers.encoder import resolve_model

        if resolve_model(args.model)[0] != spec.model:
            raise InvalidError(f"collection {args.collection!r} was made with model {spec.model!r}, "
                               f"not {args.model!r}; leave --model out to use the collection's model", param="--model")
    return spec.model
