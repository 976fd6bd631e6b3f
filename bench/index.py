"""Index benchmarks.

Synthetic part (no model needed):
  A. flat single-vector search latency on 100k synthetic 384-d unit vectors (``IDMap2,Flat``):
     add/commit time, per-query p50/p99 (one query per call) and batched throughput;
  B. multi-vector MaxSim: ``exhaustive`` vs ``two_stage`` (mean-pooled companion, N candidates)
     latency and agreement with the exhaustive top-10, per storage precision, on synthetic token
     sets (each document's tokens scatter around a topic direction; queries are noisy copies of
     some of a document's tokens).

    .venv/bin/python bench/index.py            # ~1-2 minutes on 2 cores
    .venv/bin/python bench/index.py --quick    # smaller sizes, a few seconds

Writes ``bench/results/index_synthetic.json`` and prints a table.

SciFact part (``--scifact``; issue 3): real MiniLM token states of the SciFact corpus (documents
``title + " " + text``, the 300 test queries). Per pooler (``tokens``, ``cluster`` pool factor
2/3/4, plus 8/16 to reach 8 KB/doc) x precision (float32/float16/int8): vectors, bytes/doc,
nDCG@10 (ranx) with ``exhaustive`` MaxSim and with ``two_stage`` (mean-pooled companion,
N = 50/100/200/500), and one-query-per-call latency p50/p99 of both.
Writes ``bench/results/index_scifact.json``.

Milvus part (``--backend milvus``; issue 7): FAISS and Milvus side by side on SciFact (Milvus
Lite in a temp file, or ``--milvus-uri``): mean-pooled single vectors in FAISS ``IDMap2,Flat`` and
Milvus ``FLAT`` (nDCG@10 and its difference, add throughput in vectors/s, one-query-per-call
latency p50/p99); multi-vector collections (``--multi-pooler``, one row per vector in Milvus) with
exact MaxSim in embedpool, exhaustive and ``two_stage`` (the mean companion each collection keeps,
in its own backend); and a probe of Milvus' own multi-vector MaxSim (Array of Structs + MAX_SIM_IP).
Reads the embedding cache only (never encodes). Writes ``bench/results/index_milvus.json``
(marked ``partial`` until the run completes) and prints a Markdown table.

Runners part (``--runners``; issue 15): the index job (``embedpool index``, ``mean`` +
``cluster:pool_factor=4``) over the SciFact corpus in-process vs ``--runner ray`` with 1 and 2
workers, in one run: docs/s and peak RSS of the driver and of each worker (bench/index_runners.py).
Writes ``bench/results/index_runners.json``.

    flock /tmp/embedpool-bench.lock .venv/bin/python bench/index.py --runners [--docs N]

Both SciFact parts read the embeddings from ``bench/results/cache/`` (see bench/scifact_data.py):
the corpus is encoded once, by the first run (slow: one forward pass serves every pooler).

    .venv/bin/python bench/index.py --scifact [--docs N]
    .venv/bin/python bench/index.py --backend milvus [--docs N] [--milvus-uri http://host:19530]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _threads_from_argv(default: int = 1) -> int:
    """--threads must take effect before numpy/faiss load their thread pools."""
    for i, a in enumerate(sys.argv):
        if a == "--threads" and i + 1 < len(sys.argv):
            return int(sys.argv[i + 1])
        if a.startswith("--threads="):
            return int(a.split("=", 1)[1])
    return default


THREADS = _threads_from_argv()
if THREADS > 0:
    for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_v] = str(THREADS)

import numpy as np  # noqa: E402

from embedpool.app.tables import render_table  # noqa: E402
from embedpool.index import CollectionSpec, FaissCollection, delete_collection, open_collection  # noqa: E402
from embedpool.precisions import STORAGE_PRECISIONS  # noqa: E402

RESULTS = _HERE / "results" / "index_synthetic.json"
RESULTS_SCIFACT = _HERE / "results" / "index_scifact.json"
RESULTS_MILVUS = _HERE / "results" / "index_milvus.json"
RESULTS_FDE = _HERE / "results" / "index_fde.json"
RESULTS_RUNNERS = _HERE / "results" / "index_runners.json"
MODEL = "sentence-transformers/all-MiniLM-L6-v2"
MULTI_POOLERS = ("tokens", "cluster:pool_factor=2", "cluster:pool_factor=3", "cluster:pool_factor=4",
                 "cluster:pool_factor=8", "cluster:pool_factor=16")
CANDIDATES = (50, 100, 200, 500)


def cpu_flags() -> dict:
    """What this CPU offers (the figures depend on it)."""
    import torch

    flags = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = line.split(":", 1)[1]
                break
    except OSError:
        pass
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni", "avx_vnni") if f in flags.split()]
    return {"cpu_flags": have, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _uptime() -> str:
    import subprocess

    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def pct(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {"p50_ms": round(float(np.percentile(a, 50)), 3), "p99_ms": round(float(np.percentile(a, 99)), 3),
            "mean_ms": round(float(a.mean()), 3)}


def bench_flat(root: Path, n: int, dim: int, n_queries: int, batch: int, rng) -> dict:
    coll = FaissCollection.create(root, "flat", CollectionSpec(kind="single", dim=dim))
    t0 = time.perf_counter()
    step = 20_000
    for s in range(0, n, step):
        m = min(step, n - s)
        coll.add([f"d{i}" for i in range(s, s + m)], unit(rng.standard_normal((m, dim), dtype=np.float32)))
    t_add = time.perf_counter() - t0
    t0 = time.perf_counter()
    coll.commit()
    t_commit = time.perf_counter() - t0
    q = unit(rng.standard_normal((n_queries, dim), dtype=np.float32))
    coll.search(q[:5], k=10)  # warm-up
    single = []
    for i in range(n_queries):
        t0 = time.perf_counter()
        coll.search(q[i:i + 1], k=10)
        single.append(1000 * (time.perf_counter() - t0))
    import faiss

    # faiss-cpu ships distance_compute_blas_threshold=128000, so batches use the per-query scan;
    # measure batches with that default and with BLAS (threshold 20), which a batch job can set.
    # (Not set by index/: on this machine it made single-query search ~2.5x slower.)
    default_th = faiss.cvar.distance_compute_blas_threshold
    batched: dict[int, list[float]] = {}
    for th in (default_th, 20):
        faiss.cvar.distance_compute_blas_threshold = th
        batched[th] = []
        for s in range(0, n_queries, batch):
            t0 = time.perf_counter()
            coll.search(q[s:s + batch], k=10)
            batched[th].append(1000 * (time.perf_counter() - t0) / len(q[s:s + batch]))
    faiss.cvar.distance_compute_blas_threshold = default_th
    st = coll.stats()
    coll.close()
    return {"vectors": n, "dim": dim, "factory": "IDMap2,Flat", "add_s": round(t_add, 2),
            "commit_s": round(t_commit, 2), "bytes_per_doc": round(st["bytes_per_doc"], 1),
            "per_query_k10": pct(single),
            "batch_size": batch,
            "batched_per_query_ms": round(float(np.mean(batched[default_th])), 3),
            "batched_qps": round(1000 / float(np.mean(batched[default_th])), 1),
            "batched_blas_per_query_ms": round(float(np.mean(batched[20])), 3),
            "batched_blas_qps": round(1000 / float(np.mean(batched[20])), 1),
            "faiss_blas_threshold_default": int(default_th)}


def synth_tokens(rng, n_docs: int, dim: int, lo: int, hi: int, n_q: int, q_tokens: int):
    topics = unit(rng.standard_normal((n_docs, dim), dtype=np.float32))
    docs = [unit(t + 0.8 * unit(rng.standard_normal((int(rng.integers(lo, hi + 1)), dim), dtype=np.float32)))
            for t in topics]
    targets = rng.choice(n_docs, n_q, replace=False)
    queries = []
    for t in targets:
        d = docs[t]
        take = d[rng.choice(len(d), min(q_tokens, len(d)), replace=False)]
        queries.append(unit(take + 0.5 * rng.standard_normal(take.shape, dtype=np.float32) / np.sqrt(dim)))
    return docs, queries


def bench_maxsim(root: Path, n_docs: int, dim: int, n_q: int, candidates: list[int], rng) -> dict:
    docs, queries = synth_tokens(rng, n_docs, dim, 32, 128, n_q, 16)
    ids = [f"d{i}" for i in range(n_docs)]
    means = unit(np.stack([d.mean(0) for d in docs]))  # the companion every collection keeps
    cq = unit(np.stack([q.mean(0) for q in queries]))
    out = {"documents": n_docs, "dim": dim, "tokens": int(sum(len(d) for d in docs)),
           "queries": n_q, "query_tokens": 16, "precisions": {}}
    for precision in ("float32", "float16", "int8"):
        coll = FaissCollection.create(root, f"multi-{precision}", CollectionSpec(
            kind="multi", dim=dim, precision=precision, companion_pooler="mean", companion_dim=dim))
        _add_all(coll, ids, docs, 1000, companion=means)
        res = {"bytes_per_doc": round(coll.stats()["bytes_per_doc"], 1)}
        coll.search(queries[:1], k=10)  # warm-up
        exact, lat = [], []
        for q in queries:
            t0 = time.perf_counter()
            exact.append([h.id for h in coll.search([q], k=10)[0]])
            lat.append(1000 * (time.perf_counter() - t0))
        res["exhaustive"] = pct(lat)
        for n in candidates:
            got, lat = [], []
            for i, q in enumerate(queries):
                t0 = time.perf_counter()
                got.append([h.id for h in coll.search([q], k=10, mode="two_stage", candidates=n,
                                                      companion_queries=cq[i:i + 1])[0]])
                lat.append(1000 * (time.perf_counter() - t0))
            overlap = float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got, exact)]))
            top1 = float(np.mean([a[0] == b[0] for a, b in zip(got, exact)]))
            res[f"two_stage_{n}"] = {**pct(lat), "top10_overlap_vs_exhaustive": round(overlap, 4),
                                     "top1_agreement": round(top1, 4),
                                     "speedup_p50": round(res["exhaustive"]["p50_ms"] / max(pct(lat)["p50_ms"], 1e-9), 1)}
        out["precisions"][precision] = res
        coll.close()
    return out


# ---- SciFact (real MiniLM embeddings) ------------------------------------------------------
def _scifact(docs: int | None, encode_threads: int):
    import scifact_data

    sf = scifact_data.load_scifact(docs)
    cache = scifact_data.EmbeddingCache(threads=encode_threads)
    return sf, cache, scifact_data


def ndcg10(qrels: dict, results: dict[str, list]) -> float:
    """nDCG@10 (ranx) of ``{query id: [Hit, ...]}``."""
    from ranx import Qrels, Run, evaluate

    run = {q: {h.id: float(h.score) for h in hits} or {"__none__": 0.0} for q, hits in results.items()}
    return round(float(evaluate(Qrels(qrels), Run(run), "ndcg@10")), 4)


def _slug(pooler: str) -> str:
    return pooler.replace("cluster:pool_factor=", "cluster-pf")


def _add_all(coll, ids, vectors, step: int, companion=None) -> float:
    """Add every document ``step`` at a time (``companion``: the companion vectors of a collection
    that keeps one), then commit; the seconds it took."""
    t0 = time.perf_counter()
    for s in range(0, len(ids), step):
        coll.add(ids[s:s + step], vectors[s:s + step], companion=None if companion is None else companion[s:s + step])
    coll.commit()
    return time.perf_counter() - t0


def bench_scifact(root: Path, docs: int | None, encode_threads: int, latency_queries: int,
                  log=print) -> dict:
    sf, cache, sd = _scifact(docs, encode_threads)
    qids = sf.query_ids
    q = sd.scifact_queries(sf, cache)
    q_tokens, q_mean = q["tokens"], np.stack(q["mean"])
    mean_docs = np.stack(sd.scifact_docs(sf, cache, ("mean",))["mean"])
    mean = FaissCollection.create(root, "mean", CollectionSpec(kind="single", model=MODEL, pooler="mean", dim=384))
    _add_all(mean, sf.doc_ids, mean_docs, 2000)
    hits = mean.search(q_mean, k=10)
    out = {"documents": len(sf.doc_ids), "queries": len(qids), "latency_queries": latency_queries,
           "mean_single_vector": {"ndcg@10": ndcg10(sf.qrels, dict(zip(qids, hits))),
                                  "bytes_per_doc": 4 * 384}, "configs": []}
    log(f"mean (single vector): nDCG@10 {out['mean_single_vector']['ndcg@10']}")
    lat_idx = list(range(min(latency_queries, len(qids))))
    for pooler in MULTI_POOLERS:
        vecs = sd.scifact_docs(sf, cache, (pooler,))[pooler]
        for precision in STORAGE_PRECISIONS:
            name = f"{_slug(pooler)}-{precision}"
            coll = FaissCollection.create(root, name, CollectionSpec(
                kind="multi", model=MODEL, pooler=pooler, dim=384, precision=precision, companion_pooler="mean",
                companion_dim=384))
            t_add = _add_all(coll, sf.doc_ids, vecs, 500, companion=mean_docs)
            st = coll.stats()
            row = {"pooler": pooler, "precision": precision, "vectors": st["vectors"],
                   "vectors_per_doc": round(st["vectors"] / st["documents"], 1),
                   "bytes_per_doc": round(st["bytes_per_doc"], 1), "add_s": round(t_add, 1)}
            res = {}
            for s in range(0, len(qids), 100):  # batches: exact nDCG in few passes over the corpus
                res.update(zip(qids[s:s + 100], coll.search(q_tokens[s:s + 100], k=10)))
            lat = []
            for i in lat_idx:
                t0 = time.perf_counter()
                coll.search([q_tokens[i]], k=10)
                lat.append(1000 * (time.perf_counter() - t0))
            row["exhaustive"] = {"ndcg@10": ndcg10(sf.qrels, res), **pct(lat)}
            for n in CANDIDATES:
                res, lat = {}, []
                for i, qid in enumerate(qids):
                    t0 = time.perf_counter()
                    res[qid] = coll.search([q_tokens[i]], k=10, mode="two_stage", candidates=n,
                                           companion_queries=q_mean[i:i + 1])[0]
                    lat.append(1000 * (time.perf_counter() - t0))
                p = pct(lat)
                row[f"two_stage_{n}"] = {"ndcg@10": ndcg10(sf.qrels, res), **p,
                                         "speedup_p50": round(row["exhaustive"]["p50_ms"] / max(p["p50_ms"], 1e-9), 1)}
            out["configs"].append(row)
            log(" | ".join(str(c) for c in _scifact_cells(row)))
            coll.close()
            delete_collection(root, name)
        del vecs
    mean.close()
    out["targets"] = scifact_targets(out)
    return out


def scifact_targets(out: dict) -> dict:
    """Issue 3's targets: two_stage >= 10x faster than exhaustive at >= 99% of its nDCG@10; a
    configuration <= 8 KB/doc keeping >= 95% of the float32 tokens nDCG@10."""
    base = next(r for r in out["configs"] if r["pooler"] == "tokens" and r["precision"] == "float32")
    ref = base["exhaustive"]["ndcg@10"]
    fast = []
    for r in out["configs"]:
        for n in CANDIDATES:
            t = r[f"two_stage_{n}"]
            if t["speedup_p50"] >= 10 and t["ndcg@10"] >= 0.99 * r["exhaustive"]["ndcg@10"]:
                fast.append(f"{r['pooler']} {r['precision']} N={n}: {t['speedup_p50']}x, "
                            f"{t['ndcg@10']} vs {r['exhaustive']['ndcg@10']}")
    small = [f"{r['pooler']} {r['precision']} {mode}: {r['bytes_per_doc']:.0f} B/doc, nDCG@10 {r[mode]['ndcg@10']}"
             for r in out["configs"] for mode in ["exhaustive"] + [f"two_stage_{n}" for n in CANDIDATES]
             if r["bytes_per_doc"] <= 8192 and r[mode]["ndcg@10"] >= 0.95 * ref]
    return {"tokens_float32_ndcg@10": ref,
            "two_stage_10x_at_99pct": {"met": bool(fast), "configs": fast},
            "le_8KB_at_95pct_of_tokens_float32": {"met": bool(small), "threshold": round(0.95 * ref, 4),
                                                  "configs": small}}


def _scifact_cells(r: dict) -> list[str]:
    e = r["exhaustive"]
    return ([r["pooler"], r["precision"], f"{r['vectors']:,}", r["vectors_per_doc"],
             f"{r['bytes_per_doc']:,.0f}", f"{e['ndcg@10']:.4f}", f"{e['p50_ms']:.1f} / {e['p99_ms']:.1f}"]
            + [f"{t['ndcg@10']:.4f} / {t['p50_ms']:.1f} / {t['p99_ms']:.1f}"
               for t in (r[f"two_stage_{n}"] for n in CANDIDATES)])


def print_scifact(out: dict) -> None:
    print(f"\nSciFact test, {out['documents']:,} documents, {out['queries']} queries, k=10; "
          f"latency: one query per call, ms (exhaustive over the first {out['latency_queries']} queries)")
    print(f"mean-pooled single vector (companion): nDCG@10 {out['mean_single_vector']['ndcg@10']}, "
          f"{out['mean_single_vector']['bytes_per_doc']} B/doc\n")
    print(render_table(["pooler", "precision", "vectors", "vec/doc", "B/doc", "exhaustive nDCG@10",
                        "exhaustive p50 / p99"] + [f"two_stage N={n} nDCG / p50 / p99" for n in CANDIDATES],
                       [[str(c) for c in _scifact_cells(r)] for r in out["configs"]], markdown=True))
    t = out["targets"]
    print(f"\ntarget two_stage >= 10x faster at >= 99% of exhaustive nDCG@10: "
          f"{'MET' if t['two_stage_10x_at_99pct']['met'] else 'NOT MET'}")
    for c in t["two_stage_10x_at_99pct"]["configs"]:
        print(f"  - {c}")
    s = t["le_8KB_at_95pct_of_tokens_float32"]
    print(f"target <= 8 KB/doc at >= 95% of float32 tokens nDCG@10 ({t['tokens_float32_ndcg@10']} -> "
          f">= {s['threshold']}): {'MET' if s['met'] else 'NOT MET'}")
    for c in s["configs"]:
        print(f"  - {c}")


# ---- Milvus vs FAISS -------------------------------------------------------------------------
def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for dist in ("pymilvus", "milvus-lite", "faiss-cpu"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def probe_native_maxsim(uri: str, token: str | None) -> dict:
    """Does this Milvus offer its own multi-vector MaxSim (an Array of Structs field whose vector
    sub-field is indexed as an embedding list with a MAX_SIM metric; Milvus 2.6.4+)? Tries it for
    real on ``uri`` and records what the server says."""
    from pymilvus import DataType, MilvusClient

    client_api = all(hasattr(o, a) for o, a in ((MilvusClient, "create_struct_field_schema"),
                                                 (DataType, "STRUCT")))
    client = MilvusClient(uri=uri, token=token or "")
    name = "embedpool_probe_maxsim"
    try:
        if client.has_collection(name):
            client.drop_collection(name)
        schema = client.create_schema(auto_id=False)
        schema.add_field("id", DataType.VARCHAR, is_primary=True, max_length=64)
        schema.add_field("dummy", DataType.FLOAT_VECTOR, dim=2)
        st = client.create_struct_field_schema()
        st.add_field("emb", DataType.FLOAT_VECTOR, dim=4)
        schema.add_field("tokens", DataType.ARRAY, element_type=DataType.STRUCT, struct_schema=st,
                         max_capacity=16)
        ip = client.prepare_index_params()
        ip.add_index(field_name="dummy", index_type="FLAT", metric_type="IP")
        ip.add_index(field_name="tokens[emb]", index_type="HNSW", metric_type="MAX_SIM_IP",
                     params={"M": 16, "efConstruction": 64})
        client.create_collection(name, schema=schema, index_params=ip)
        client.insert(name, [{"id": "a", "dummy": [1.0, 0.0], "tokens": [{"emb": [1.0, 0, 0, 0]}]}])
        client.search(name, data=[[[1.0, 0, 0, 0]]], anns_field="tokens[emb]", limit=1)
        return {"available": True, "client_api": client_api}
    except Exception as e:  # noqa: BLE001 - record whatever the server says
        return {"available": False, "client_api": client_api,
                "error": f"{type(e).__name__}: {getattr(e, 'message', e)}"}
    finally:
        try:
            if client.has_collection(name):
                client.drop_collection(name)
        finally:
            client.close()


def _lat(fn, n: int) -> tuple[list, list[float]]:
    res, lat = [], []
    for i in range(n):
        t0 = time.perf_counter()
        res.append(fn(i))
        lat.append(1000 * (time.perf_counter() - t0))
    return res, lat


def _cache_only(cache) -> None:
    """The Milvus benchmark reads embeddings from the cache only: a missing chunk stops the run
    instead of encoding the corpus (slow, and not what this benchmark measures)."""
    def refuse():
        raise SystemExit(f"bench/index.py --backend milvus: embeddings missing from {cache.dir}; fill the "
                         "cache first (.venv/bin/python bench/scifact_data.py), this run does not encode")
    cache.embedder = refuse


def _milvus_single(colls: dict, root: Path, kw: dict, sf, q_mean: np.ndarray, mean_docs: np.ndarray,
                   log) -> dict:
    """Mean-pooled single vectors in FAISS ``IDMap2,Flat`` and Milvus ``FLAT``, side by side
    (the collections stay open in ``colls``: the Milvus one is the layout-1 emulation's companion)."""
    qids = sf.query_ids
    spec = CollectionSpec(kind="single", model=MODEL, pooler="mean", dim=384)
    out: dict = {}
    for backend in ("faiss", "milvus"):
        t0 = time.perf_counter()
        coll = colls[backend] = open_collection(root, "bench-mean", spec, **kw[backend])
        t_open = time.perf_counter() - t0
        t_add = _add_all(coll, sf.doc_ids, mean_docs, 500)
        coll.search(q_mean[:2], k=10)  # warm-up
        hits, lat = _lat(lambda i: coll.search(q_mean[i:i + 1], k=10)[0], len(qids))
        t0 = time.perf_counter()
        batched = coll.search(q_mean, k=10)
        t_batch = time.perf_counter() - t0
        out[backend] = {
            "index": "IDMap2,Flat" if backend == "faiss" else "FLAT",
            "ndcg@10": ndcg10(sf.qrels, dict(zip(qids, hits))),
            "vectors": len(sf.doc_ids), "open_s": round(t_open, 2), "add_s": round(t_add, 2),
            "add_vectors_per_s": round(len(sf.doc_ids) / t_add, 1),
            "per_query_k10": pct(lat),
            "batch_all_queries_ms_per_query": round(1000 * t_batch / len(qids), 3),
            "top10": [[h.id for h in r] for r in batched]}
        r = out[backend]
        log(f"{backend} single: nDCG@10 {r['ndcg@10']}, add {t_add:.1f} s, "
            f"p50 {r['per_query_k10']['p50_ms']} ms, p99 {r['per_query_k10']['p99_ms']} ms")
    f, m = out["faiss"], out["milvus"]
    out["ndcg_diff"] = round(m["ndcg@10"] - f["ndcg@10"], 4)
    out["same_top10_queries"] = sum(a == b for a, b in zip(f.pop("top10"), m.pop("top10")))
    out["target_equal_within_0.002"] = abs(out["ndcg_diff"]) <= 0.002
    return out


def _milvus_multi_backend(coll, vecs, mean_docs, backend: str, sf, q_tokens, q_mean,
                          nq: int, nl: int, candidates: int, log) -> dict:
    """One backend's multi-vector collection: exhaustive MaxSim, then two_stage with the mean
    companion it keeps (in its own backend)."""
    qids = sf.query_ids
    sub = {qq: sf.qrels[qq] for qq in qids[:nq]}
    t_add = _add_all(coll, sf.doc_ids, vecs, 250, companion=mean_docs)
    n_vec = coll.stats()["vectors"]
    row = {"vectors": n_vec, "add_s": round(t_add, 2), "add_vectors_per_s": round(n_vec / t_add, 1)}
    t0 = time.perf_counter()
    ex = {}
    for s0 in range(0, nq, 100):  # exact MaxSim over every document, 100 queries a call
        ex.update(zip(qids[s0:min(s0 + 100, nq)], coll.search(q_tokens[s0:min(s0 + 100, nq)], k=10)))
    row["exhaustive"] = {"ndcg@10": ndcg10(sub, ex),
                         "ms_per_query_batched": round(1000 * (time.perf_counter() - t0) / nq, 1)}

    def two_stage(a: int, b: int) -> list[list]:  # candidates from the collection's own mean companion
        return coll.search(q_tokens[a:b], k=10, mode="two_stage", candidates=candidates,
                           companion_queries=q_mean[a:b])

    two_stage(0, 1)  # warm-up
    hits = [h for s0 in range(0, nq, 25) for h in two_stage(s0, min(s0 + 25, nq))]
    _, lat = _lat(lambda i: two_stage(i, i + 1), nl)
    t = row[f"two_stage_companion_{backend}"] = {
        "ndcg@10": ndcg10(sub, dict(zip(qids, hits))), **pct(lat), "top10": [[h.id for h in r] for r in hits]}
    log(f"{backend} multi, two_stage with {backend} companion: nDCG@10 {t['ndcg@10']}, "
        f"p50 {t['p50_ms']} ms, p99 {t['p99_ms']} ms")
    log(f"{backend} multi: {n_vec:,} vectors, add {t_add:.1f} s, exhaustive nDCG@10 {row['exhaustive']['ndcg@10']}")
    return row


def _milvus_layout1(colls: dict, uri: str, token: str | None, sf, vecs, q_tokens, q_mean, nq: int, nl: int,
                    candidates: int, log) -> dict:
    """The old Milvus layout (one row per token vector, bench/milvus_layout1.py): add, then
    two_stage with the Milvus companion, as ``_milvus_multi_backend`` measures the new one."""
    from milvus_layout1 import Layout1

    qids = sf.query_ids
    old = Layout1(uri, token, 384)
    try:
        t0 = time.perf_counter()
        for s0 in range(0, len(sf.doc_ids), 250):
            old.add(sf.doc_ids[s0:s0 + 250], vecs[s0:s0 + 250])
        old.commit()
        t_add = time.perf_counter() - t0

        def two_stage(a: int, b: int) -> list[list]:
            return old.two_stage(q_tokens[a:b], colls["milvus"], q_mean[a:b], candidates)

        two_stage(0, 1)  # warm-up
        hits = [h for s0 in range(0, nq, 25) for h in two_stage(s0, min(s0 + 25, nq))]
        _, lat = _lat(lambda i: two_stage(i, i + 1), nl)
        t = {"ndcg@10": ndcg10({qq: sf.qrels[qq] for qq in qids[:nq]}, dict(zip(qids, hits))), **pct(lat),
             "top10": [[h.id for h in r] for r in hits]}
        log(f"milvus layout 1 multi, two_stage with milvus companion: nDCG@10 {t['ndcg@10']}, "
            f"p50 {t['p50_ms']} ms, p99 {t['p99_ms']} ms; add {t_add:.1f} s")
        return {"vectors": old.vectors, "add_s": round(t_add, 2), "add_vectors_per_s": round(old.vectors / t_add, 1),
                "two_stage_companion_milvus": t}
    finally:
        old.close()


def _milvus_multi(colls: dict, root: Path, kw: dict, sf, vecs, mean_docs, q_tokens, q_mean, multi_pooler: str,
                  multi_queries: int | None, candidates: int, latency_queries: int, log,
                  keep_server_clean: bool) -> dict:
    """Multi-vector collections (one row per vector in Milvus; candidates from the backend,
    exact MaxSim in embedpool) on both backends, and how far they agree."""
    qids = sf.query_ids
    mspec = CollectionSpec(kind="multi", model=MODEL, pooler=multi_pooler, dim=384, companion_pooler="mean",
                           companion_dim=384)
    nq = len(qids) if multi_queries is None else min(multi_queries, len(qids))
    nl = min(latency_queries, nq)
    multi = {"pooler": multi_pooler, "precision": "float32", "candidates": candidates, "queries": nq,
             "latency_queries": nl}
    for backend in ("faiss", "milvus"):
        coll = open_collection(root, "bench-multi", mspec, **kw[backend])
        try:
            multi[backend] = _milvus_multi_backend(coll, vecs, mean_docs, backend, sf, q_tokens, q_mean,
                                                   nq, nl, candidates, log)
        finally:
            coll.close()
            if backend == "milvus" and keep_server_clean:  # leave a server as we found it
                delete_collection(root, "bench-multi", **kw[backend])
    multi["milvus_layout1"] = _milvus_layout1(colls, kw["milvus"]["milvus_uri"], kw["milvus"]["milvus_token"], sf,
                                              vecs, q_tokens, q_mean, nq, nl, candidates, log)
    top_old = multi["milvus_layout1"]["two_stage_companion_milvus"].pop("top10")
    tops = [multi[b][f"two_stage_companion_{b}"].pop("top10") for b in ("faiss", "milvus")]
    multi["layout1_same_top10_queries_as_faiss"] = sum(a == b for a, b in zip(top_old, tops[0]))
    new, f = multi["milvus"]["two_stage_companion_milvus"], multi["faiss"]["two_stage_companion_faiss"]
    multi["layout2_vs_layout1_p50_speedup"] = round(multi["milvus_layout1"]["two_stage_companion_milvus"]["p50_ms"]
                                                    / new["p50_ms"], 1)
    multi["target_layout2_p50_le_50ms_ndcg_within_0.002"] = (new["p50_ms"] <= 50
                                                             and abs(new["ndcg@10"] - f["ndcg@10"]) <= 0.002)
    multi["two_stage_ndcg_diff"] = round(multi["milvus"]["two_stage_companion_milvus"]["ndcg@10"]
                                         - multi["faiss"]["two_stage_companion_faiss"]["ndcg@10"], 4)
    multi["exhaustive_ndcg_diff"] = round(multi["milvus"]["exhaustive"]["ndcg@10"]
                                          - multi["faiss"]["exhaustive"]["ndcg@10"], 4)
    multi["two_stage_same_top10_queries_both_backends"] = sum(
        all(t[i] == tops[0][i] for t in tops) for i in range(nq))
    return multi


def bench_milvus(root: Path, docs: int | None, milvus_uri: str | None, milvus_token: str | None,
                 multi_pooler: str, multi_queries: int | None, candidates: int, latency_queries: int,
                 log=print, checkpoint=lambda out: None) -> dict:
    """FAISS vs Milvus on SciFact: single vectors (FAISS ``IDMap2,Flat`` vs Milvus ``FLAT``), then
    multi-vector collections (packed rows; exhaustive and two_stage MaxSim in embedpool, two_stage
    from the mean companion each keeps). Multi-vector nDCG@10 comes from batched
    searches over all queries, latency from the first ``latency_queries`` one per call.
    ``checkpoint(out)`` after each part."""
    sf, cache, sd = _scifact(docs, 1)
    _cache_only(cache)
    q = sd.scifact_queries(sf, cache)
    q_mean, q_tokens = np.stack(q["mean"]), q["tokens"]
    mean_docs = np.stack(sd.scifact_docs(sf, cache, ("mean",))["mean"])
    uri = milvus_uri or str(root / "milvus.db")
    kw = {"faiss": {}, "milvus": {"backend": "milvus", "milvus_uri": uri, "milvus_token": milvus_token}}
    out = {"documents": len(sf.doc_ids), "queries": len(sf.query_ids), "versions": _versions(),
           "milvus_uri": "Milvus Lite (temp file)" if milvus_uri is None else milvus_uri}
    colls: dict = {}
    try:
        out["single"] = _milvus_single(colls, root, kw, sf, q_mean, mean_docs, log)
        checkpoint(out)
        vecs = sd.scifact_docs(sf, cache, (multi_pooler,))[multi_pooler]
        out["multi"] = _milvus_multi(colls, root, kw, sf, vecs, mean_docs, q_tokens, q_mean, multi_pooler,
                                     multi_queries, candidates, latency_queries, log,
                                     keep_server_clean=milvus_uri is not None)
        checkpoint(out)
        out["native_maxsim"] = probe_native_maxsim(uri, milvus_token)
        log(f"native MaxSim: {out['native_maxsim']}")
    finally:
        for backend, coll in colls.items():
            coll.close()
            if backend == "milvus" and milvus_uri is not None:
                delete_collection(root, "bench-mean", **kw[backend])
    return out


def milvus_markdown(out: dict) -> str:
    """The Milvus benchmark as Markdown: one table, FAISS and Milvus side by side."""
    s, m = out["single"], out["multi"]
    v = out["versions"]
    rows = [["single (mean)", f"{b} {s[b]['index']}", f"{s[b]['vectors']:,}", f"{s[b]['add_vectors_per_s']:,.0f}",
             f"{s[b]['ndcg@10']:.4f}", "", s[b]["per_query_k10"]["p50_ms"], s[b]["per_query_k10"]["p99_ms"]]
            for b in ("faiss", "milvus")]
    for b in ("faiss", "milvus"):
        t = m[b][f"two_stage_companion_{b}"]
        rows.append([f"multi ({m['pooler']}), two_stage N={m['candidates']}",
                     f"{'FAISS' if b == 'faiss' else 'Milvus packed rows'} + its {b} companion", f"{m[b]['vectors']:,}",
                     f"{m[b]['add_vectors_per_s']:,.0f}", f"{t['ndcg@10']:.4f}", f"{m[b]['exhaustive']['ndcg@10']:.4f}",
                     t["p50_ms"], t["p99_ms"]])
    if "milvus_layout1" in m:
        o = m["milvus_layout1"]
        t = o["two_stage_companion_milvus"]
        rows.append([f"multi ({m['pooler']}), two_stage N={m['candidates']}", "Milvus layout 1 (row per vector) "
                     "+ milvus companion", f"{o['vectors']:,}", f"{o['add_vectors_per_s']:,.0f}", f"{t['ndcg@10']:.4f}",
                     "", t["p50_ms"], t["p99_ms"]])
    n = out["native_maxsim"]
    lines = [
        f"SciFact test ({out['documents']:,} documents, {out['queries']} queries; multi-vector nDCG@10 "
        f"over {m['queries']} queries), k=10; latency one query per call (multi-vector: first "
        f"{m['latency_queries']} queries); {out['milvus_uri']}; "
        f"pymilvus {v['pymilvus']}, milvus-lite {v['milvus-lite']}, faiss-cpu {v['faiss-cpu']}.",
        "",
        render_table(["part", "backend", "vectors", "add (vectors/s)", "nDCG@10", "exhaustive nDCG@10",
                      "query p50 ms", "query p99 ms"], [[str(c) for c in r] for r in rows], markdown=True),
        "",
        f"- single-vector nDCG@10 difference milvus - faiss: {s['ndcg_diff']:+.4f} (target ±0.002: "
        f"{'met' if s['target_equal_within_0.002'] else 'NOT met'}); identical top-10 lists for "
        f"{s['same_top10_queries']}/{out['queries']} queries.",
        f"- multi-vector nDCG@10 difference milvus - faiss: two_stage {m['two_stage_ndcg_diff']:+.4f}, "
        f"exhaustive {m['exhaustive_ndcg_diff']:+.4f}; identical two_stage top-10 lists in both "
        f"backends for {m['two_stage_same_top10_queries_both_backends']}/{m['queries']} queries.",
        *([f"- two_stage p50, Milvus packed rows (layout 2) vs one row per vector (layout 1): "
           f"{m['layout2_vs_layout1_p50_speedup']}x faster; layout 1 top-10 = FAISS top-10 for "
           f"{m['layout1_same_top10_queries_as_faiss']}/{m['queries']} queries. Target layout-2 p50 <= 50 ms at "
           f"the FAISS nDCG@10 +-0.002: "
           f"{'met' if m['target_layout2_p50_le_50ms_ndcg_within_0.002'] else 'NOT met'}."]
          if "milvus_layout1" in m else []),
        "- Milvus native multi-vector MaxSim (Array of Structs field, MAX_SIM_IP): "
        + ("available" if n["available"] else
           f"not available with this Milvus (client API present: {'yes' if n['client_api'] else 'no'}; "
           f"server: {n['error']})"),
    ]
    return "\n".join(lines)


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    ap.add_argument("--scifact", action="store_true", help="the SciFact multi-vector benchmark (issue 3)")
    ap.add_argument("--fde", action="store_true",
                    help="issue 13: FDE vs mean companions on SciFact and synthetic long documents")
    ap.add_argument("--no-sweep", action="store_true", help="--fde: skip the FDE parameter sweep")
    ap.add_argument("--long-queries", type=int, default=100, help="--fde: queries of the synthetic long documents")
    ap.add_argument("--long-distractors", type=int, default=16, help="--fde: K of the synthetic long documents")
    ap.add_argument("--fde-spec", help="--fde: the FDE setting of the tables (default: the sweep's pick, "
                                       "or the pooler's default with --no-sweep)")
    ap.add_argument("--backend", choices=["faiss", "milvus"], default="faiss",
                    help="milvus: SciFact FAISS flat vs Milvus FLAT side by side (issue 7)")
    ap.add_argument("--runners", action="store_true",
                    help="the index job in-process vs --runner ray with 1 and 2 workers (issue 15)")
    ap.add_argument("--milvus-uri", help="Milvus server URI (default: Milvus Lite in a temp file)")
    ap.add_argument("--milvus-token")
    ap.add_argument("--multi-pooler", default="cluster:pool_factor=16",
                    help="pooler of the multi-vector collections of --backend milvus")
    ap.add_argument("--multi-queries", type=int,
                    help="--backend milvus: first N queries of the multi-vector comparison (default all)")
    ap.add_argument("--multi-latency-queries", type=int, default=50,
                    help="--backend milvus: multi-vector queries timed one per call (Milvus Lite "
                         "fetches the candidates' vectors at a few thousand rows/s: seconds per query)")
    ap.add_argument("--candidates", type=int, default=100,
                    help="--backend milvus: two_stage candidates of the multi-vector comparison")
    ap.add_argument("--docs", type=int, help="SciFact: first N documents only (queries with a "
                    "relevant document among them)")
    ap.add_argument("--latency-queries", type=int, default=20,
                    help="SciFact: queries timed one per call for exhaustive latency (all for two_stage)")
    ap.add_argument("--encode-threads", type=int, default=2,
                    help="torch threads when the embedding cache must be filled")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--threads", type=int, default=1,
                    help="BLAS/OpenMP threads (default 1: on a small shared machine more threads "
                         "spin against other processes and single-query latency gets much worse; "
                         "0 = library default)")
    return ap.parse_args()


