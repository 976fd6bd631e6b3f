"""``embedpool eval``: retrieval (BEIR), STS and synthetic long-document evaluation of poolers."""

from __future__ import annotations

import argparse
import sys

from embedpool.app.commands.common import (add_candidate_args, add_data_sources, add_fusion_args, add_job_args,
                                           command, job_options)
from embedpool.app.settings import from_args, load_embedder
from embedpool.errors import InvalidError
from embedpool.index import SEARCH_MODES


def register(sub) -> None:
    p = command(
        sub, "eval", run, help="evaluate poolers on BEIR retrieval, STS or synthetic long documents",
        description="Index a BEIR corpus with every --pooler (one forward pass per tokenization plan), "
                    "search every query through the collections and report nDCG@10, Recall@100, MRR@10, "
                    "MAP@100 (ranx), bytes per document, encode time, query latency and paired p-values "
                    "against --baseline. --sts scores Spearman of cosine similarity on a "
                    "sentence1/sentence2/score TSV; --synthetic-long hides each relevant document among "
                    "K distractors in one long document. Several --model (NAME=PATH_OR_ID or PATH_OR_ID): "
                    "every pooler on every model in one report, with paired p-values against the first "
                    "model's same pooler too.", several_models=True)
    add_data_sources(p, ("--synthetic-long", "BEIR folder to build long documents from"))
    p.add_argument("--split", default="test")
    p.add_argument("--pooler", action="append", dest="poolers", required=True, metavar="SPEC",
                   help="pooler spec, repeatable")
    p.add_argument("--mode", action="append", dest="modes", metavar="MODE",
                   help=f"multi-vector search mode(s): {', '.join(SEARCH_MODES)}; bm25 adds the collections' "
                        "lexical baseline, hybrid a row per pooler (and vector mode) fusing it with BM25, with "
                        "paired tests against its vector row and BM25; repeatable or comma-separated (default "
                        "exhaustive)")
    p.add_argument("--baseline", metavar="SPEC", help="pooler the p-values compare against (default mean, "
                                                      "else the first); 'SPEC [mode]' picks a mode")
    p.add_argument("--stat-test", choices=["student", "fisher"], default="student",
                   help="ranx paired test: student (paired t-test) or fisher (randomization)")
    p.add_argument("--out", metavar="FILE", help="report.json")
    p.add_argument("--markdown", metavar="FILE", help="Markdown table")
    p.add_argument("--plot", metavar="FILE", help="PNG plot of the metric against bytes per document")
    add_candidate_args(p)
    add_fusion_args(p, evaluation=True)
    p.add_argument("--companion-pooler", "--companion", dest="companion_pooler", default="auto", metavar="SPEC",
                   help="two_stage: pooler of the companion the multi-vector collections keep (mean, fde for MUVERA "
                        "fixed-dimensional encodings, or their per-window forms such as mean:per_window=true); "
                        "default auto: a per-window mean for windowing poolers, else mean (--companion is its "
                        "older name)")
    p.add_argument("--max-docs", type=int, help="evaluate on a slice of at most N documents")
    p.add_argument("--max-queries", type=int, help="at most N queries (synthetic-long default 100)")
    p.add_argument("--max-pairs", type=int, help="STS: the first N pairs only")
    p.add_argument("--seed", type=int, default=0, help="seed of slices and synthetic documents")
    p.add_argument("--distractors", type=int, nargs="+", default=[0, 4, 16], metavar="K",
                   help="synthetic-long: distractors per long document (default 0 4 16)")
    p.add_argument("--long-negatives", type=int, metavar="M",
                   help="synthetic-long: haystack-only long documents (default: as many as needles)")
    p.add_argument("--stress", choices=["distractors"],
                   help="score every pooler with random distractor words injected into the texts at each "
                        "--stress-ratios (the clean score, ratio 0, is the reference); with --data or --sts")
    p.add_argument("--stress-ratios", type=float, nargs="+", default=[0, 0.1, 0.3, 0.5, 0.7, 0.9], metavar="R",
                   help="fractions of each text's tokens that are distractors (default 0 0.1 0.3 0.5 0.7 0.9)")
    p.add_argument("--stress-side", choices=["documents", "queries", "both"], default="documents",
                   help="where distractors go: documents (STS: second sentences), queries (STS: first "
                        "sentences) or both (STS only)")
    p.add_argument("--latency-queries", type=int, default=32, metavar="N",
                   help="time single-query encoding and search on the first N queries (default 32)")
    p.add_argument("--index-dir", metavar="DIR",
                   help="index into DIR and keep the collections (a rerun resumes the indexing) "
                        "instead of a temporary folder")
    add_job_args(p, commit_every=500)


