"""Exhaustive MaxSim over >= 1 GB of int8 token codes: ms per query, side by side, in one run.

    flock /tmp/embedpool-bench.lock .venv/bin/python bench/maxsim.py

builds 2.6M token vectors of dimension 384 (1.0 GB of int8 codes; random unit vectors around a
common direction, as MiniLM token states are, in documents of 30-256 tokens), and reports ms
per query of a 32-token query (and of 8 such queries batched in one call) for:

- a plain read of the same bytes (``codes.view(np.uint64).max()``): the memory bound;
- today's kernel: a copy of the algorithm ``index/maxsim.py`` had before the kernels
  (:func:`before_maxsim`: each chunk converted to float32, numpy/OpenBLAS sgemm);
- the new ``maxsim_scores`` (``kernel="auto"``: the kernel ``index/kernels.py`` chooses for this
  CPU), and every kernel of ``index/kernels.py`` by name;
- library candidates reached only from here, run through the same chunk loop
  (``maxsim_scores(kernel=<callable>)``): oneDNN int8 through torch (``qlinear_pointwise``; 7-bit
  query codes on CPUs without VNNI, where its ``vpmaddubsw`` saturates), OpenVINO (a compiled
  Convert + MatMul; bf16 inference where the CPU has bf16 units), and FAISS' scalar-quantizer
  scan (``QT_8bit_direct_signed``, ``search(k=1)``: it cannot return per-document maxima, so it
  is only the cost of its scan).

Then exact top-10 MaxSim (issue 34), the path ``exhaustive`` search takes: today's (the auto
kernel on every document, then the top 10) against :func:`index.int8scan.maxsim_topk` (an int8
scan through oneDNN's int8 matmul with a proven error bound, then exact scores for the documents
it cannot rule out; fused on AMX tiles or AVX-512 VNNI where the CPU has them: :mod:`index.amxscan`;
a fused scan the CPU does not choose -- VNNI on an AMX CPU -- is also timed, forced: what a CPU
without AMX runs), with the
scan alone per engine and number of query codes, for a random query (every document near-tied:
the scan's worst case) and a
query made of noisy copies of one stored document's tokens (a query with an answer), with the
number of documents scored exactly; the target is exact top-k in <= 3x the plain read.

The same for float16 codes (2.0 GB). On real MiniLM token vectors of SciFact abstracts it also
reports each kernel's score error against float64 MaxSim on the stored values, and how many of
the top 10 documents stay those of float32 MaxSim on the unquantized vectors.

Prints the CPU flags it ran on, torch's capability and the load average, a markdown table with
the ratios and the two targets (new kernel <= 2x the plain read; >= 5x faster than today's)
marked met or missed, and writes ``bench/results/maxsim.json``.

``--scan-vs-read UNIT...`` (e.g. ``avx2 vnni``) is a short run of the fused scans alone against
the plain read, for a loaded machine (issue 52: the AVX2 scan, target exact top-10 <= 3x the plain
read). Per round, interleaved: the plain read, each unit's scan alone (its first query codes),
its exact top-10 of each query (the unit's scan forced, the exact step on the kernel a CPU of
that kind runs: ``mlas-f32`` for ``avx2``) and today's top-10 on such a CPU (``mlas-f32`` on every
document), then the read again; each time is divided by the mean of the two reads around it, and
the medians of those ratios are reported, with the load average per round, on synthetic codes
(``--tokens``) or on real SciFact MiniLM codes (``--real-docs``):

    .venv/bin/python bench/maxsim.py --scan-vs-read avx2 vnni --tokens 1000000 --rounds 5 \
        --out bench/results/maxsim_avx2_scan.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from embedpool.cpu import cpu_features
from embedpool.index import amxscan, int8scan, kernels
from embedpool.index.maxsim import dequantize, maxsim_scores, quantize
from scale import machine

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "maxsim.json"
TARGET_READ_RATIO, TARGET_SPEEDUP = 2.0, 5.0
TARGET_TOPK_READ_RATIO = 3.0  # issue 34: exact top-k MaxSim <= 3x the plain read
TOPK = 10
UNIT_LABEL = {"amx": "AMX tiles", "vnni": "AVX-512 VNNI", "avx2": "AVX2"}
AMX_FLAGS = frozenset({"amx_tile", "amx_int8", "amx_bf16"})


def flags_of_kind(unit: str, flags: frozenset[str]) -> frozenset[str]:
    """This CPU's flags as a CPU whose best fused scan is ``unit`` would have them (no AMX for
    ``vnni``; no AMX nor AVX-512 for ``avx2``): the exact kernel such a CPU runs is chosen on them."""
    if unit == "amx":
        return flags
    drop = AMX_FLAGS if unit == "vnni" else AMX_FLAGS | {f for f in flags if f.startswith("avx512")}
    return frozenset(flags) - drop


KIND = {"amx": "", "vnni": " (a CPU without AMX)", "avx2": " (an AVX2 CPU without AVX-512)"}


# ---------------------------------------------------------------------------- before: today's kernel
def before_maxsim(queries, vectors, offsets, scales=None, chunk_bytes=1024 * 1024) -> np.ndarray:
    """``index.maxsim.maxsim_scores`` as it was before the kernels (full scans): each chunk's
    codes converted to float32 (``astype``), scaled, one numpy (OpenBLAS) sgemm, reductions."""
    lens = np.array([len(q) for q in queries], dtype=np.int64)
    q_starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    q_all = np.ascontiguousarray(np.concatenate([np.asarray(q, np.float32) for q in queries]))
    n_docs = len(offsets) - 1
    out = np.empty((len(queries), n_docs), dtype=np.float32)
    m, dim = q_all.shape
    max_tokens = max(1, chunk_bytes // (4 * (m + dim)))
    a = 0
    while a < n_docs:
        b = min(max(int(np.searchsorted(offsets, offsets[a] + max_tokens, side="right")) - 1, a + 1), n_docs)
        t0, t1 = int(offsets[a]), int(offsets[b])
        block = vectors[t0:t1].astype(np.float32)
        sc = None if scales is None else scales[t0:t1]
        if sc is not None and m >= dim:
            block = block * sc[:, None]
        sim = q_all @ block.T
        if sc is not None and m < dim:
            sim *= sc[None, :]
        doc_max = np.maximum.reduceat(sim, offsets[a:b] - t0, axis=1)
        out[:, a:b] = np.add.reduceat(doc_max, q_starts, axis=0)
        a = b
    return out


# ---------------------------------------------------------------------------- library candidates
def onednn_int8(flags: frozenset[str]):
    """oneDNN int8 through torch: the codes as uint8 activations (XOR 0x80, zero point 128), the
    query as prepacked int8 weights, float32 output; 7-bit query codes where there is no VNNI."""
    import torch

    torch.backends.quantized.engine = "onednn"
    bits = 8 if kernels.int8_units(flags) else 7
    lim = 2 ** (bits - 1) - 1

    def prepare(q: np.ndarray, dtype) -> kernels.Prepared:
        m, dim = q.shape
        amax = np.abs(q).max(axis=1)
        s = np.where(amax > 0, amax / lim, 1.0).astype(np.float32)
        packed = torch.ops.onednn.qlinear_prepack(torch.from_numpy(np.rint(q / s[:, None]).astype(np.int8)), None)
        ones, zps = torch.ones(m), torch.zeros(m, dtype=torch.int64)

        def score(block, sc):
            u = kernels.scratch("u8", block.shape, np.uint8)
            np.bitwise_xor(block.view(np.uint8), np.uint8(0x80), out=u)
            y = torch.ops.onednn.qlinear_pointwise(torch.from_numpy(u), 1.0, 128, packed, ones, zps, None,
                                                   1.0, 0, torch.float32, "none", [], "").numpy()
            if sc is not None:
                y *= sc[:, None]
            return y

        return kernels.Prepared(f"onednn-int8 (torch, {bits}-bit query)", score, 0, s, dim + 8 * m, kernels.workers())

    return prepare, bits


def openvino_matmul(flags: frozenset[str]):
    """OpenVINO: a compiled Convert(codes -> f32) + MatMul, one inference thread per worker."""
    import openvino as ov
    import openvino.opset13 as ops
    import threading

    hint = "bf16" if {"avx512_bf16", "amx_bf16"} & flags else "f32"
    compiled, local = {}, threading.local()

    def prepare(q: np.ndarray, dtype) -> kernels.Prepared:
        m, dim = q.shape
        key = np.dtype(dtype).name
        if key not in compiled:
            a = ops.parameter([-1, dim], ov.Type(np.dtype(dtype)), name="A")
            b = ops.parameter([-1, dim], ov.Type.f32, name="B")
            model = ov.Model([ops.matmul(ops.convert(a, ov.Type.f32), b, False, True)], [a, b])
            compiled[key] = ov.Core().compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": 1,
                                                                   "INFERENCE_PRECISION_HINT": hint})

        def score(block, sc):
            req = getattr(local, key, None)
            if req is None:
                req = compiled[key].create_infer_request()
                setattr(local, key, req)
            y = req.infer({0: block, 1: q}, share_inputs=True)[0].copy()
            if sc is not None:
                y *= sc[:, None]
            return y

        return kernels.Prepared(f"openvino matmul ({hint})", score, 0, None, 4 * (dim + m), kernels.workers())

    return prepare, hint


def compute_floor(q: np.ndarray, n_tokens: int, dim: int, reps: int) -> float:
    """ms of the multiply-adds alone: MLAS sgemm (``mlas-f32`` on float32 codes: no cast, no
    scales) on one cache-resident 2048-token chunk, repeated to cover ``n_tokens``, on the
    workers -- no memory traffic, no reductions: what any exact float32 or AVX2-int8 kernel needs."""
    chunk = np.random.default_rng(1).standard_normal((2048, dim), dtype=np.float32)
    prep = kernels.prepare("mlas-f32", q, np.float32)
    items = list(range(n_tokens // len(chunk)))
    return timed(lambda: kernels.run_parallel(lambda _: prep.score(chunk, None), items, prep.n_workers), reps)


def faiss_scan(codes: np.ndarray, q: np.ndarray, reps: int) -> float:
    """ms of FAISS' int8 scalar-quantizer scan of all codes for the query tokens (top-1 only)."""
    import faiss

    index = faiss.IndexScalarQuantizer(codes.shape[1], faiss.ScalarQuantizer.QT_8bit_direct_signed,
                                       faiss.METRIC_INNER_PRODUCT)
    index.train(codes[:1000].astype(np.float32))
    for i in range(0, len(codes), 262_144):
        index.add(codes[i:i + 262_144].astype(np.float32))
    faiss.omp_set_num_threads(kernels.workers())
    return timed(lambda: index.search(q, 1), reps)


