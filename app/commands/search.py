"""``embedpool search``: embed a query with the collection's own model and pooler and print hits."""

from __future__ import annotations

import argparse
import json
import sys

from embedpool.app.cli import UsageError
from embedpool.app.settings import add_engine_args, add_storage_args, from_args, load_embedder


def register(sub) -> None:
    p = sub.add_parser(
        "search", help="search a collection and print JSON hits",
        description="Embed each --query with the model and pooler recorded in the collection's manifest "
                    "and print one JSON line per query: {\"query\": ..., \"hits\": [{\"id\", \"score\", "
                    "\"text\", \"metadata\"}, ...]}.")
    p.add_argument("--collection", required=True, metavar="NAME")
    p.add_argument("--query", action="append", required=True, metavar="TEXT", help="query text, repeatable")
    p.add_argument("-k", type=int, default=10, help="hits per query (default 10)")
    p.add_argument("--mode", choices=["exhaustive", "tokens", "two_stage"], default="exhaustive",
                   help="multi-vector candidate generation (default exhaustive)")
    p.add_argument("--candidates", type=int, default=100, help="two_stage: companion candidates per query")
    p.add_argument("--k-token", type=int, default=32, help="tokens: ANN neighbours per query token")
    p.add_argument("--no-text", action="store_true", help="leave document texts out of the output")
    add_engine_args(p)
    add_storage_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from embedpool.index import open_collection

    settings = from_args(args)
    coll = open_collection(settings.data_dir, args.collection, **settings.store())
    try:
        spec = coll.spec
        if args.model and args.model != spec.model:
            from embedpool.poolers.encoder import resolve_model

            if resolve_model(args.model)[0] != spec.model:
                raise UsageError(f"collection {args.collection!r} was made with model {spec.model!r}, "
                                 f"not {args.model!r}; leave --model out to use the collection's model")
        embedder = load_embedder(from_args(args, model=spec.model))
        comp = None
        specs = [spec.pooler]
        if spec.kind == "multi" and args.mode == "two_stage":
            if not spec.companion:
                raise UsageError(f"collection {args.collection!r} has no companion collection for two_stage; "
                                 "use --mode exhaustive or tokens")
            comp = open_collection(settings.data_dir, spec.companion, **settings.store())
            specs.append(comp.spec.pooler)
        dims = spec.dim if spec.dim < embedder.dim else None
        res = embedder.embed(args.query, poolers=list(dict.fromkeys(specs)), role="query",
                             normalize=spec.normalized, dimensions=dims)
        q = res.vectors[spec.pooler]
        if spec.kind == "single":
            hits = coll.search(np.stack(q), k=args.k)
        elif comp is not None:
            cdims = comp.spec.dim if comp.spec.dim < embedder.dim else None
            cq = res.vectors[comp.spec.pooler] if cdims == dims else embedder.embed(
                args.query, poolers=[comp.spec.pooler], role="query", normalize=comp.spec.normalized,
                dimensions=cdims).vectors[comp.spec.pooler]
            hits = coll.search(q, k=args.k, mode="two_stage", candidates=args.candidates,
                               companion_queries=np.stack(cq), companion=comp)
        else:
            hits = coll.search(q, k=args.k, mode=args.mode, k_token=args.k_token)
        out = sys.stdout
        for text, hs in zip(args.query, hits):
            out.write(json.dumps({"query": text, "collection": args.collection, "mode": args.mode
                                  if spec.kind == "multi" else None,
                                  "hits": [{"id": h.id, "score": round(float(h.score), 6),
                                            **({} if args.no_text else {"text": h.text}),
                                            "metadata": h.metadata} for h in hs]}) + "\n")
        if comp is not None:
            comp.close()
    finally:
        coll.close()
    return 0