def run(args: argparse.Namespace) -> int:
    from embedpool.app import evaluation as ev

    modes = [m.strip() for ms in (args.modes or ["exhaustive"]) for m in ms.split(",") if m.strip()]
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    models = ev.model_entries(args.model or from_args(args, model=None).model)  # --model repeatable
    settings = from_args(args, model=models[0][1])
    if args.stress:
        if len(models) > 1:
            raise InvalidError("--stress evaluates one model; give one --model", param="--model")
        return _stress(args, settings, modes, log)
    one = _evaluation(args, modes, log)
    if len(models) == 1:
        report = one(load_embedder(settings), None)
    else:
        report = ev.evaluate_models(models, lambda path: load_embedder(settings.model_copy(update={"model": path})),
                                    one, stat_test=args.stat_test, log=log)
    print(ev.format_report(report))
    ev.write_outputs(report, args.out, args.markdown, args.plot)
    return 0


def _evaluation(args: argparse.Namespace, modes: list[str], log):
    """``one(embedder, model name or None) -> report``: the evaluation the flags ask for, of one
    model (the data read once for all models; each model indexes into a folder of its own)."""
    from pathlib import Path

    from embedpool.app import datasets
    from embedpool.app import evaluation as ev

    if args.sts:
        pairs = datasets.load_sts(args.sts, args.split)
        if args.max_pairs:
            pairs = pairs[: args.max_pairs]
        return lambda embedder, name: ev.evaluate_sts(embedder, pairs, args.poolers, baseline=args.baseline,
                                                      seed=args.seed,
                                                      info={"dataset": Path(args.sts).name, "split": args.split})
    data = datasets.load_beir(args.data or args.synthetic_long, args.split)
    if args.data:
        data = datasets.slice_beir(data, args.max_docs, args.max_queries, args.seed)
        log(f"{data.name} {args.split}: {len(data.corpus)} documents, {len(data.qrels)} queries")
    elif args.max_docs:
        raise InvalidError("--max-docs does not apply to --synthetic-long; use --max-queries", param="--max-docs")

    dev = None
    if any(":tuned" in f for f in args.fusion.split(",")) and ("hybrid" in modes):
        if not args.data:
            raise InvalidError("a tuned fusion needs a dev split of the same corpus: use --data (synthetic long "
                               "documents are built per split)", param="--fusion")
        if args.tune_split == args.split:
            raise InvalidError(f"--tune-split {args.tune_split}: the weight is never chosen on the reported split "
                               "(--split)", param="--tune-split")
        dev = datasets.dev_split(datasets.load_beir(args.data, args.tune_split), data)
        if not dev.qrels:
            raise InvalidError(f"--tune-split {args.tune_split}: none of its queries judges a document of this "
                               "corpus (or slice); nothing to choose a weight on", param="--tune-split")
        log(f"{data.name} {args.tune_split} (dev): {len(dev.qrels)} queries")

    def one(embedder, name: str | None) -> dict:
        index_dir = str(Path(args.index_dir) / name) if args.index_dir and name else args.index_dir
        common = dict(modes=modes, baseline=args.baseline, stat_test=args.stat_test,
                      candidates=args.candidates, companion_pooler=args.companion_pooler, k_token=args.k_token,
                      index_dir=index_dir, log=log, latency_queries=args.latency_queries,
                      fusion=args.fusion, weight=args.weight,
                      **job_options(args))
        if args.data:
            return ev.evaluate_retrieval(embedder, data, args.poolers, dev=dev, **common)
        return ev.evaluate_synthetic_long(
            embedder, data, args.poolers, args.distractors,
            n_queries=args.max_queries if args.max_queries is not None else 100, seed=args.seed,
            negatives=args.long_negatives, **common)

    return one


def _stress(args: argparse.Namespace, settings, modes: list[str], log) -> int:
    """``--stress distractors``: :func:`app.evaluation.evaluate_stress` on --sts or --data."""
    from pathlib import Path

    from embedpool.app import datasets
    from embedpool.app import evaluation as ev

    if not (args.sts or args.data):
        raise InvalidError("--stress runs on --data (BEIR) or --sts", param="--stress")
    if args.sts:
        pairs = datasets.load_sts(args.sts, args.split)[: args.max_pairs]
        kw = dict(sts=pairs, baseline=args.baseline, info={"dataset": Path(args.sts).name, "split": args.split})
    else:
        data = datasets.slice_beir(datasets.load_beir(args.data, args.split), args.max_docs, args.max_queries,
                                   args.seed)
        kw = dict(data=data, modes=modes, baseline=args.baseline, stat_test=args.stat_test,
                  candidates=args.candidates, companion_pooler=args.companion_pooler, k_token=args.k_token,
                  index_dir=args.index_dir, latency_queries=args.latency_queries, **job_options(args))
    report = ev.evaluate_stress(load_embedder(settings), args.poolers, args.stress_ratios, side=args.stress_side,
                                seed=args.seed, log=log, **kw)
    print(ev.format_report(report))
    ev.write_outputs(report, args.out, args.markdown, args.plot)
    return 0