def run_scifact_or_milvus(args: argparse.Namespace, machine: dict) -> None:
    """``--scifact`` or ``--backend milvus``: run, write the JSON (partial ones on the way), print."""
    out_path = args.out or (RESULTS_SCIFACT if args.scifact else RESULTS_MILVUS)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    machine["loadavg_1m_start"] = round(os.getloadavg()[0], 2)  # a shared machine: how busy
    machine.update(cpu_flags())
    print(f"uptime at start: {_uptime()}; CPU: {machine.get('cpu_flags')}, torch {machine.get('torch_cpu_capability')}")

    def write(res: dict, complete: bool = True) -> None:
        machine["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
        result = {"machine": machine, "threads": THREADS, "docs_arg": args.docs, **res}
        if not complete:
            result["partial"] = True  # a run that stopped early keeps what it measured
        out_path.write_text(json.dumps(result, indent=2) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        if args.scifact:
            res = bench_scifact(Path(tmp), args.docs, args.encode_threads, args.latency_queries)
        else:
            res = bench_milvus(Path(tmp), args.docs, args.milvus_uri, args.milvus_token,
                               args.multi_pooler, args.multi_queries, args.candidates,
                               args.multi_latency_queries, checkpoint=lambda r: write(r, complete=False))
    write(res)
    print(f"uptime at end: {_uptime()}")
    print(f"threads: {THREADS or 'library default'}")
    if args.scifact:
        print_scifact(res)
    else:
        print("\n" + milvus_markdown(res))
    print(f"\nwrote {out_path}")


def run_runners(args: argparse.Namespace) -> None:
    """``--runners``: the index job in-process vs on Ray (bench/index_runners.py)."""
    import index_runners
    from scifact_data import SCIFACT

    out_path = args.out or (RESULTS_RUNNERS if not args.docs else RESULTS_RUNNERS.with_name(
        f"index_runners_{args.docs}.json"))
    machine = index_runners.machine()
    print(json.dumps(machine))
    res = {"machine": machine, **index_runners.bench_runners(SCIFACT, args.docs)}
    res["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(res, indent=2) + "\n")
    print(index_runners.markdown(res))
    print(f"\nwrote {out_path}")


def run_synthetic(args: argparse.Namespace, machine: dict) -> None:
    """Parts A (flat search) and B (MaxSim exhaustive vs two_stage) on synthetic vectors."""
    args.out = args.out or RESULTS
    rng = np.random.default_rng(0)
    n_single, n_docs, n_q = (10_000, 300, 10) if args.quick else (100_000, 2_000, 30)
    with tempfile.TemporaryDirectory() as tmp:
        flat = bench_flat(Path(tmp), n_single, 384, 200, 100, rng)
        ms = bench_maxsim(Path(tmp), n_docs, 384, n_q, [50, 100, 200], rng)
    result = {"machine": machine, "flat_single": flat, "maxsim": ms}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"threads: {THREADS or 'library default'}")
    print_synthetic(flat, ms)
    print(f"\nwrote {args.out}")


def print_synthetic(f: dict, ms: dict) -> None:
    print(f"\nA. flat single-vector search, {f['vectors']:,} x {f['dim']}-d, {f['factory']}, k=10")
    print(f"   add {f['add_s']} s, commit {f['commit_s']} s, {f['bytes_per_doc']} bytes/doc")
    print(f"   one query per call: p50 {f['per_query_k10']['p50_ms']} ms, p99 {f['per_query_k10']['p99_ms']} ms;"
          f"  batches of {f['batch_size']}: {f['batched_per_query_ms']} ms/query ({f['batched_qps']} q/s),"
          f" with faiss BLAS threshold 20: {f['batched_blas_per_query_ms']} ms/query ({f['batched_blas_qps']} q/s)")
    print(f"\nB. MaxSim, {ms['documents']:,} docs, {ms['tokens']:,} tokens x {ms['dim']}-d, "
          f"{ms['queries']} queries x {ms['query_tokens']} tokens, k=10 (one query per call)")
    rows = []
    for p, r in ms["precisions"].items():
        e = r["exhaustive"]
        rows.append([p, str(r["bytes_per_doc"]), "exhaustive", str(e["p50_ms"]), str(e["p99_ms"]), "1.0", "1.0", "1.0"])
        rows += [["", "", "two_stage N=" + key.rsplit("_", 1)[1], str(v["p50_ms"]), str(v["p99_ms"]),
                  str(v["speedup_p50"]), str(v["top10_overlap_vs_exhaustive"]), str(v["top1_agreement"])]
                 for key, v in r.items() if key.startswith("two_stage_")]
    print(render_table(["precision", "B/doc", "mode", "p50 ms", "p99 ms", "speedup", "top10 ovl", "top1"], rows))


def run_fde(args: argparse.Namespace, machine: dict) -> None:
    """``--fde`` (issue 13): FDE vs mean companions, see bench/index_fde.py."""
    import index_fde

    out_path = args.out or RESULTS_FDE
    out_path.parent.mkdir(parents=True, exist_ok=True)
    machine.update(loadavg_1m_start=round(os.getloadavg()[0], 2), **cpu_flags())
    with tempfile.TemporaryDirectory() as tmp:
        sf, cache, _ = _scifact(args.docs, args.encode_threads)
        res = index_fde.bench_fde(Path(tmp), sf, cache, ndcg10, args.latency_queries, not args.no_sweep,
                                  args.fde_spec, long=(args.long_queries, args.long_distractors))
    machine["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    out_path.write_text(json.dumps({"machine": machine, "threads": THREADS, "docs_arg": args.docs, **res},
                                   indent=2) + "\n")
    print(f"threads: {THREADS or 'library default'}; machine: {machine}")
    print("\n" + index_fde.fde_markdown(res))
    print(f"\nwrote {out_path}")


def main() -> None:
    args = _args()
    machine = {"python": platform.python_version(), "cpus": os.cpu_count(), "threads": THREADS}
    if args.fde:
        run_fde(args, machine)
    elif args.runners:
        run_runners(args)
    elif args.scifact or args.backend == "milvus":
        run_scifact_or_milvus(args, machine)
    else:
        run_synthetic(args, machine)


if __name__ == "__main__":
    main()
