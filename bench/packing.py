"""Packing short rows into shared forward rows (poolers/packing.py) against the same encoder
unpacked, in one run.

Per precision path, one encoder; each cell runs packed (``pack_tokens`` 64) and unpacked
(``pack_tokens`` 0) back to back, ``--reps`` times in alternating order, and reports the median
of each side and their ratio (these machines are noisy: the ratio is the figure). Cells:

- ``sentences, one call``: all STS-B test sentences in one ``embed`` call (the engine's
  length-sorted token-budget batches; the in-process ceiling of ``bench/serve.py``);
- ``sentences, rounds of 30``: the same sentences in random groups of 30, each its own call (what
  the server's batcher forwards at 32 concurrent clients);
- ``documents, one call``: SciFact title + abstract (rows of ~250 tokens: not packed, a control).

Also the agreement of the two sides' ``mean`` vectors (min cosine) per cell. Writes
``bench/results/packing.json`` and prints a markdown table and the CPU flags.

    .venv/bin/python bench/packing.py                          # auto and fp32, ~3 min on 2 cores
    .venv/bin/python bench/packing.py --paths auto openvino-fp32 bf16-weights --reps 7
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve  # noqa: E402  (bench/serve.py: the data loaders and the CPU report)


def cells(sentences: list[str], documents: list[str], round_size: int) -> dict[str, list[list[str]]]:
    shuffled = sentences[:]
    random.Random(0).shuffle(shuffled)
    return {
        "sentences, one call": [sentences],
        f"sentences, rounds of {round_size}": [shuffled[i:i + round_size] for i in range(0, len(shuffled), round_size)],
        "documents, one call": [documents],
    }


def run(embedder, calls: list[list[str]]) -> tuple[float, np.ndarray]:
    """Texts per second over ``calls`` (each one ``embed``) and the ``mean`` vectors."""
    t0 = time.perf_counter()
    out = [embedder.embed(texts, ["mean"]).matrix("mean") for texts in calls]
    return sum(len(c) for c in calls) / (time.perf_counter() - t0), np.concatenate(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", nargs="+", default=["auto", "fp32"])
    ap.add_argument("--sentences", type=int, default=1379, help="STS-B test sentences (all: 1379)")
    ap.add_argument("--documents", type=int, default=200)
    ap.add_argument("--round", type=int, default=30, help="texts per call in the rounds cell")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=serve.ROOT / "bench" / "results" / "packing.json")
    args = ap.parse_args()

    from embedpool.poolers.encoder import FrozenEncoder
    from embedpool.poolers.packing import PACK_TOKENS
    from embedpool.poolers.pipeline import Embedder

    cpu = serve._isa()
    work = cells(serve.load_sts(args.sentences), serve.load_scifact(args.documents), args.round)
    results: dict = {"cpu": cpu, "cpu_model": serve._cpu(), "reps": args.reps, "pack_tokens": PACK_TOKENS, "rows": []}
    for path in args.paths:
        enc = FrozenEncoder(precision=path)
        emb = Embedder(enc)
        print(f"path {path} -> {enc.precision}", flush=True)
        for name, calls in work.items():
            rates: dict[int, list[float]] = {PACK_TOKENS: [], 0: []}
            vectors: dict[int, np.ndarray] = {}
            for side in (PACK_TOKENS, 0):  # warm both sides' shapes
                enc.pack_tokens = side
                run(emb, calls[:3])
            for rep in range(args.reps):
                for side in ((PACK_TOKENS, 0) if rep % 2 == 0 else (0, PACK_TOKENS)):
                    enc.pack_tokens = side
                    rate, vectors[side] = run(emb, calls)
                    rates[side].append(rate)
            enc.pack_tokens = PACK_TOKENS
            packed, plain = statistics.median(rates[PACK_TOKENS]), statistics.median(rates[0])
            row = {"path": path, "resolved": enc.precision, "cell": name, "packed_texts_per_s": round(packed, 1),
                   "unpacked_texts_per_s": round(plain, 1), "ratio": round(packed / plain, 3),
                   "packed_reps": [round(r, 1) for r in rates[PACK_TOKENS]],
                   "unpacked_reps": [round(r, 1) for r in rates[0]],
                   "min_cosine": round(float((vectors[PACK_TOKENS] * vectors[0]).sum(1).min()), 6)}
            results["rows"].append(row)
            print(f"  {name}: packed {row['packed_texts_per_s']} / unpacked {row['unpacked_texts_per_s']} texts/s "
                  f"= {row['ratio']}x  (min cos {row['min_cosine']})", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print("\n| path | cell | packed texts/s | unpacked texts/s | packed / unpacked | min cos |")
    print("|---|---|---:|---:|---:|---:|")
    for r in results["rows"]:
        print(f"| {r['path']} ({r['resolved']}) | {r['cell']} | {r['packed_texts_per_s']} | {r['unpacked_texts_per_s']} "
              f"| {r['ratio']}x | {r['min_cosine']} |")
    print(f"\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
