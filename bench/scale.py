"""Scale benchmark: cost and memory of one long document, as its length grows.

For synthetic documents of 1k, 4k, 16k and 64k tokens (SciFact abstracts joined in file order,
cut at the token count) and each pooler (``mean``, ``landmark``, ``tokens:window=true``,
``cluster:pool_factor=4,window=true``), one subprocess per (size, pooler) -- so every case's
peak RSS is its own -- loads the model, warms it up on a one-window text and times
``Embedder.embed([document], [pooler])`` (repeated until 2 s have passed, at most 5 times;
the fastest run, the least disturbed on a shared machine; one torch thread by default, as
``bench/index.py``, for the same reason). It reports seconds per 1k tokens, the process's peak RSS (``ru_maxrss``: model
load included, what a user sees) and the peak RSS growth of the embed step itself (the kernel's
high-water mark, reset just before the step through ``/proc/self/clear_refs``, minus the RSS
before it: exact, every allocator included, no sampling gaps).

The other side, in the same run: the old ``cluster:window=true``, which Ward-clustered all
tokens of a text at once (``--old-sizes``, default 1k, 4k and 8k tokens only: it needs
``O(n²)`` memory -- 22 GB at 40k tokens). Its ratio of seconds per 1k tokens against the
per-window clustering shows what the change buys.

Targets (issue 12): seconds per 1k tokens at 64k within 1.5x of that at 1k, for every pooler,
and peak RSS at 64k tokens <= 2 GB. A watchdog kills any case above 4 GB RSS.

The ``index`` suite runs the indexing job (``IndexJob``) over SciFact with ``mean`` +
``cluster:pool_factor=4`` and records after every commit (500 documents by default) the RSS, its
peak so far and what each collection holds in memory (token codes of committed segments, the
pending segment's buffers, the FAISS index): issue 12's target is a peak RSS flat within 20%
from 1k to 5k documents.

    flock /tmp/embedpool-bench.lock .venv/bin/python bench/scale.py           # ~5-10 min
    flock /tmp/embedpool-bench.lock .venv/bin/python bench/scale.py index     # ~5-20 min
    .venv/bin/python bench/scale.py case --pooler mean --tokens 4000         # one case, JSON

Writes ``bench/results/scale.json`` (``scale_index.json``) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the memory measurements the tests use too
from memory_testutil import WATCHDOG_BYTES, PeakRSS, measure_pool, watched  # noqa: E402
RESULTS = HERE / "results" / "scale.json"
SIZES = (1_000, 4_000, 16_000, 64_000)
POOLERS = ("mean", "landmark", "tokens:window=true", "cluster:pool_factor=4,window=true")
OLD = "old:cluster:pool_factor=4,window=true"  # whole-text clustering, the behaviour before
OLD_SIZES = (1_000, 4_000, 8_000)
TARGET_RATIO, TARGET_RSS_MB = 1.5, 2048


# ---------------------------------------------------------------------- measuring
def synthetic_document(n_tokens: int, tokenizer) -> str:
    """SciFact abstracts (``title + " " + text``, file order) joined with blank lines and cut
    where the tokenizer's ``n_tokens``-th token ends: a realistic long document."""
    from scifact_data import load_scifact

    texts, parts, chars = load_scifact().all_doc_texts, [], 0
    for t in texts:
        parts.append(t)
        chars += len(t)
        if chars > n_tokens * 8:  # SciFact has ~4-5 characters per token
            break
    text = "\n\n".join(parts)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    if len(enc["input_ids"]) < n_tokens:
        raise ValueError(f"SciFact is too short for a {n_tokens}-token document")
    return text[: enc["offset_mapping"][n_tokens - 1][1]]


