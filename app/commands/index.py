"""``embedpool index``: the resumable, streaming batch indexing job (see ``app/indexing.py``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from embedpool.app.commands.common import add_job_args, command, job_options
from embedpool.app.settings import add_stored_value_args, from_args, load_embedder
from embedpool.errors import import_extra


def register(sub) -> None:
    p = command(
        sub, "index", run, help="embed a corpus into one collection per pooler (resumable)",
        description="Embed a corpus (BEIR corpus.jsonl, JSON lines, Parquet, text lines, or - for stdin) "
                    "into one collection per pooler spec: NAME for one pooler, NAME-<pooler> for several. "
                    "Poolers that share a tokenization plan come from one forward pass. Commits every "
                    "--commit-every records; rerunning the same command after an interruption continues "
                    "after the last commit.", storage=True, storage_reads=False)
    p.add_argument("corpus", metavar="CORPUS", help="corpus file, or - for stdin")
    p.add_argument("--collection", required=True, metavar="NAME", help="collection name (or name prefix)")
    p.add_argument("--pooler", action="append", dest="poolers", metavar="SPEC",
                   help="pooler spec, repeatable (default: the model's own pooling)")
    p.add_argument("--format", choices=["auto", "beir", "jsonl", "parquet", "text"], default="auto",
                   help="corpus format (auto: by file suffix; BEIR is detected by its _id/title fields)")
    p.add_argument("--id-field", help="id field of JSON lines / Parquet (default _id or id)")
    p.add_argument("--text-field", help="text field (default text)")
    p.add_argument("--title-field", help="field prepended to the text (BEIR: title)")
    add_stored_value_args(p)
    add_job_args(p, commit_every=1000)
    p.add_argument("--companion-pooler", "--companion", dest="companion_pooler", default="auto", metavar="SPEC",
                   help="pooler of the companion every multi-vector collection keeps for two_stage candidates: "
                        "mean, fde, or a per-window form (mean:per_window=true: one row per window of a long "
                        "document); default auto: a per-window mean for poolers that window long documents "
                        "(window=true), else mean; 'none' for none (--companion is its older name)")
    p.add_argument("--factory", default="IDMap2,Flat",
                   help="FAISS factory of single-vector collections (Milvus: the equivalent index)")
    p.add_argument("--token-factory", default="HNSW32", help="FAISS factory of the token ANN (mode tokens)")
    p.add_argument("--dimensions", type=int, help="Matryoshka: keep the first N dimensions")
    p.add_argument("--no-normalize", action="store_true", help="do not L2-normalize")
    p.add_argument("--no-text", action="store_true", help="do not keep document texts in the collection")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    run_on = p.add_argument_group("runner of the job")
    run_on.add_argument("--runner", choices=RUNNERS, default="in-process",
                        help="where embedding runs: this process (default), or Ray Data workers (a local Ray "
                             "on this machine's cores, or the cluster at --ray-address)")
    run_on.add_argument("--engine", dest="runner", choices=RUNNERS, default=argparse.SUPPRESS, action=_Deprecated,
                        help="deprecated: the older name of --runner (still works)")
    run_on.add_argument("--ray-address", metavar="ADDRESS",
                        help="join this Ray cluster (host:6379, or ray://host:10001) instead of starting a local Ray")
    run_on.add_argument("--workers", type=int, metavar="N",
                        help="--runner ray: embedding actors, one encoder each (default 1)")
    run_on.add_argument("--worker-threads", type=int, metavar="N",
                        help="--runner ray: torch threads (and Ray CPUs) per worker (default: the cluster's "
                             "CPUs shared out, at most one node's)")


RUNNERS = ["in-process", "ray"]


class _Deprecated(argparse.Action):
    """An older flag name that still sets its new one, saying so on stderr."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"embedpool index: {option_string} is deprecated, use --runner", file=sys.stderr)
        setattr(namespace, self.dest, values)


def run(args: argparse.Namespace) -> int:
    from embedpool.app.datasets import CorpusSource
    from embedpool.app.indexing import IndexJob, format_summary

    if args.runner != "ray" and (args.ray_address or args.workers or args.worker_threads):
        from embedpool.errors import InvalidError

        raise InvalidError("--ray-address, --workers and --worker-threads apply to --runner ray only", param="--runner")
    if args.runner == "ray":  # before the model loads
        import_extra("ray", "ray", "--runner ray")
    settings = from_args(args)
    source = CorpusSource(args.corpus, args.format, args.id_field, args.text_field, args.title_field,
                          **settings.stored_limits())
    embedder = load_embedder(settings)
    poolers = args.poolers or [settings.pooler]
    job = IndexJob(embedder, settings.data_dir, args.collection, poolers, source=source.describe(),
                   companion_pooler=args.companion_pooler, factory=args.factory, token_factory=args.token_factory,
                   dimensions=args.dimensions, normalize=not args.no_normalize, store_text=not args.no_text,
                   **job_options(args), **settings.store())
    with job:
        if args.runner == "ray":
            from embedpool.app.rayjob import run_on_ray

            # Ray prints its cluster's console messages (e.g. raylet warnings) to this process's
            # stdout, which carries the job's summary (--json): they go to stderr instead
            with contextlib.redirect_stdout(sys.stderr):
                summary = run_on_ray(job, source, settings.model_dump(), address=args.ray_address,
                                     workers=args.workers or 1, threads=args.worker_threads)
        else:
            summary = job.run(source.records(), total=source.count())
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary))
    return 0
