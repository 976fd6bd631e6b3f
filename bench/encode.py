"""Encoding benchmark: sentence-transformers fp32 (reference) vs embedpool fp32 vs the int8 fast path.

In one run, on the first ``--docs`` SciFact documents (``title + " " + text``) and ``--sentences``
STS-B sentences (test set ``sentence1``/``sentence2`` in order, then dev):

- texts/s of sentence-transformers ``encode()`` fp32 (the reference), embedpool fp32 and
  embedpool ``int8`` (ONNX Runtime fast path, ``poolers/fastpath.py``), all with ``mean`` pooling,
  normalized; ratios to the reference;
- cosine of every fast-path embedding to embedpool fp32 (min and mean), and of embedpool fp32 to
  the reference (a sanity check: ~1.0);
- ``cluster:pool_factor=2`` pooling time per document relative to encoding time per document,
  on the token states of one fp32 pass over the first ``--cluster-docs`` documents (pooling only,
  no forward in the timing);
- peak RSS of the process.

The machine is shared and noisy, so the texts are split into chunks and every chunk is encoded
by all three systems back to back, in a rotating order; each system's time is the sum over its
chunks. Ratios from the same run are the numbers to read.

    .venv/bin/python bench/encode.py                          # full size: several minutes
    .venv/bin/python bench/encode.py --docs 64 --sentences 256 # a quick run

Writes ``bench/results/encode.json`` (or ``--out``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_HERE = Path(__file__).resolve().parent

import numpy as np  # noqa: E402
import torch  # noqa: E402

from embedpool.app.datasets import CorpusSource, sts_sentences  # noqa: E402

ROOT = _HERE.parent
DEFAULT_DATA = Path(os.environ.get("EMBEDPOOL_SHARED_DATA", ROOT.parent / "shared" / "data"))
RESULTS = _HERE / "results" / "encode.json"
SYSTEMS = ("st_fp32", "embedpool_fp32", "embedpool_int8")


def load_docs(data: Path, n: int) -> list[str]:
    """The first ``n`` SciFact documents (``title + " " + text``, app/datasets.py)."""
    return [r.text for r in itertools.islice(CorpusSource(str(data / "scifact" / "corpus.jsonl"), "beir").records(), n)]


def load_sentences(data: Path, n: int) -> list[str]:
    """The first ``n`` STS-B sentences (test, then dev; both sides of each pair)."""
    return sts_sentences(data / "stsb", ("test", "dev"))[:n]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def encode_interleaved(encoders: dict, texts: list[str], chunk: int) -> tuple[dict, dict]:
    """Every chunk through every system (rotating order). Returns (seconds, embeddings)."""
    seconds = {k: 0.0 for k in encoders}
    parts: dict[str, list[np.ndarray]] = {k: [] for k in encoders}
    names = list(encoders)
    for c, start in enumerate(range(0, len(texts), chunk)):
        block = texts[start:start + chunk]
        for name in names[c % len(names):] + names[: c % len(names)]:
            t0 = time.perf_counter()
            emb = encoders[name](block)
            seconds[name] += time.perf_counter() - t0
            parts[name].append((start, emb))
    embs = {k: np.concatenate([e for _, e in sorted(v, key=lambda p: p[0])]) for k, v in parts.items()}
    return seconds, embs


def cosines(a: np.ndarray, b: np.ndarray) -> dict:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    c = (a * b).sum(1)
    return {"min": float(c.min()), "mean": float(c.mean()), "p01": float(np.quantile(c, 0.01))}


def time_cluster(encoder, texts: list[str]) -> dict:
    """Cluster pooling time on the token states of one fp32 pass (no forward in the timing)."""
    from embedpool.poolers.base import build_pooler

    pooler = build_pooler("cluster:pool_factor=2", default="mean", model_id=encoder.model_id)
    states = [s for _, s in encoder.encode(texts)]
    t0 = time.perf_counter()
    n_vectors = 0
    for s in states:
        out = pooler.pool(s)
        n_vectors += sum(int(v.shape[0]) for v in out)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "per_doc_ms": 1000 * seconds / max(len(texts), 1), "vectors": n_vectors}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=1000, help="SciFact documents (default 1000)")
    ap.add_argument("--sentences", type=int, default=2000, help="STS-B sentences (default 2000)")
    ap.add_argument("--chunk-docs", type=int, default=100, help="documents per interleaved chunk")
    ap.add_argument("--chunk-sentences", type=int, default=500, help="sentences per interleaved chunk")
    ap.add_argument("--cluster-docs", type=int, default=200,
                    help="documents whose fp32 token states are cluster-pooled for the pooling timing")
    ap.add_argument("--batch-size", type=int, default=32, help="sentence-transformers encode() batch size")
    ap.add_argument("--threads", type=int, default=0, help="torch/ONNX Runtime threads (0: torch default)")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    from sentence_transformers import SentenceTransformer

    from embedpool.poolers import Embedder, FrozenEncoder
    from embedpool.poolers.encoder import default_model_path

    docs = load_docs(args.data, args.docs)
    sentences = load_sentences(args.data, args.sentences)

    st = SentenceTransformer(default_model_path(), device="cpu", local_files_only=True)
    enc32 = FrozenEncoder(precision="fp32")
    t0 = time.perf_counter()
    enc8 = FrozenEncoder(precision="int8")  # builds the ONNX artifact on first use, then reuses it
    int8_load_s = time.perf_counter() - t0
    emb32, emb8 = Embedder(enc32), Embedder(enc8)

    encoders = {
        "st_fp32": lambda t: st.encode(t, batch_size=args.batch_size, normalize_embeddings=True,
                                       convert_to_numpy=True, show_progress_bar=False),
        "embedpool_fp32": lambda t: emb32.embed(t, ["mean"]).matrix("mean"),
        "embedpool_int8": lambda t: emb8.embed(t, ["mean"]).matrix("mean"),
    }
    for fn in encoders.values():  # warm-up (first-call allocations, ORT session init)
        fn(docs[:4] + sentences[:4])

    sets = {}
    for name, texts, chunk in (("scifact_docs", docs, args.chunk_docs),
                               ("stsb_sentences", sentences, args.chunk_sentences)):
        if not texts:
            continue
        tokens = sum(enc32.count_tokens(texts))
        seconds, embs = encode_interleaved(encoders, texts, chunk)
        ref = seconds["st_fp32"]
        sets[name] = {
            "texts": len(texts),
            "tokens": tokens,
            "seconds": seconds,
            "texts_per_s": {k: len(texts) / v for k, v in seconds.items()},
            "ratio_to_reference": {k: ref / v for k, v in seconds.items()},
            "cosine_int8_to_fp32": cosines(embs["embedpool_int8"], embs["embedpool_fp32"]),
            "cosine_fp32_to_reference": cosines(embs["embedpool_fp32"], embs["st_fp32"]),
        }
        print(f"[{name}] done: {json.dumps({k: round(v, 2) for k, v in sets[name]['texts_per_s'].items()})}",
              file=sys.stderr, flush=True)

    cluster = None
    if docs:
        cluster = time_cluster(enc32, docs[: args.cluster_docs])
        cluster["docs"] = min(len(docs), args.cluster_docs)
        d = sets["scifact_docs"]["seconds"]
        per_doc = {k: v / len(docs) for k, v in d.items()}
        cluster["fraction_of_encode_fp32"] = cluster["per_doc_ms"] / 1000 / per_doc["embedpool_fp32"]
        cluster["fraction_of_encode_int8"] = cluster["per_doc_ms"] / 1000 / per_doc["embedpool_int8"]

    result = {
        "benchmark": "encode",
        "model": enc32.model_id,
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "fast_path": {"precision": "int8", "artifact": str(enc8._forward_fn.path),
                      "load_seconds": int8_load_s},
        "sets": sets,
        "cluster_pool_factor_2": cluster,
        "peak_rss_mb": peak_rss_mb(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(table(result))
    return result


def table(r: dict) -> str:
    lines = ["| set | texts | ST fp32 texts/s | embedpool fp32 texts/s (x ref) | int8 fast path texts/s (x ref) "
             "| int8 cos to fp32 min / mean |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, s in r["sets"].items():
        tps, ratio, cos = s["texts_per_s"], s["ratio_to_reference"], s["cosine_int8_to_fp32"]
        lines.append(
            f"| {name} | {s['texts']} | {tps['st_fp32']:.1f} | {tps['embedpool_fp32']:.1f} "
            f"({ratio['embedpool_fp32']:.2f}x) | {tps['embedpool_int8']:.1f} ({ratio['embedpool_int8']:.2f}x) "
            f"| {cos['min']:.4f} / {cos['mean']:.4f} |")
    c = r.get("cluster_pool_factor_2")
    if c:
        lines.append("")
        lines.append(f"cluster:pool_factor=2 pooling ({c['docs']} docs): {c['per_doc_ms']:.2f} ms/doc = "
                     f"{100 * c['fraction_of_encode_fp32']:.1f}% of fp32 encode time, "
                     f"{100 * c['fraction_of_encode_int8']:.1f}% of int8 encode time (target <= 20%)")
    lines.append(f"peak RSS: {r['peak_rss_mb']:.0f} MB; torch threads: {r['machine']['torch_threads']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