def run_case(pooler: str, n_tokens: int, modes: tuple[str, ...] = ("embed",), threads: int = 0) -> list[dict]:
    """Cases of one (pooler, size) in this process, one dict per mode: ``embed`` (the pipeline,
    forward included), ``pool`` (the pooler alone, on all the text's windows in one batch of
    token states) or ``old`` (the old whole-text clustering: every token in one Ward linkage)."""
    import torch

    from embedpool.poolers import Embedder, FrozenEncoder

    if threads:
        torch.set_num_threads(threads)
    encoder = FrozenEncoder()
    embedder = Embedder(encoder)
    doc = synthetic_document(n_tokens, encoder.tokenizer)
    spec = pooler.removeprefix("old:")
    embedder.embed([doc[:1000]], [spec])  # warm-up: kernels, thread pools
    work = embedder.measure([doc], [spec])
    results = []
    for mode in modes:
        out = {"pooler": pooler, "mode": mode, "tokens": n_tokens, "encoded_tokens": sum(work.tokens),
               "expected_vectors": work.vectors, "torch_threads": torch.get_num_threads()}
        calls = encoder.stats.forward_calls
        out.update(measure_pool(embedder, doc, spec) if mode == "pool" else _measure_embed(embedder, doc, spec, mode))
        import resource

        out.update(peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                   forward_calls=encoder.stats.forward_calls - calls, max_batch_tokens=encoder.max_batch_tokens)
        results.append(out)
    return results


def _measure_embed(embedder, doc: str, spec: str, mode: str, min_seconds: float = 2.0, max_reps: int = 5) -> dict:
    """Time ``embed`` (``old``: tokens, then all of them clustered at once) until ``min_seconds``
    have passed or ``max_reps`` runs; the fastest run (the least disturbed on a shared machine)."""
    import torch

    from embedpool.poolers.cluster import cluster_tokens

    p = embedder.pooler(spec)

    def once():
        if mode == "embed":
            return embedder.embed([doc], [spec]).vectors[spec][0]
        tokens = embedder.embed([doc], ["tokens:window=true"]).vectors["tokens:window=true"][0]
        return cluster_tokens(torch.from_numpy(tokens), p.pool_factor, p.protected).numpy()

    times = []
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        vecs = once()
        times.append(time.perf_counter() - t0)
    while sum(times) < min_seconds and len(times) < max_reps:
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    n_tokens = len(embedder.encoder.tokenizer(doc, add_special_tokens=False, verbose=False)["input_ids"])
    return {"seconds": min(times), "seconds_median": statistics.median(times), "reps": len(times),
            "s_per_1k_tokens": min(times) / (n_tokens / 1000), "vectors": int(vecs.shape[0]) if vecs.ndim == 2 else 1,
            **peak.report()}


