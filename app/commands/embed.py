"""``embedpool embed``: embed texts and print one JSON object per input."""

from __future__ import annotations

import argparse
import json
import sys

from embedpool.app.commands.common import command
from embedpool.app.datasets import read_texts
from embedpool.app.settings import from_args, load_embedder
from embedpool.errors import InvalidError


def register(sub) -> None:
    p = command(
        sub, "embed", run, help="embed texts and print JSON lines",
                       description="Print {\"index\": i, \"embedding\": [...]} per input "
                                   "({\"embeddings\": [[...], ...]} for multi-vector poolers; for a sparse "
                                   "pooler (splade) the embedding is {\"indices\": [...], \"values\": [...]}, "
                                   "its non-zero weights by ascending vocabulary id).")
    p.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed")
    p.add_argument("--input", metavar="FILE", help="one text per line, or JSON lines with a 'text' field; - for stdin")
    p.add_argument("--pooler", help="pooler spec, e.g. mean, cls, landmark:g=32, cluster:pool_factor=2")
    p.add_argument("--role", choices=["query", "document"], default="document")
    p.add_argument("--dimensions", type=int, help="Matryoshka: keep the first N dimensions")
    p.add_argument("--no-normalize", action="store_true", help="do not L2-normalize")
    p.add_argument("--sparse-tokens", action="store_true",
                   help="sparse pooler (splade): add \"tokens\", the tokenizer's strings of the indices")


def run(args: argparse.Namespace) -> int:
    texts = list(args.texts)
    if args.input == "-":
        texts += read_texts(sys.stdin, "stdin")
    elif args.input:
        with open(args.input, encoding="utf-8") as f:
            texts += read_texts(f, args.input)
    from embedpool.poolers import EmbedOptions, sparse_entries

    settings = from_args(args)
    embedder = load_embedder(settings)
    spec = args.pooler or settings.pooler
    sparse = embedder.pooler(spec).sparse
    if args.sparse_tokens and not sparse:
        raise InvalidError(f"--sparse-tokens: pooler {spec!r} is not sparse; it names the indices of a sparse "
                           "pooler's weights (--pooler splade)", param="--sparse-tokens")
    options = EmbedOptions(role=args.role, normalize=not args.no_normalize, dimensions=args.dimensions)
    result = embedder.embed(texts, [spec], options)
    key = "embeddings" if result.multi_vector[spec] else "embedding"
    if sparse:  # the non-zeros, as the HTTP route answers them, not a vocabulary-sized list
        rows = sparse_entries(result.vectors[spec], embedder.encoder.tokenizer if args.sparse_tokens else None)
    else:
        rows = [vec.tolist() for vec in result.vectors[spec]]
    out = sys.stdout
    for i, row in enumerate(rows):
        out.write(json.dumps({"index": i, key: row}) + "\n")
    return 0