# ---------------------------------------------------------------------------- exact top k
def answer_query(codes, scales, offs, rng, m: int) -> np.ndarray:
    """A query with an answer: ``m`` tokens of one stored document (the one in the middle),
    each moved by noise of norm ~0.3 and normalized."""
    j = (len(offs) - 1) // 2
    doc = dequantize(codes[offs[j]:offs[j + 1]], scales[offs[j]:offs[j + 1]])
    x = doc[rng.integers(0, len(doc), m)]
    x = x + 0.3 * rng.standard_normal(x.shape).astype(np.float32) / np.sqrt(x.shape[1])
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def topk_on_real(docs: list[np.ndarray], queries: list[np.ndarray], forced: str) -> dict:
    """maxsim_topk with the int8 scan ``forced`` (``int8``, or fused: ``amx``, ``vnni``), on real
    int8 MiniLM token vectors and real queries: whether its top 10 equals exact MaxSim's, and how
    many documents it scored exactly."""
    offs = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    codes, scales = quantize(np.concatenate(docs), "int8")
    exact = maxsim_scores(queries, codes, offs, scales)
    same, first, rescored = 0, [], []
    for q, row_ in zip(queries, exact):
        st: dict = {}
        (s, p), = int8scan.maxsim_topk([q], codes, offs, scales, TOPK, scan=forced, stats=st)
        o = np.argsort(-row_, kind="stable")[:TOPK]
        same += bool(np.array_equal(p, o) and np.allclose(s, row_[o], rtol=1e-6, atol=1e-6))
        first.append(st["second_scan"][0])
        rescored.append(st["rescored"][0])
    out = {"scan": forced, "documents": len(docs), "queries": len(queries), "same_top10": same,
           "first_scan_survivors_median": float(np.median(first)), "rescored_median": float(np.median(rescored)),
           "rescored_max": int(max(rescored))}
    print(f"real SciFact tokens ({len(docs)} abstracts, {len(queries)} queries), {forced} scan forced: top-{TOPK} equal "
          f"to exact MaxSim for {same}/{len(queries)}; documents scored exactly: median {out['rescored_median']:.0f}, "
          f"max {out['rescored_max']}", flush=True)
    return out


