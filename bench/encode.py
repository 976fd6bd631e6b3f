"""Encoding benchmark: sentence-transformers fp32 (reference) vs every encoder path of embedpool
on this machine, and ``precision=auto``.

In one run, on the first ``--docs`` SciFact documents (``title + " " + text``) and ``--sentences``
STS-B sentences (test set ``sentence1``/``sentence2`` in order, then dev):

- texts/s of sentence-transformers ``encode()`` fp32 (the reference) and of embedpool with each
  path (``poolers/precision.py``: torch fp32 / bf16 autocast / bf16 weights, OpenVINO fp32 / bf16 /
  NNCF int8 / int8 weights; and ONNX Runtime's own dynamic and static QDQ int8 from
  ``bench/onnx_paths.py``, which no setting reaches), all with ``mean``
  pooling, normalized; ratios to the
  reference; ``auto`` as the encoder the server would load;
- cosine of every path's embedding to embedpool fp32 (min and mean) and the quality bar
  (min ≥ 0.995); embedpool fp32 to the reference (a sanity check: ~1.0);
- the CPU flags found (``/proc/cpuinfo``, ``torch.backends.cpu.get_cpu_capability()``), which path
  ``auto`` chose and why, the load average before and after, peak RSS;
- ``cluster:pool_factor=2`` pooling time per document relative to fp32 encoding time.

bf16 paths are skipped on CPUs without bf16 hardware (emulated bf16 is very slow). The machine is
shared and noisy, so the texts are split into chunks and every chunk is encoded by all systems
back to back, in a rotating order; each system's time is the sum over its chunks. Ratios from the
same run are the numbers to read.

    flock /tmp/embedpool-bench.lock .venv/bin/python bench/encode.py         # full size
    .venv/bin/python bench/encode.py --docs 64 --sentences 256                # a quick run
    .venv/bin/python bench/encode.py --paths fp32 openvino-bf16               # some paths only
    .venv/bin/python bench/encode.py --model models/all-mpnet-base-v2 --out bench/results/encode_mpnet_vnni_epyc.json

Writes ``bench/results/encode.json`` (or ``--out``) and prints markdown tables.
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

# --emulate-avx2: cap the kernels' instruction set to AVX2 before torch/OpenVINO load (torch's
# ATen dispatch, oneDNN in torch and OpenVINO, MKL). An approximation of an AVX2-only machine on
# a newer core (same caches and clocks; ONNX Runtime's MLAS ignores these, and a few OpenVINO
# kernels stay AVX-512), so its figures are labelled "emulated".
EMULATE_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2",
                "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
if "--emulate-avx2" in sys.argv:
    os.environ.update(EMULATE_AVX2)  # and a cache of its own: compiled kernels are per ISA
    os.environ["EMBEDPOOL_CACHE_DIR"] = str(Path(os.environ.get("TMPDIR", "/tmp")) / "embedpool-cache-emulated-avx2")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from embedpool.app.datasets import CorpusSource, sts_sentences  # noqa: E402

ROOT = _HERE.parent
DEFAULT_DATA = Path(os.environ.get("EMBEDPOOL_SHARED_DATA", ROOT.parent / "shared" / "data"))
RESULTS = _HERE / "results" / "encode.json"


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


def build_systems(args, st, enc32, feats):
    """name -> encode(texts) -> normalized [N, D]; plus load seconds and skipped paths."""
    import copy

    from embedpool.poolers import Embedder, FrozenEncoder
    from onnx_paths import PATHS as ONNX_PATHS
    from onnx_paths import load_path

    from embedpool.poolers.precision import choose
    from embedpool.precisions import ENCODER_PATHS

    isa = feats.isa
    wanted = args.paths or [*ENCODER_PATHS, *ONNX_PATHS]
    systems = {"st_fp32": lambda t: st.encode(t, batch_size=args.batch_size, normalize_embeddings=True,
                                              convert_to_numpy=True, show_progress_bar=False)}
    load_s, skipped = {}, {}
    for path in ["fp32", *[p for p in wanted if p != "fp32"]]:
        if "bf16" in path and isa not in ("amx", "avx512_bf16"):
            skipped[path] = f"no bf16 hardware ({isa})"
            continue
        t0 = time.perf_counter()
        try:
            fwd = load_path(path, enc32.model, enc32.tokenizer, enc32.max_length)
        except Exception as exc:  # a library missing or failing: reported, not fatal
            skipped[path] = f"{type(exc).__name__}: {exc}"[:200]
            continue
        twin = copy.copy(enc32)
        twin.stats = type(enc32.stats)()
        twin._forward_fn, twin.precision = fwd, path
        load_s[path] = time.perf_counter() - t0
        systems[path] = (lambda e: lambda t: e.embed(t, ["mean"]).matrix("mean"))(Embedder(twin))
    t0 = time.perf_counter()
    if args.emulate_avx2:  # auto as it decides on an AVX2-only CPU
        path, why = choose(feats)
        auto = FrozenEncoder(args.model, precision=path, max_batch_tokens=enc32.max_batch_tokens)
        auto.precision_reason = why
    else:
        auto = FrozenEncoder(args.model, precision="auto", max_batch_tokens=enc32.max_batch_tokens)
    load_s["auto"] = time.perf_counter() - t0
    systems["auto"] = (lambda e: lambda t: e.embed(t, ["mean"]).matrix("mean"))(Embedder(auto))
    return systems, load_s, skipped, auto


def measure_sets(systems: dict, enc32, docs: list[str], sentences: list[str], args) -> dict:
    """Both text sets through every system, interleaved; speeds, ratios and cosines to fp32."""
    from embedpool.poolers import Embedder

    sets = {}
    for name, texts, chunk in (("scifact_docs", docs, args.chunk_docs),
                               ("stsb_sentences", sentences, args.chunk_sentences)):
        if not texts:
            continue
        seconds, embs = encode_interleaved(systems, texts, chunk)
        ref = seconds["st_fp32"]
        sets[name] = {
            "texts": len(texts), "tokens": sum(Embedder(enc32).measure(texts, ["mean"]).counts), "seconds": seconds,
            "texts_per_s": {k: len(texts) / v for k, v in seconds.items()},
            "ratio_to_reference": {k: ref / v for k, v in seconds.items()},
            "cosine_to_fp32": {k: cosines(e, embs["fp32"]) for k, e in embs.items()},
        }
        print(f"[{name}] done: {json.dumps({k: round(v, 2) for k, v in sets[name]['texts_per_s'].items()})}",
              file=sys.stderr, flush=True)
    return sets


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
    ap.add_argument("--paths", nargs="*", help="embedpool paths to measure (default: all; fp32 and auto always)")
    ap.add_argument("--emulate-avx2", action="store_true",
                    help="cap torch/oneDNN/OpenVINO/MKL to AVX2 (see EMULATE_AVX2); auto decides as on AVX2")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--model", help="model folder (default: the packaged all-MiniLM-L6-v2), e.g. "
                    "models/all-mpnet-base-v2 after `make models`; the reference loads the same folder")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    from sentence_transformers import SentenceTransformer

    from embedpool.poolers import FrozenEncoder
    from embedpool.poolers.encoder import default_model_path
    from embedpool.cpu import cpu_features

    load_before = os.getloadavg()
    feats = cpu_features()
    if args.emulate_avx2:
        from embedpool.poolers.precision import CpuFeatures

        feats = CpuFeatures.of([f for f in feats.flags if not f.startswith(("avx512", "amx", "avx_vnni"))],
                               f"{torch.backends.cpu.get_cpu_capability()} (emulated)")
    print(f"CPU: {feats.summary()}\nall flags: {' '.join(sorted(feats.flags))}", file=sys.stderr, flush=True)
    docs = load_docs(args.data, args.docs)
    sentences = load_sentences(args.data, args.sentences)

    st = SentenceTransformer(args.model or default_model_path(), device="cpu", local_files_only=True)
    enc32 = FrozenEncoder(args.model, precision="fp32")
    systems, load_s, skipped, auto = build_systems(args, st, enc32, feats)
    print(f"auto -> {auto.precision}: {auto.precision_reason}", file=sys.stderr, flush=True)
    for fn in systems.values():  # warm-up (first-call allocations, session init)
        fn(docs[:4] + sentences[:4])

    sets = measure_sets(systems, enc32, docs, sentences, args)

    cluster = None
    if docs:
        cluster = time_cluster(enc32, docs[: args.cluster_docs])
        cluster["docs"] = min(len(docs), args.cluster_docs)
        per_doc = sets["scifact_docs"]["seconds"]["fp32"] / len(docs)
        cluster["fraction_of_encode_fp32"] = cluster["per_doc_ms"] / 1000 / per_doc

    result = {
        "benchmark": "encode",
        "model": enc32.model_id,
        "machine": {"emulated_avx2": bool(args.emulate_avx2), "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "torch": torch.__version__, "isa": feats.isa, "torch_capability": feats.capability,
                    "flags": sorted(feats.flags), "load_average_before": load_before,
                    "load_average_after": os.getloadavg()},
        "auto": {"path": auto.precision, "reason": auto.precision_reason},
        "load_seconds": load_s,
        "skipped": skipped,
        "libraries": _versions(),
        "sets": sets,
        "cluster_pool_factor_2": cluster,
        "peak_rss_mb": peak_rss_mb(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(table(result))
    return result


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "sentence-transformers", "openvino", "nncf", "onnxruntime"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


BAR = 0.995


def table(r: dict) -> str:
    docs, sents = r["sets"].get("scifact_docs"), r["sets"].get("stsb_sentences")
    lines = [f"ISA: {r['machine']['isa']}{' (EMULATED on a newer CPU)' if r['machine'].get('emulated_avx2') else ''} "
             f"(torch {r['machine']['torch_capability']}); auto -> "
             f"**{r['auto']['path']}**; load average {r['machine']['load_average_before'][0]:.1f} before, "
             f"{r['machine']['load_average_after'][0]:.1f} after", "",
             "| path | documents texts/s (x ref) | sentences texts/s (x ref) | cos to fp32 min / mean (docs) "
             "| (sentences) | bar (min cos ≥ 0.995) |",
             "|---|---:|---:|---:|---:|---|"]

    def cell(s, k):
        return f"{s['texts_per_s'][k]:.1f} ({s['ratio_to_reference'][k]:.2f}x)" if s else ""

    def cos(s, k):
        return f"{s['cosine_to_fp32'][k]['min']:.4f} / {s['cosine_to_fp32'][k]['mean']:.4f}" if s else ""

    for k in (docs or sents)["texts_per_s"]:
        label = {"st_fp32": "sentence-transformers fp32 (reference)", "auto": f"auto ({r['auto']['path']})"}.get(k, k)
        mins = [s["cosine_to_fp32"][k]["min"] for s in (docs, sents) if s]
        bar = "" if k == "st_fp32" else ("met" if min(mins) >= BAR else "**missed**")
        lines.append(f"| {label} | {cell(docs, k)} | {cell(sents, k)} | {cos(docs, k)} | {cos(sents, k)} | {bar} |")
    for k, why in r["skipped"].items():
        lines.append(f"| {k} | skipped: {why} | | | | |")
    c = r.get("cluster_pool_factor_2")
    if c:
        lines.append("")
        lines.append(f"cluster:pool_factor=2 pooling ({c['docs']} docs): {c['per_doc_ms']:.2f} ms/doc = "
                     f"{100 * c['fraction_of_encode_fp32']:.1f}% of fp32 encode time (target <= 20%)")
    lines.append(f"peak RSS: {r['peak_rss_mb']:.0f} MB (all paths loaded); torch threads: "
                 f"{r['machine']['torch_threads']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
