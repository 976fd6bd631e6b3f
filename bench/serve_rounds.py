"""Round sizes of embedpool's batcher against a baseline checkout's, in the serving benchmark's cells.

``bench/serve.py`` reports throughput and where the worker's time went; this adds how the worker
cut the requests into rounds: per cell the rounds run (``embedpool_batch_size_count`` in
``/metrics``), their mean size in inputs and their mean duration. Both servers are up at once and
the cells alternate, the order rotating every repetition (as in ``bench/serve.py``); every
repetition is printed, nothing is kept "best".

    .venv/bin/python bench/serve_rounds.py --baseline ../old/.venv/bin/python
    .venv/bin/python bench/serve_rounds.py --baseline ../old/.venv/bin/python --reps 8 --set sentences --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve  # noqa: E402  (bench/serve.py: its servers, load generator and data)


async def round_metrics(port: int) -> dict[str, float]:
    """The batcher's round counters so far: rounds, inputs, round seconds, and worker stage seconds."""
    status, body = await serve._get(port, "/metrics")
    out = {"rounds": 0.0, "inputs": 0.0, "round_seconds": 0.0, "stages": 0.0}
    for line in body.decode().splitlines():
        if line.startswith("embedpool_batch_size_count"):
            out["rounds"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("embedpool_batch_size_sum"):
            out["inputs"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("embedpool_batch_duration_seconds_sum"):
            out["round_seconds"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("embedpool_round_stage_seconds_total{"):
            out["stages"] += float(line.rsplit(" ", 1)[1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, required=True, metavar="PYTHON",
                    help="the other checkout's venv Python (e.g. ../old/.venv/bin/python)")
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--set", choices=["sentences", "documents"], nargs="+", default=["sentences", "documents"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[32])
    ap.add_argument("--sts", type=int, default=300)
    ap.add_argument("--scifact", type=int, default=100)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=serve.ROOT / "bench" / "results" / "serve_rounds.json")
    args = ap.parse_args()

    sets = {}
    if "sentences" in args.set:
        sets["sts-b sentences"] = serve.load_sts(args.sts)
    if "documents" in args.set:
        sets["scifact documents"] = serve.load_scifact(args.scifact)
    logdir = serve.ROOT / "bench" / "results" / "cache" / "serve_rounds"
    logdir.mkdir(parents=True, exist_ok=True)
    results: dict = {"machine": {"cpu": serve._cpu(), "cores": os.cpu_count(), "isa": serve._isa(),
                                 "load_avg_start": os.getloadavg()},
                     "setup": {"precision": args.precision, "sets": {k: len(v) for k, v in sets.items()},
                               "concurrency": args.concurrency, "reps": args.reps,
                               "commit": serve.git_commit(serve.ROOT),
                               "baseline_commit": serve.git_commit(serve.baseline_tree(args.baseline))},
                     "cells": []}
    servers = {"current": serve.start_embedpool(args.precision, logdir),
               "baseline": serve.start_embedpool(args.precision, logdir, python=args.baseline)}
    try:
        for name, srv in servers.items():
            srv.wait()
            info = asyncio.run(serve.server_precision(srv.port))
            results["setup"][f"{name}_path"] = info["precision"]
            print(f"  {name}: path {info['precision']}", flush=True)
            asyncio.run(serve.check_embedding("127.0.0.1", srv.port, "/v1/embeddings", "x"))
        order = list(servers)
        for set_name, texts in sets.items():
            for srv in servers.values():  # warm up
                asyncio.run(serve.run_cell("127.0.0.1", srv.port, "/v1/embeddings", texts[:16], 4, "x"))
            for rep in range(args.reps):
                for c in args.concurrency:
                    for name in order:
                        srv = servers[name]
                        m0 = asyncio.run(round_metrics(srv.port))
                        r = asyncio.run(serve.run_cell("127.0.0.1", srv.port, "/v1/embeddings", texts, c, "x"))
                        m1 = asyncio.run(round_metrics(srv.port))
                        d = {k: m1[k] - m0[k] for k in m0}
                        cell = {"server": name, "set": set_name, "concurrency": c, "rep": rep,
                                "throughput": r["throughput"], "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"],
                                "seconds": r["seconds"], "rounds": int(d["rounds"]),
                                "inputs_per_round": round(d["inputs"] / d["rounds"], 2) if d["rounds"] else None,
                                "ms_per_round": round(1000 * d["round_seconds"] / d["rounds"], 2) if d["rounds"] else None,
                                "worker_idle": round(max(0.0, 1 - d["stages"] / r["seconds"]), 3)}
                        results["cells"].append(cell)
                        print(f"  {set_name} c={c} rep {rep} {name}: {r['throughput']} req/s, {cell['rounds']} rounds "
                              f"of {cell['inputs_per_round']} inputs, {cell['ms_per_round']} ms each, "
                              f"worker idle {100 * cell['worker_idle']:.0f}%", flush=True)
                    order = order[1:] + order[:1]
    finally:
        for srv in servers.values():
            srv.stop()
    serve.write_results(results, args.out)

    print("\n| set | conc. | server | req/s per rep | mean req/s | rounds (mean) | inputs per round (mean) "
          "| ms per round (mean) | worker idle (mean) |\n|---|---:|---|---|---:|---:|---:|---:|---:|")
    for set_name in sets:
        for c in args.concurrency:
            for name in servers:
                cs = [x for x in results["cells"] if x["set"] == set_name and x["concurrency"] == c
                      and x["server"] == name]
                mean = lambda k: sum(x[k] for x in cs) / len(cs)  # noqa: E731
                label = name if name == "current" else f"baseline {results['setup']['baseline_commit']}"
                print(f"| {set_name} | {c} | {label} | {' / '.join(format(x['throughput'], 'g') for x in cs)} | "
                      f"{mean('throughput'):.1f} | {mean('rounds'):.1f} | {mean('inputs_per_round'):.1f} | "
                      f"{mean('ms_per_round'):.1f} | {100 * mean('worker_idle'):.0f}% |")
    print(f"\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
