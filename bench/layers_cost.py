"""Cost of the poolers over every hidden layer: texts/s of a request that asks for ``mean`` and a
layer pooler (``layermean``, ``maxpoolbert``, ``multilayer``) against ``mean`` alone, on the
encoder ``precision=auto`` loads on this CPU (the OpenVINO graph then returns every layer from
the same forward; see poolers/runtimes.py), in one run.

SciFact documents and STS-B sentences (the encode benchmark's loaders) are cut into chunks and
every chunk goes through every request kind back to back, in a rotating order
(``bench/encode.py``'s ``encode_interleaved``); each kind's time is the sum over its chunks, so the
ratios of one run are the numbers to read on a shared machine. The target: a request with a
layer pooler at most 15% slower than ``mean`` alone (ratio >= 0.87 of its texts/s).

    flock /tmp/embedpool-bench.lock .venv/bin/python bench/layers_cost.py
    .venv/bin/python bench/layers_cost.py --docs 32 --sentences 128          # a quick run

Prints the CPU flags and a markdown table; writes ``bench/results/layers_cost.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))

import encode as encode_bench  # noqa: E402  (bench/encode.py: loaders, interleaving, versions)
import numpy as np  # noqa: E402
import torch  # noqa: E402

RESULTS = _HERE / "results" / "layers_cost.json"
LAYER_POOLERS = ["layermean", "maxpoolbert", "multilayer"]
TARGET = 1.15  # a layer request may take at most 15% longer than mean alone


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=200, help="SciFact documents (default 200)")
    ap.add_argument("--sentences", type=int, default=1000, help="STS-B sentences (default 1000)")
    ap.add_argument("--chunk-docs", type=int, default=20)
    ap.add_argument("--chunk-sentences", type=int, default=100)
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--data", type=Path, default=encode_bench.DEFAULT_DATA)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--poolers", nargs="+", default=LAYER_POOLERS, metavar="SPEC",
                    help="the poolers each asked next to mean (default: the layer poolers; any spec, e.g. "
                         "glot:weights=DIR)")
    args = ap.parse_args(argv)

    from embedpool.poolers import Embedder, FrozenEncoder
    from embedpool.cpu import cpu_features

    load_before = os.getloadavg()
    feats = cpu_features()
    print(f"CPU: {feats.summary()}\nall flags: {' '.join(sorted(feats.flags))}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    embedder = Embedder(FrozenEncoder(precision=args.precision))
    load_s = time.perf_counter() - t0
    enc = embedder.encoder
    print(f"{args.precision} -> {enc.precision}: {enc.precision_reason}", file=sys.stderr, flush=True)

    kinds = {"mean": ["mean"], **{f"mean+{p}": ["mean", p] for p in args.poolers}}
    systems = {name: (lambda texts, specs=specs: embedder.embed(texts, specs).matrix("mean")) for name, specs in kinds.items()}
    sets = {"scifact_docs": (encode_bench.load_docs(args.data, args.docs), args.chunk_docs),
            "stsb_sentences": (encode_bench.load_sentences(args.data, args.sentences), args.chunk_sentences)}
    for fn in systems.values():  # warm-up: first-call allocations, the all-layers view's compilation
        fn(sets["scifact_docs"][0][:4] + sets["stsb_sentences"][0][:4])

    out_sets = {}
    for name, (texts, chunk) in sets.items():
        if not texts:
            continue
        seconds, embs = encode_bench.encode_interleaved(systems, texts, chunk)
        rate = {k: len(texts) / s for k, s in seconds.items()}
        out_sets[name] = {
            "texts": len(texts), "seconds": seconds, "texts_per_s": rate,
            "time_ratio_to_mean": {k: seconds[k] / seconds["mean"] for k in seconds},
            # the mean vectors of a layer request (from the all-layers graph) against mean alone
            "mean_cosine_min": {k: float((embs[k] * embs["mean"]).sum(1).min()) for k in embs},
        }
        print(f"{name}: " + ", ".join(f"{k} {rate[k]:.1f}/s" for k in rate), file=sys.stderr, flush=True)

    worst = max(r for s in out_sets.values() for k, r in s["time_ratio_to_mean"].items() if k != "mean")
    result = {
        "benchmark": "layers_cost",
        "model": enc.model_id,
        "precision": {"asked": args.precision, "path": enc.precision, "reason": enc.precision_reason},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "isa": feats.isa, "torch_capability": feats.capability, "cpu": feats.summary(),
                    "flags": sorted(feats.flags), "load_average_before": load_before,
                    "load_average_after": os.getloadavg()},
        "load_seconds": load_s,
        "libraries": encode_bench._versions(),
        "sets": out_sets,
        "worst_time_ratio": worst,
        "target_time_ratio": TARGET,
        "meets_target": worst <= TARGET,
        "peak_rss_mb": encode_bench.peak_rss_mb(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(table(result))
    return result


def table(r: dict) -> str:
    lines = [f"encoder {r['precision']['path']} (asked {r['precision']['asked']}); {r['machine']['cpu']}", "",
             "| request | " + " | ".join(f"{s} texts/s | time vs mean" for s in r["sets"]) + " |",
             "|---|" + "---:|---:|" * len(r["sets"])]
    for kind in next(iter(r["sets"].values()))["texts_per_s"]:
        cells = [f"{s['texts_per_s'][kind]:.1f} | {s['time_ratio_to_mean'][kind]:.3f}x" for s in r["sets"].values()]
        lines.append(f"| `{kind}` | " + " | ".join(cells) + " |")
    lines += ["", f"worst: {r['worst_time_ratio']:.3f}x the time of mean alone (target <= {r['target_time_ratio']}x): "
              + ("met" if r["meets_target"] else "NOT met")]
    return "\n".join(lines)


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