def run_in_subprocess(pooler: str, n_tokens: int, modes: tuple[str, ...] = ("embed",), threads: int = 0,
                      env: dict | None = None, limit_bytes: int = WATCHDOG_BYTES, timeout: float = 900) -> list[dict]:
    """:func:`run_case` in a fresh interpreter, killed if its RSS passes ``limit_bytes``."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "case", "--pooler", pooler,
           "--tokens", str(n_tokens), "--threads", str(threads), "--mode", *modes]
    out, killed = watched(cmd, env, limit_bytes, timeout)
    if killed:
        return [{"pooler": pooler, "mode": m, "tokens": n_tokens, "killed": killed} for m in modes]
    return out


# ---------------------------------------------------------------------- the indexing job
INDEX_POOLERS = ("mean", "cluster:pool_factor=4")
INDEX_CHECKPOINTS = (1_000, 2_500, 5_000)


def _store_bytes(coll) -> dict:
    """What a collection holds in memory (bench code: it reads the stores' private fields).
    Multi-vector: token codes of committed segments not memory-mapped from disk, and the
    pending segment's growable buffers (capacity); single-vector: the FAISS index."""
    import numpy as np

    store = coll._vec
    if hasattr(store, "segments"):
        in_ram = sum(seg.codes.nbytes for seg in store.segments
                     if seg.committed and not isinstance(seg.codes, np.memmap))
        mapped = sum(seg.codes.nbytes for seg in store.segments if isinstance(seg.codes, np.memmap))
        pend = store.pending
        buffers = 0 if pend is None or pend._g_codes is None else pend._g_codes._buf.nbytes
        token_index = 0 if store.token_index is None else store.token_index.ntotal * coll.spec.dim * 4
        return {"segments": len(store.segments), "codes_in_ram_mb": round(in_ram / 2**20, 1),
                "codes_mmapped_mb": round(mapped / 2**20, 1), "pending_buffer_mb": round(buffers / 2**20, 1),
                "token_index_mb_at_least": round(token_index / 2**20, 1), "vectors": int(store.total_vectors())}
    return {"faiss_index_mb": round(store.index.ntotal * coll.spec.dim * 4 / 2**20, 1),
            "vectors": int(store.index.ntotal)}


def _hold_committed_segments() -> None:
    """The other side: committed segments keep their token codes in memory (as before issue
    12), instead of reading them from the file their commit wrote."""
    from embedpool.index.faiss import multi

    def freeze(self) -> None:
        self.written_to = None
        original(self)

    original = multi.Segment.freeze
    multi.Segment.freeze = freeze


def run_index_case(n_docs: int, commit_every: int, precision: str, threads: int, hold: bool = False) -> dict:
    """``IndexJob`` over the first ``n_docs`` SciFact documents with ``mean`` +
    ``cluster:pool_factor=4`` (companion ``mean``), in this process; after every commit: the
    RSS, its peak so far, and what each collection holds in memory. ``hold``: the old
    behaviour (committed token codes stay in memory)."""
    import tempfile

    import torch
    from scifact_data import load_scifact

    if hold:
        _hold_committed_segments()

    from embedpool.app.datasets import Record
    from embedpool.app.indexing import IndexJob

    if os.environ.get("EMBEDPOOL_BENCH_MALLOC", "trim") != "trim":  # "none": without the job's malloc_trim
        import embedpool.app.indexing as indexing

        indexing.release_free_memory = lambda: False
    from embedpool.poolers import Embedder, FrozenEncoder

    if threads:
        torch.set_num_threads(threads)
    data = load_scifact(n_docs)
    records = [Record(i, t) for i, t in zip(data.doc_ids, data.doc_texts)]
    # the encoder path as the server would pick it (EMBEDPOOL_PRECISION, default auto)
    embedder = Embedder(FrozenEncoder(precision=os.environ.get("EMBEDPOOL_PRECISION", "auto")))
    embedder.embed(["warm up"], list(INDEX_POOLERS))
    probe = PeakRSS()
    base_mb = probe.kb("VmRSS") / 1024
    commits = []
    with tempfile.TemporaryDirectory() as tmp:
        job = IndexJob(embedder, tmp, "scifact", list(INDEX_POOLERS), companion_pooler="mean",
                       commit_every=commit_every, storage_precision=precision, progress=False, log=lambda m: None)
        commit_all = job._commit_all

        def recorded() -> None:
            commit_all()
            commits.append({"documents": job.records_indexed, "rss_mb": round(probe.kb("VmRSS") / 1024, 1),
                            "peak_rss_mb": round(probe.kb("VmHWM") / 1024, 1),
                            # anonymous (heap) vs file-backed (mapped files) resident memory
                            "rss_anon_mb": round(probe.kb("RssAnon") / 1024, 1),
                            "rss_file_mb": round(probe.kb("RssFile") / 1024, 1),
                            "stores": {t.spec: _store_bytes(t.coll) for t in job.targets.values()}})

        job._commit_all = recorded
        t0 = time.perf_counter()
        with job:
            job.run(records, total=len(records))
        seconds = time.perf_counter() - t0
    return {"side": "old: committed segments held in memory" if hold else "new", "documents": len(records),
            "commit_every": commit_every, "storage_precision": precision,
            "seconds": round(seconds, 1), "rss_after_model_mb": round(base_mb, 1), "commits": commits,
            "peak_rss_mb": round(probe.kb("VmHWM") / 1024, 1)}


def index_table(res: dict) -> str:
    rows = {c["documents"]: c for c in res["commits"]}
    lines = ["| documents | RSS (MB) | anon / file-backed RSS (MB) | peak RSS so far (MB) | cluster token codes in RAM (MB) | "
             "cluster pending buffer (MB) | mean FAISS index (MB) |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for n in sorted(rows):
        c = rows[n]
        multi = next(v for v in c["stores"].values() if "codes_in_ram_mb" in v)
        single = next(v for v in c["stores"].values() if "faiss_index_mb" in v)
        docs = f"**{n:,}**" if n in INDEX_CHECKPOINTS else f"{n:,}"
        split = f"{c['rss_anon_mb']:,.0f} / {c['rss_file_mb']:,.0f}" if "rss_anon_mb" in c else ""
        lines.append(f"| {docs} | {c['rss_mb']:,.0f} | {split} | {c['peak_rss_mb']:,.0f} | "
                     f"{multi['codes_in_ram_mb']:,.1f} | {multi['pending_buffer_mb']:,.1f} | {single['faiss_index_mb']:,.1f} |")
    peaks = [rows[n]["peak_rss_mb"] for n in INDEX_CHECKPOINTS if n in rows]
    if len(peaks) >= 2:
        growth = peaks[-1] / peaks[0]
        lines.append("")
        lines.append(f"peak RSS at {INDEX_CHECKPOINTS[-1]:,} ÷ at {INDEX_CHECKPOINTS[0]:,} documents: {growth:.2f} "
                     f"(target ≤ 1.20: {'met' if growth <= 1.2 else '**missed**'})")
    return "\n".join(lines)


# ---------------------------------------------------------------------- report
def machine() -> dict:
    import torch

    flags = set()
    model = platform.processor()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    keep = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "sse4")) or f == "f16c")
    return {"cpu": model, "cpus": os.cpu_count(), "cpu_flags": keep,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "loadavg_start": os.getloadavg()}


