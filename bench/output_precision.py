"""What the output precisions of ``/embed`` cost in quality: STS-B Spearman of each precision
next to float32, in one run (same vectors), with the int8 ranges the server uses by default
(fixed ``[-1, 1]``) beside ranges calibrated on STS-B train sentences.

    flock /tmp/embedpool-bench.lock .venv/bin/python bench/output_precision.py

Scores are computed on the codes themselves, as a vector index would (cosine of the int8 /
uint8 codes; binary: the fraction of equal bits), not after dequantizing. Writes
``bench/results/output_precision.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from embedpool.app.datasets import load_sts
from embedpool.poolers import Embedder, FrozenEncoder, quantize_output, unit_ranges

ROOT = Path(__file__).resolve().parents[1]


def cpu_flags() -> dict:
    import torch

    flags = ""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":", 1)[1]
    except (OSError, StopIteration):
        pass
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
    return {"flags": [f for f in wanted if f in flags.split()], "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "cpus": os.cpu_count(), "platform": platform.platform(), "loadavg": os.getloadavg()}


def similarity(a: np.ndarray, b: np.ndarray, precision: str) -> np.ndarray:
    if precision.endswith("binary"):
        bits_a, bits_b = np.unpackbits(a.view(np.uint8), axis=1), np.unpackbits(b.view(np.uint8), axis=1)
        return (bits_a == bits_b).mean(axis=1)
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / np.sqrt((a * a).sum(1) * (b * b).sum(1)).clip(1e-12)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sts", type=Path, default=ROOT.parent / "shared" / "data" / "stsb")
    p.add_argument("--calibration", type=int, default=2000, help="STS-B train sentences for calibrated ranges")
    p.add_argument("--pooler", default="mean")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "output_precision.json")
    args = p.parse_args()

    pairs = load_sts(args.sts, "test")
    train = list(dict.fromkeys(s for a, b, _ in load_sts(args.sts, "train") for s in (a, b)))[: args.calibration]
    gold = np.array([s for _, _, s in pairs])
    embedder = Embedder(FrozenEncoder())
    t0 = time.perf_counter()
    out = embedder.embed([a for a, _, _ in pairs] + [b for _, b, _ in pairs] + train, [args.pooler])
    seconds = time.perf_counter() - t0
    vecs = out.matrix(embedder.canonical(args.pooler))
    n = len(pairs)
    a, b, calib = vecs[:n], vecs[n:2 * n], vecs[2 * n:]
    calibrated = np.vstack([calib.min(0), calib.max(0)])
    cases = [("float32", None, "-"), ("float16", None, "-"), ("int8", unit_ranges(vecs.shape[1]), "fixed [-1, 1]"),
             ("int8", calibrated, f"STS-B train, {len(train)} sentences"), ("uint8", unit_ranges(vecs.shape[1]), "fixed [-1, 1]"),
             ("binary", None, "-"), ("ubinary", None, "-")]
    ref = similarity(a, b, "float32")
    rows = []
    for precision, ranges, label in cases:
        qa, qb = (np.stack(quantize_output(list(x), precision, ranges)) for x in (a, b))
        sim = similarity(qa, qb, precision)
        rows.append({"precision": precision, "ranges": label, "bytes_per_vector": int(qa[0].nbytes),
                     "spearman_gold": float(spearmanr(sim, gold)[0]), "spearman_to_float32": float(spearmanr(sim, ref)[0]),
                     "levels_used_median": int(np.median([len(np.unique(c)) for c in qa.T])) if "int8" in precision else None})
    base = rows[0]["spearman_gold"]
    for r in rows:
        r["ratio_to_float32"] = r["spearman_gold"] / base
    result = {"benchmark": "output_precision", "model": embedder.model_id, "pooler": args.pooler, "pairs": n,
              "encode_seconds": seconds, "machine": cpu_flags(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    m = result["machine"]
    print(f"CPU flags {m['flags']} torch {m['torch_capability']} load {m['loadavg']}; STS-B test, {n} pairs, {args.pooler}")
    print("| precision | int8 ranges | bytes / vector | Spearman (x float32) | Spearman to float32 scores | levels used per dim (median) |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['precision']} | {r['ranges']} | {r['bytes_per_vector']} | {r['spearman_gold']:.4f} "
              f"({r['ratio_to_float32']:.4f}) | {r['spearman_to_float32']:.4f} | {r['levels_used_median'] or '-'} |")


if __name__ == "__main__":
    main()