def topk_rows(row, codes, scales, offs, random_q: np.ndarray, answer_q: np.ndarray, reps: int,
              sweep: bool = False) -> None:
    """Exact top-10: today's (auto kernel on every document + top 10) against maxsim_topk's int8
    scan, on both queries; checks the two return the same documents and scores."""
    t = time.perf_counter()
    norms = int8scan.doc_norms(codes, offs, scales)
    norms_s = time.perf_counter() - t
    flags = cpu_features().flags
    units = amxscan.runnable_units(flags)
    scan = kernels.resolve_scan("auto", "int8")
    why = kernels.choose_scan("int8", flags, int8scan.int8_matmul_is_exact(), "amx" in units, "vnni" in units,
                              "avx2" in units)[1]
    print(f"scan for int8 top-k: {scan} -- {why}; document norms (once per segment) in {norms_s:.2f} s; "
          f"fused scans built: {amxscan.built()}, usable here: {', '.join(units) or 'none'}", flush=True)
    for label, q in (("random query", random_q), ("query with an answer", answer_q)):
        if label == "random query":
            if int8scan.int8_matmul_is_exact():
                row("int8 scan alone, library (oneDNN products, numpy maxima), 1 query code", "int8", "scan",
                    timed(lambda: int8scan.bound_scan([q], codes, offs, scales, norms), reps), query=label,
                    engine="torch", n_codes=1)
            for unit in units:
                for n in (1, 2, 3):
                    row(f"int8 scan alone, fused on {UNIT_LABEL[unit]}, {n} query code{'s' * (n > 1)}", "int8",
                        "scan", timed(lambda: int8scan.bound_scan([q], codes, offs, scales, norms, n_codes=n,
                                                                  engine=unit), reps),
                        query=label, engine=unit, n_codes=n)
        today = timed(lambda: int8scan.maxsim_topk([q], codes, offs, scales, TOPK, scan="exact"), reps)
        (ts, tp), = int8scan.maxsim_topk([q], codes, offs, scales, TOPK, scan="exact")
        row(f"exact top-{TOPK}, today (auto kernel, every document), {label}", "int8", "topk-today", today)
        stats: dict = {}
        new = timed(lambda: int8scan.maxsim_topk([q], codes, offs, scales, TOPK, norms=norms, scan="auto",
                                                 stats=stats), reps)
        (ns, np_), = int8scan.maxsim_topk([q], codes, offs, scales, TOPK, norms=norms, scan="auto")
        same = bool(np.array_equal(tp, np_) and np.allclose(ts, ns, rtol=1e-6, atol=1e-6))
        row(f"exact top-{TOPK}, new (maxsim_topk: {stats['scan']} scan + exact), {label}", "int8", "topk-new", new,
            scan=stats["scan"], first_scan_survivors=stats.get("second_scan", [None])[0],
            rescored_exactly=stats["rescored"][0], documents=int(len(offs) - 1), same_as_today=same,
            query=label, norms_s=round(norms_s, 3))
        print(f"    {label}: {stats.get('second_scan', ['-'])[0]} documents after the first scan, "
              f"{stats['rescored'][0]} scored exactly, of {len(offs) - 1:,}; same top-{TOPK} as today: {same}",
              flush=True)
        if not same:
            raise SystemExit(f"maxsim_topk differs from today's top-{TOPK} on the {label}")
        for unit in units:  # a fused scan this CPU does not choose: what a CPU without AMX runs
            if unit == scan:
                continue
            st = {}
            kern = kernels.choose("int8", flags_of_kind(unit, frozenset(flags)), cpu_features().capability,
                                  vnni_kernel=unit == "vnni")[0]
            ms = timed(lambda: int8scan.maxsim_topk([q], codes, offs, scales, TOPK, norms=norms, scan=unit,
                                                    kernel=kern, stats=st), reps)
            (fs, fp), = int8scan.maxsim_topk([q], codes, offs, scales, TOPK, norms=norms, scan=unit, kernel=kern)
            same = bool(np.array_equal(tp, fp) and np.allclose(ts, fs, rtol=1e-6, atol=1e-6))
            row(f"exact top-{TOPK}, {unit} scan + {kern} forced{KIND[unit]}, {label}", "int8",
                "topk-forced", ms, scan=unit, kernel=kern, query=label, first_scan_survivors=st["second_scan"][0],
                rescored_exactly=st["rescored"][0], documents=int(len(offs) - 1), same_as_today=same)
            if not same:
                raise SystemExit(f"the {unit} scan differs from today's top-{TOPK} on the {label}")
        if scan in units and int8scan.int8_matmul_is_exact():  # the path these CPUs took before the fused scans
            st = {}
            ms = timed(lambda: int8scan.maxsim_topk([q], codes, offs, scales, TOPK, norms=norms, scan="int8",
                                                    kernel="mlas-int8x3", stats=st), reps)
            row(f"exact top-{TOPK}, library int8 scan + mlas-int8x3 (before the fused scan), {label}", "int8",
                "topk-sweep", ms, query=label, first_scan_survivors=st["second_scan"][0],
                rescored_exactly=st["rescored"][0])
        for unit, pair in ((u, p) for u in units for p in ((1, 2), (1, 3), (2, 2), (2, 3), (3, 3))) if sweep else ():
            if pair == int8scan.SCAN_CODES[unit]:
                continue
            st: dict = {}
            ms = timed(lambda: int8scan.maxsim_topk([q], codes, offs, scales, TOPK, norms=norms, scan=unit,
                                                    codes=pair, stats=st), reps)
            row(f"exact top-{TOPK}, {unit} scan with {pair[0]} then {pair[1]} query codes, {label}", "int8",
                "topk-sweep", ms, query=label, scan=unit, codes=list(pair),
                first_scan_survivors=st["second_scan"][0], rescored_exactly=st["rescored"][0])