def summarize(cases: list[dict]) -> dict:
    """Per pooler: seconds per 1k tokens at the largest vs the smallest size, peak RSS at the
    largest size, and whether each meets its target."""
    out = {}
    for pooler in dict.fromkeys(c["pooler"] for c in cases):
        mine = sorted((c for c in cases if c["pooler"] == pooler and "killed" not in c), key=lambda c: c["tokens"])
        if not mine:
            out[pooler] = {"killed": True}
            continue
        lo, hi = mine[0], mine[-1]
        ratio = hi["s_per_1k_tokens"] / lo["s_per_1k_tokens"]
        row = {"from_tokens": lo["tokens"], "to_tokens": hi["tokens"], "s_per_1k_ratio": round(ratio, 2),
               "peak_rss_mb_at_max": hi["peak_rss_mb"]}
        if not pooler.startswith("old:"):
            row["ratio_met"] = ratio <= TARGET_RATIO
            row["rss_met"] = hi["peak_rss_mb"] <= TARGET_RSS_MB and hi["tokens"] == max(SIZES)
        out[pooler] = row
    return out


def table(cases: list[dict], summary: dict) -> str:
    lines = ["| pooler | tokens | s / 1k tokens | peak RSS (MB) | embed step RSS growth (MB) | vectors |",
             "|---|---:|---:|---:|---:|---:|"]
    for c in cases:
        if "killed" in c:
            lines.append(f"| `{c['pooler']}` | {c['tokens']:,} | killed ({c['killed']}) | | | |")
            continue
        lines.append(f"| `{c['pooler']}` | {c['tokens']:,} | {c['s_per_1k_tokens']:.3f} | {c['peak_rss_mb']:,.0f} "
                     f"| {c['step_rss_growth_mb']:,.0f} | {c['vectors']:,} |")
    lines += ["", "| pooler | s/1k at max ÷ s/1k at 1k (target ≤ 1.5) | peak RSS at 64k (target ≤ 2,048 MB) |",
              "|---|---:|---:|"]
    for pooler, s in summary.items():
        if s.get("killed"):
            lines.append(f"| `{pooler}` | killed | killed |")
            continue
        span = f"{s['from_tokens'] // 1000}k→{s['to_tokens'] // 1000}k"
        met = (lambda ok: " met" if ok else " **missed**") if "ratio_met" in s else (lambda ok: "")
        lines.append(f"| `{pooler}` | {s['s_per_1k_ratio']:.2f} ({span}){met(s.get('ratio_met'))} "
                     f"| {s['peak_rss_mb_at_max']:,.0f} MB at {s['to_tokens'] // 1000}k{met(s.get('rss_met'))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    one = sub.add_parser("case", help="run one case in this process and print its JSON")
    one.add_argument("--pooler", required=True)
    one.add_argument("--tokens", type=int, required=True)
    one.add_argument("--mode", choices=["embed", "pool", "old"], nargs="+", default=["embed"])
    for p in (ap, one):
        p.add_argument("--threads", type=int, default=1,
                       help="torch threads (default 1: on a small shared machine more threads spin "
                            "against other processes and timings scatter; 0 = torch's default)")
    ix = sub.add_parser("index", help="the indexing job over SciFact: RSS and in-memory stores per commit")
    ix.add_argument("--docs", type=int, default=INDEX_CHECKPOINTS[-1])
    ix.add_argument("--commit-every", type=int, default=500)
    ix.add_argument("--storage-precision", choices=["float32", "float16", "int8"], default="float32")
    ix.add_argument("--threads", type=int, default=1)
    ix.add_argument("--out", type=Path, default=HERE / "results" / "scale_index.json")
    ix.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    ix.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--poolers", nargs="+", default=list(POOLERS))
    ap.add_argument("--old-sizes", type=int, nargs="*", default=list(OLD_SIZES),
                    help="sizes for the old whole-text clustering (keep them small: O(n²) memory)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.cmd == "case":
        modes = ("old",) if args.pooler.startswith("old:") else tuple(args.mode)
        print(json.dumps(run_case(args.pooler, args.tokens, modes, args.threads)))
        return 0
    if args.cmd == "index":
        return index_main(args)
    info = machine()
    print(json.dumps(info), flush=True)
    cases = []
    plan = [(p, n, "embed") for p in args.poolers for n in args.sizes] + [(OLD, n, "old") for n in args.old_sizes]
    for pooler, n, mode in plan:
        c, = run_in_subprocess(pooler, n, (mode,), args.threads)
        cases.append(c)
        print(json.dumps(c), flush=True)
    summary = summarize(cases)
    info["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": info, "cases": cases, "summary": summary}, indent=2) + "\n")
    print(table(cases, summary))
    print(f"\nload average: start {info['loadavg_start']}, end {info['loadavg_end']}")
    return 0


def index_main(args) -> int:
    """The indexing-job suite: both sides (committed segments read from their files, and held
    in memory as before), each in a subprocess with the RSS watchdog."""
    if args.in_process:
        print(json.dumps(run_index_case(args.docs, args.commit_every, args.storage_precision,
                                        args.threads, args.hold)))
        return 0
    info = machine()
    print(json.dumps(info), flush=True)
    sides = []
    for hold in (False, True):
        cmd = [sys.executable, str(Path(__file__).resolve()), "index", "--in-process", "--docs", str(args.docs),
               "--commit-every", str(args.commit_every), "--storage-precision", args.storage_precision,
               "--threads", str(args.threads)] + (["--hold"] if hold else [])
        res, killed = watched(cmd, timeout=4 * 3600)
        sides.append(res or {"side": "old" if hold else "new", "killed": killed})
        print(json.dumps(sides[-1])[:2000], flush=True)
    info["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": info, "sides": sides}, indent=2) + "\n")
    for res in sides:
        if "killed" in res:
            print(f"\n{res['side']}: killed ({res['killed']})")
            continue
        print(f"\n{res['side']}: {res['documents']:,} documents in {res['seconds']:,.0f} s; RSS after "
              f"loading the model {res['rss_after_model_mb']:,.0f} MB")
        print(index_table(res))
    print(f"\nload average: start {info['loadavg_start']}, end {info['loadavg_end']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