def runnable_kernels() -> list[str]:
    """The kernels of index/kernels.py that run on this machine (the fused ones need their unit
    and the compiled module)."""
    return [k for k in kernels.KERNELS
            if k not in kernels.FUSED_KERNELS or amxscan.available(unit=kernels.FUSED_KERNELS[k])]


# ---------------------------------------------------------------------------- data
def synthetic(n_tokens: int, dim: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(int8 codes, scales, offsets)`` of unit vectors around a common direction (cosine ~0.3
    to it, as MiniLM token states), documents of 30-256 tokens; quantized in slices."""
    lens = rng.integers(30, 257, size=n_tokens // 30 + 1)
    offsets = np.concatenate([[0], np.cumsum(lens)])
    offsets = offsets[offsets <= n_tokens].astype(np.int64)
    n = int(offsets[-1])
    mu = rng.standard_normal(dim).astype(np.float32)
    mu /= np.linalg.norm(mu)
    codes, scales = np.empty((n, dim), np.int8), np.empty(n, np.float32)
    for i in range(0, n, 131_072):
        x = rng.standard_normal((min(131_072, n - i), dim), dtype=np.float32) / np.sqrt(dim) + 0.32 * mu
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        codes[i:i + len(x)], scales[i:i + len(x)] = quantize(x, "int8")
    return codes, scales, offsets


def real_tokens(n_docs: int, n_queries: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """MiniLM token vectors of the first SciFact abstracts and test queries (bench/scifact_data.py
    cache; encoded on first use)."""
    import scifact_data as sd

    sf = sd.load_scifact(n_docs)
    cache = sd.EmbeddingCache()
    docs = sd.scifact_docs(sf, cache, ("tokens",))["tokens"]
    queries = sd.scifact_queries(sf, cache)["tokens"][:n_queries]
    return [np.asarray(d, np.float32) for d in docs], [np.asarray(q, np.float32) for q in queries]


# ---------------------------------------------------------------------------- measuring
def _jiffies() -> tuple[int, int]:
    """(busy jiffies of the whole machine, jiffies of this process)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    with open("/proc/self/stat") as f:
        own = f.read().rsplit(")", 1)[1].split()
    return sum(v) - v[3] - v[4], int(own[11]) + int(own[12])


QUIET_PCT = 15.0  # a repetition counts as uncontended if other processes used < 15% of a core
LOG: list[dict] = []  # per timed case: the repetitions kept and the others' CPU during them


def timed(fn, reps: int, max_tries: int | None = None) -> float:
    """Median ms of ``reps`` uncontended calls, after one warm-up call. Other people's processes
    share these CPUs: each call's wall time is kept with the CPU other processes used meanwhile,
    calls are repeated (up to ``max_tries``, default 4 * reps) until ``reps`` ran while others
    used < QUIET_PCT of a core; if too few did, the quietest ones are used and the case is
    marked contended (in LOG, the JSON and the table)."""
    fn()
    tick, runs = os.sysconf("SC_CLK_TCK"), []
    for _ in range(max_tries or 4 * reps):
        j0, t = _jiffies(), time.perf_counter()
        fn()
        el = time.perf_counter() - t
        j1 = _jiffies()
        others = max(0.0, ((j1[0] - j0[0]) - (j1[1] - j0[1])) / tick / el * 100)
        runs.append((others, el * 1e3))
        if sum(o < QUIET_PCT for o, _ in runs) >= reps:
            break
    quiet = [r for r in runs if r[0] < QUIET_PCT]
    kept = quiet[-reps:] if len(quiet) >= reps else sorted(runs)[:reps]
    LOG.append({"others_cpu_pct": round(max(o for o, _ in kept), 1), "contended": len(quiet) < reps,
                "tries": len(runs)})
    return statistics.median(ms for _, ms in kept)


def accuracy(docs: list[np.ndarray], queries: list[np.ndarray], cases: dict) -> dict:
    """Per case on real vectors: max |score - float64 MaxSim on the stored values| and the mean
    overlap of the top 10 with float32 MaxSim on the unquantized vectors."""
    offs = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    vecs = np.concatenate(docs)
    exact = maxsim_scores(queries, vecs, offs, kernel="numpy")
    top = [set(np.argsort(-s)[:10]) for s in exact]
    out = {}
    for name, (precision, fn) in cases.items():
        codes, scales = quantize(vecs, precision)
        stored = dequantize(codes, scales).astype(np.float64)
        ref = np.array([[(q.astype(np.float64) @ stored[offs[j]:offs[j + 1]].T).max(1).sum()
                         for j in range(len(docs))] for q in queries])
        got = fn(queries, codes, offs, scales)
        out[name] = {"precision": precision, "max_abs_err_vs_stored": float(np.abs(got - ref).max()),
                     "top10_overlap_vs_float32": float(np.mean([len(set(np.argsort(-g)[:10]) & t) / 10
                                                                for g, t in zip(got, top)]))}
    return out


def run(args) -> dict:
    rng = np.random.default_rng(0)
    info = machine()
    cpu = cpu_features()
    flags, capability = cpu.flags, cpu.capability
    info.update(workers=kernels.workers(), kernels_capability=capability)
    choice = {p: kernels.auto_choice(p) for p in ("int8", "float16")}
    print(f"CPU: {info['cpu']} x{info['cpus']}; flags {' '.join(info['cpu_flags'])}; torch {info['torch_cpu_capability']}; "
          f"load average at start {info['loadavg_start']}", flush=True)
    for p, (k, why) in choice.items():
        print(f"auto kernel for {p}: {k} -- {why}", flush=True)

    t = time.perf_counter()
    codes, scales, offs = synthetic(args.tokens, args.dim, rng)
    print(f"{len(codes):,} tokens in {len(offs) - 1:,} documents: {codes.nbytes / 1e9:.2f} GB int8 codes "
          f"(built in {time.perf_counter() - t:.0f} s)", flush=True)
    mu_q = rng.standard_normal((args.query_tokens * 8, args.dim)).astype(np.float32)
    qs = list((mu_q / np.linalg.norm(mu_q, axis=1, keepdims=True)).reshape(8, args.query_tokens, args.dim))
    one, eight = [qs[0]], qs

    rows = []

    def row(case: str, precision: str, kind: str, ms: float, n_queries: int = 1, **extra) -> None:
        rows.append({"case": case, "precision": precision, "kind": kind, "queries_per_call": n_queries,
                     "ms_per_query": round(ms / n_queries, 2), **LOG[-1], **extra})
        print(f"  {precision:8s} {case:44s} {ms / n_queries:9.1f} ms/query  (others' CPU {LOG[-1]['others_cpu_pct']:.0f}%"
              f"{', CONTENDED' if LOG[-1]['contended'] else ''})", flush=True)

    reps = args.reps
    for precision in ("int8",) if args.no_float16 else ("int8", "float16"):
        if precision == "float16":
            c, sc = np.empty(codes.shape, np.float16), None
            for i in range(0, len(codes), 262_144):
                c[i:i + 262_144] = dequantize(codes[i:i + 262_144], scales[i:i + 262_144])
        else:
            c, sc = codes, scales
        print(f"{precision}: {c.nbytes / 1e9:.2f} GB of codes", flush=True)
        row("plain read (view(uint64).max())", precision, "read", timed(lambda: c.view(np.uint64).max(), reps))
        if precision == "int8":
            row("compute floor: MLAS sgemm alone, in cache", precision, "floor",
                compute_floor(qs[0], len(c), args.dim, reps))
        row("today's kernel (astype f32 + numpy sgemm)", precision, "before",
            timed(lambda: before_maxsim(one, c, offs, sc), reps))
        auto = kernels.resolve("auto", precision)
        row(f"new: maxsim_scores auto ({auto})", precision, "new",
            timed(lambda: maxsim_scores(one, c, offs, sc), reps), kernel=auto)
        names = [k for k in runnable_kernels() if precision == "int8" or k not in kernels.INT8_KERNELS]
        for k in [] if args.no_kernels else names:
            if k != auto:
                row(f"kernel {k}", precision, "kernel", timed(lambda: maxsim_scores(one, c, offs, sc, kernel=k), reps),
                    kernel=k)
        if precision == "int8":
            topk_rows(row, c, sc, offs, qs[0], answer_query(c, sc, offs, rng, args.query_tokens), reps,
                      args.codes_sweep)
        if not args.no_candidates:
            import torch

            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # one oneDNN thread per chunk worker, as the MLAS kernels
            cands = [openvino_matmul(flags)] + ([onednn_int8(flags)] if precision == "int8" else [])
            for fn, what in cands:
                name = fn(qs[0], c.dtype).name
                row(f"candidate {name}", precision, "candidate",
                    timed(lambda: maxsim_scores(one, c, offs, sc, kernel=fn), reps))
            torch.set_num_threads(threads)
            if precision == "int8":
                row("candidate faiss SQ8 scan, top-1 only", precision, "candidate", faiss_scan(c, qs[0], reps))
        if precision == "int8" and not args.no_batch:
            row("today's kernel, 8 queries in one call", precision, "before",
                timed(lambda: before_maxsim(eight, c, offs, sc), max(1, reps - 1)), 8)
            row(f"new: auto ({auto}), 8 queries in one call", precision, "new",
                timed(lambda: maxsim_scores(eight, c, offs, sc), max(1, reps - 1)), 8, kernel=auto)
        del c

    acc, real_topk = {}, {}
    if args.real_docs:
        docs, queries = real_tokens(args.real_docs, 32)
        # every fused scan that runs here, else the library's
        real_topk = {u: topk_on_real(docs, queries, u)
                     for u in amxscan.runnable_units() or ["int8"]}
        cases = {"today's kernel": ("int8", before_maxsim)}
        for p in ("int8", "float16"):
            for k in runnable_kernels():
                if p == "int8" or k not in kernels.INT8_KERNELS:
                    cases[f"{k} {p}"] = (p, lambda qq, cc, oo, ss, k=k: maxsim_scores(qq, cc, oo, ss, kernel=k))
        acc = accuracy(docs, queries, cases)
        print(f"accuracy on {len(docs)} SciFact abstracts ({sum(map(len, docs)):,} tokens), {len(queries)} queries:")
        for name, a in acc.items():
            print(f"  {name:24s} max |err| {a['max_abs_err_vs_stored']:.2e}  top-10 overlap {a['top10_overlap_vs_float32']:.3f}")
    info["loadavg_end"] = os.getloadavg()
    return {"machine": info, "choice": {p: {"kernel": k, "reason": w} for p, (k, w) in choice.items()},
            "config": {"tokens": int(len(codes)), "dim": args.dim, "documents": int(len(offs) - 1),
                       "int8_bytes": int(codes.nbytes), "query_tokens": args.query_tokens, "reps": reps},
            "rows": rows, "accuracy": acc, "real_topk": real_topk, "targets": targets(rows)}


def scan_vs_read(args) -> dict:
    """``--scan-vs-read``: the fused scans of ``args.scan_vs_read`` against the plain read, each
    time as a ratio to the reads around it in the same round (module docstring)."""
    info = machine()
    cpu = cpu_features()
    flags = frozenset(cpu.flags)
    print(f"CPU: {info['cpu']} x{info['cpus']}; flags {' '.join(info['cpu_flags'])}; torch {info['torch_cpu_capability']}; "
          f"load average at start {info['loadavg_start']}", flush=True)
    missing = [u for u in args.scan_vs_read if not amxscan.available(unit=u)]
    if missing:
        raise SystemExit(f"not runnable here: {', '.join(missing)} (usable: {', '.join(amxscan.runnable_units())})")
    rng = np.random.default_rng(0)
    if args.real_docs:
        docs, queries = real_tokens(args.real_docs, args.queries)
        offs = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
        codes, scales = quantize(np.concatenate(docs), "int8")
        data = f"real SciFact MiniLM codes, {len(docs):,} abstracts, {len(queries)} test queries"
        del docs
    else:
        codes, scales, offs = synthetic(args.tokens, args.dim, rng)
        mu_q = rng.standard_normal((args.query_tokens, args.dim)).astype(np.float32)
        queries = [mu_q / np.linalg.norm(mu_q, axis=1, keepdims=True),
                   answer_query(codes, scales, offs, rng, args.query_tokens)]
        data = "synthetic near-tied codes: a random query and a query with an answer"
    norms = int8scan.doc_norms(codes, offs, scales)
    print(f"{data}: {len(codes):,} tokens in {len(offs) - 1:,} documents, {codes.nbytes / 1e9:.2f} GB int8", flush=True)
    ref = [int8scan.maxsim_topk([q], codes, offs, scales, TOPK, norms=norms, scan="exact")[0] for q in queries]
    kern = {u: kernels.choose("int8", flags_of_kind(u, flags), cpu.capability, amx_kernel=u == "amx",
                              vnni_kernel=u == "vnni")[0] for u in args.scan_vs_read}
    # today's exact top-10 on a CPU of the first unit's kind: its exact kernel on every document
    today_kernel = kern[args.scan_vs_read[0]]

    def clock(fn) -> float:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    def read() -> float:
        return clock(lambda: codes.view(np.uint64).max())

    cases: dict[str, dict] = {}

    def case(name: str, **meta) -> dict:
        return cases.setdefault(name, {"case": name, **meta, "ms": [], "over_read": []})

    stats: dict = {}
    for fn in (read, lambda: int8scan.maxsim_topk([queries[0]], codes, offs, scales, TOPK, norms=norms,
                                                  scan=args.scan_vs_read[0])):
        fn()  # warm-up: pages, threads, the exact kernel's session
    loads = []
    for rnd in range(args.rounds):
        before, timed_ = read(), []
        for unit in args.scan_vs_read:
            first = int8scan.SCAN_CODES[unit][0]
            timed_.append((case(f"{unit} scan alone, {first} query code{'s' * (first > 1)}", unit=unit, kind="scan"),
                           clock(lambda: int8scan.bound_scan([queries[0]], codes, offs, scales, norms, n_codes=first,
                                                             engine=unit))))
            for qi, q in enumerate(queries):
                ms = clock(lambda: int8scan.maxsim_topk([q], codes, offs, scales, TOPK, norms=norms, scan=unit,
                                                        kernel=kern[unit], stats=stats))
                (s, p), = int8scan.maxsim_topk([q], codes, offs, scales, TOPK, norms=norms, scan=unit, kernel=kern[unit])
                if not (np.array_equal(p, ref[qi][1]) and np.allclose(s, ref[qi][0], rtol=1e-6, atol=1e-6)):
                    raise SystemExit(f"the {unit} scan's top-{TOPK} differs from exact MaxSim's on query {qi}")
                c = case(f"exact top-{TOPK}, {unit} scan + {kern[unit]}{KIND[unit]}", unit=unit, kind="topk",
                         kernel=kern[unit])
                c.setdefault("rescored", []).append(stats["rescored"][0])
                timed_.append((c, ms))
        for q in queries[:args.today_queries]:
            timed_.append((case(f"exact top-{TOPK}, today on such a CPU ({today_kernel} on every document)",
                                kind="today", kernel=today_kernel),
                           clock(lambda: int8scan.maxsim_topk([q], codes, offs, scales, TOPK, scan="exact",
                                                              kernel=today_kernel))))
        after = read()
        r = (before + after) / 2
        case("plain read (view(uint64).max())", kind="read")["ms"].append(r)
        for c, ms in timed_:
            c["ms"].append(ms)
            c["over_read"].append(ms / r)
        loads.append(os.getloadavg())
        print(f"  round {rnd + 1}/{args.rounds}: read {r:.1f} ms; load {loads[-1][0]:.2f}; "
              + "; ".join(f"{c.get('unit', 'today')} {c['kind']} {ms / r:.2f}x" for c, ms in timed_), flush=True)
    rows = []
    for c in cases.values():
        row_ = {k: v for k, v in c.items() if k not in ("ms", "over_read", "rescored")}
        row_.update(ms_median=round(statistics.median(c["ms"]), 2), timings=len(c["ms"]))
        if c["over_read"]:
            row_.update(over_read_median=round(statistics.median(c["over_read"]), 2),
                        over_read_min=round(min(c["over_read"]), 2), over_read_max=round(max(c["over_read"]), 2))
        if "rescored" in c:
            row_.update(rescored_median=float(np.median(c["rescored"])), rescored_max=int(max(c["rescored"])))
        rows.append(row_)
    info["loadavg_end"] = os.getloadavg()
    info["loadavg_rounds"] = loads
    topk = {r_["unit"]: r_["over_read_median"] for r_ in rows if r_["kind"] == "topk"}
    return {"mode": "scan-vs-read", "machine": info, "all_cpu_flags": sorted(flags), "data": data,
            "config": {"tokens": int(len(codes)), "documents": int(len(offs) - 1), "int8_bytes": int(codes.nbytes),
                       "queries": len(queries), "rounds": args.rounds, "units": args.scan_vs_read,
                       "scan_codes": {u: list(int8scan.SCAN_CODES[u]) for u in args.scan_vs_read}},
            "rows": rows, "same_top10": True,
            "targets": {u: {"topk_over_read": v, "target": TARGET_TOPK_READ_RATIO, "met": v <= TARGET_TOPK_READ_RATIO}
                        for u, v in topk.items()}}


def scan_table(res: dict) -> str:
    lines = ["| case | ms (median) | ÷ plain read, same round (median) | min–max | scored exactly (median) |",
             "|---|---:|---:|---:|---:|"]
    for r in res["rows"]:
        ratio = "1.0" if r["kind"] == "read" else f"{r['over_read_median']:.2f}"
        spread = "" if r["kind"] == "read" else f"{r['over_read_min']:.2f}–{r['over_read_max']:.2f}"
        resc = f"{r['rescored_median']:,.0f} of {res['config']['documents']:,}" if "rescored_median" in r else ""
        lines.append(f"| {r['case']} | {r['ms_median']:,.1f} | {ratio} | {spread} | {resc} |")
    for u, t in res["targets"].items():
        lines += ["", f"exact top-{TOPK} through the {u} scan: {t['topk_over_read']:.2f}x the plain read "
                      f"(target ≤ {t['target']:.0f}: {'met' if t['met'] else '**missed**'})"]
    m, c = res["machine"], res["config"]
    lines += ["", f"{res['data']}; every top {TOPK} equal to exact MaxSim's (documents and scores)",
              f"{m['cpu']}, {m['cpus']} CPUs, flags {', '.join(m['cpu_flags'])}; torch {m['torch_cpu_capability']}; "
              f"load average {m['loadavg_start'][0]:.2f} at start, {m['loadavg_end'][0]:.2f} at end; "
              f"{c['tokens']:,} tokens ({c['int8_bytes'] / 1e9:.2f} GB int8), {c['rounds']} rounds"]
    return "\n".join(lines)


def targets(rows: list[dict]) -> dict:
    """The issues' targets, on int8 codes and one 32-token query."""
    read = next((r["ms_per_query"] for r in rows if r["kind"] == "read" and r["precision"] == "int8"), None)
    topk = {}
    for r in rows:
        if r["kind"] in ("topk-new", "topk-forced") and read:
            today = next(x["ms_per_query"] for x in rows if x["kind"] == "topk-today" and x["case"].endswith(r["query"]))
            ratio = r["ms_per_query"] / read
            label = r["query"] if r["kind"] == "topk-new" else f"{r['query']}, {r['scan']} scan forced{KIND[r['scan']]}"
            topk[label] = {"new_over_read": round(ratio, 2), "target": TARGET_TOPK_READ_RATIO,
                                "met": ratio <= TARGET_TOPK_READ_RATIO, "today_over_read": round(today / read, 2),
                                "speedup_vs_today": round(today / r["ms_per_query"], 2),
                                "rescored_exactly": r["rescored_exactly"], "documents": r["documents"]}
    get = {r["kind"]: r["ms_per_query"] for r in rows if r["precision"] == "int8" and r["queries_per_call"] == 1
           and r["kind"] in ("read", "before", "new", "floor")}
    if len(get) < 4:
        return {"topk": topk} if topk else {}
    ratio, speedup = get["new"] / get["read"], get["before"] / get["new"]
    return {"floor_over_read": round(get["floor"] / get["read"], 2),
            "best_possible_speedup": round(get["before"] / get["floor"], 2),"new_over_read": round(ratio, 2), "read_target": TARGET_READ_RATIO, "read_met": ratio <= TARGET_READ_RATIO,
            "speedup_vs_today": round(speedup, 2), "speedup_target": TARGET_SPEEDUP,
            "speedup_met": speedup >= TARGET_SPEEDUP, "topk": topk}


def table(res: dict) -> str:
    read = {r["precision"]: r["ms_per_query"] for r in res["rows"] if r["kind"] == "read"}
    before = {(r["precision"], r["queries_per_call"]): r["ms_per_query"] for r in res["rows"] if r["kind"] == "before"}
    lines = ["| codes | case | ms / query | ÷ plain read | today's ÷ this |", "|---|---|---:|---:|---:|"]
    for r in res["rows"]:
        b = before.get((r["precision"], r["queries_per_call"]))
        if r["kind"] in ("topk-new", "topk-today", "scan", "topk-sweep", "topk-forced"):  # against today's exact top-k of the same query
            b = next(x["ms_per_query"] for x in res["rows"] if x["kind"] == "topk-today"
                     and x["case"].endswith(r.get("query", "random query")))
        vs = "" if r["kind"] == "read" or b is None else f"{b / r['ms_per_query']:.2f}x"
        case = r["case"] + (f" (contended: others {r['others_cpu_pct']:.0f}%)" if r["contended"] else "")
        lines.append(f"| {r['precision']} | {case} | {r['ms_per_query']:,.1f} "
                     f"| {r['ms_per_query'] / read[r['precision']]:.1f} | {vs} |")
    t = res["targets"]
    for label, x in t.get("topk", {}).items():
        lines += ["", f"exact top-{TOPK}, {label}: new ÷ plain read {x['new_over_read']:.1f} (target ≤ "
                      f"{x['target']:.0f}: {'met' if x['met'] else '**missed**'}); today's ÷ plain read "
                      f"{x['today_over_read']:.1f}; {x['speedup_vs_today']:.2f}x today's; "
                      f"{x['rescored_exactly']:,} of {x['documents']:,} documents scored exactly"]
    if "new_over_read" in t:
        lines += ["", f"new kernel ÷ plain read: {t['new_over_read']:.1f} (target ≤ {t['read_target']:.0f}: "
                      f"{'met' if t['read_met'] else '**missed**'}); today's ÷ new: {t['speedup_vs_today']:.2f}x "
                      f"(target ≥ {t['speedup_target']:.0f}x: {'met' if t['speedup_met'] else '**missed**'}); "
                      f"float32 multiply-adds alone (MLAS sgemm) take {t['floor_over_read']:.1f}x the plain read, "
                      f"so no float32 kernel on this CPU can beat {t['best_possible_speedup']:.2f}x today's"
                      + (" (the int8 tiles are not bound by it)" if t["new_over_read"] < t["floor_over_read"] else "")]
    m = res["machine"]
    lines += ["", f"{m['cpu']}, {m['cpus']} CPUs, flags {', '.join(m['cpu_flags'])}; torch {m['torch_cpu_capability']}; "
                  f"load average {m['loadavg_start'][0]:.2f} at start, {m['loadavg_end'][0]:.2f} at end; "
                  f"{res['config']['tokens']:,} tokens x {res['config']['dim']} ({res['config']['int8_bytes'] / 1e9:.2f} GB int8), "
                  f"{res['config']['query_tokens']}-token queries, median of {res['config']['reps']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2_600_000, help="token vectors (2.6M x 384 = 1.0 GB int8)")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--query-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--real-docs", type=int, default=None,
                    help="SciFact abstracts for the accuracy check (0: none; default 256), or with --scan-vs-read "
                         "the corpus scanned instead of synthetic codes (default: none)")
    ap.add_argument("--no-candidates", action="store_true", help="skip the torch/OpenVINO/FAISS candidates")
    ap.add_argument("--no-batch", action="store_true", help="skip the 8-query batches")
    ap.add_argument("--no-float16", action="store_true", help="int8 codes only")
    ap.add_argument("--no-kernels", action="store_true",
                    help="skip the per-kernel rows (every kernel of index/kernels.py by name)")
    ap.add_argument("--codes-sweep", action="store_true",
                    help="exact top-10 with the AMX scan for other (first, second) query-code counts")
    ap.add_argument("--scan-vs-read", nargs="+", metavar="UNIT", choices=amxscan.UNITS,
                    help="only these fused scans against the plain read, interleaved per round (module docstring)")
    ap.add_argument("--rounds", type=int, default=5, help="--scan-vs-read: rounds")
    ap.add_argument("--queries", type=int, default=10, help="--scan-vs-read with --real-docs: SciFact test queries")
    ap.add_argument("--today-queries", type=int, default=1,
                    help="--scan-vs-read: queries per round also timed on today's path (the exact kernel on every document)")
    ap.add_argument("--out", type=Path, default=None, help="the JSON (default bench/results/maxsim.json, "
                    "maxsim_scan_vs_read.json with --scan-vs-read)")
    args = ap.parse_args(argv)
    if args.real_docs is None:
        args.real_docs = 0 if args.scan_vs_read else 256
    if args.scan_vs_read:
        return finish(scan_vs_read(args), args.out or RESULTS.with_name("maxsim_scan_vs_read.json"), scan_table)
    return finish(run(args), args.out or RESULTS, table)


def finish(res: dict, out: Path, render) -> int:
    """Write a run's JSON to ``out`` and print its table (``render(res)``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print("\n" + render(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
