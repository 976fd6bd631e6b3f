"""PLAID (``fast-plaid``) and embedpool side by side on the same SciFact token vectors (issue 13):
bytes per document, build seconds, p50/p99 per query (one query per call, one thread) and nDCG@10.

fast-plaid's wheels are built against one torch release each (1.7.0.2110: torch 2.11.0), so it runs
in its own venv (``--venv``, default bench/.venv-plaid, gitignored), never in the project's (torch
2.13):

    python3.11 -m venv bench/.venv-plaid && bench/.venv-plaid/bin/pip install fast-plaid==1.7.0.2110

(PyPI's torch 2.11.0 brings its CUDA libraries along, ~5 GB on disk, which a CPU run never
loads.) Both sides index the cached ``tokens`` vectors (bench/scifact_data.py); embedpool's
build time is adding and committing the vectors (and computing the FDEs from them), PLAID's is
``FastPlaid.create`` (k-means and residual compression).

    flock /tmp/embedpool-bench.lock .venv/bin/python bench/plaid.py

Writes ``bench/results/plaid.json`` and prints a Markdown table.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
NBITS = (4,)  # fast-plaid's default


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def pct(ms: list[float]) -> dict[str, float]:
    return {"p50_ms": round(float(np.percentile(ms, 50)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 2)}


# ------------------------------------------------------------------ in fast-plaid's venv
def worker(data: Path, out_dir: Path) -> dict:
    import torch
    from fast_plaid import search

    torch.set_num_threads(1)
    z = np.load(data)
    docs = [torch.from_numpy(d) for d in np.split(z["docs"], np.cumsum(z["doc_lengths"])[:-1])]
    queries = [torch.from_numpy(q) for q in np.split(z["queries"], np.cumsum(z["query_lengths"])[:-1])]
    res = {"torch": torch.__version__, "configs": []}
    for nbits in NBITS:
        folder = out_dir / f"plaid-{nbits}"
        index = search.FastPlaid(index=str(folder), device="cpu")
        t0 = time.perf_counter()
        index.create(documents_embeddings=docs, nbits=nbits, seed=42)
        build = time.perf_counter() - t0
        index.search(queries_embeddings=[queries[0]], top_k=10, show_progress=False)  # warm-up
        top, lat = [], []
        for q in queries:
            t0 = time.perf_counter()
            hits = index.search(queries_embeddings=[q], top_k=10, show_progress=False)[0]
            lat.append(1000 * (time.perf_counter() - t0))
            top.append([[int(i), float(s)] for i, s in hits])
        res["configs"].append({"nbits": nbits, "build_s": round(build, 2), "bytes": folder_bytes(folder),
                               **pct(lat), "top10": top})
    return res


# ------------------------------------------------------------------ embedpool side
def embedpool_side(root: Path, sf, cache, sd, q_tokens, q_mean, ndcg10, log) -> list[dict]:
    from embedpool.index import FaissCollection, CollectionSpec
    from embedpool.poolers import build_pooler

    fde = build_pooler("fde")
    qf = fde.encode_sets(q_tokens, "query")
    qf /= np.linalg.norm(qf, axis=1, keepdims=True)
    rows = []
    configs = [("tokens", "int8", "fde", 100),
               ("cluster:pool_factor=4", "int8", "mean", 100), ("cluster:pool_factor=4", "int8", "fde", 100),
               ("cluster:pool_factor=16", "int8", "mean", 100)]
    for i, (pooler, precision, companion, n) in enumerate(configs):
        vecs = sd.scifact_docs(sf, cache, (pooler,))[pooler]
        t0 = time.perf_counter()
        x, cq = None, None  # the companion the collection keeps (its rows, the queries' vectors)
        if companion == "mean":
            x, cq = np.stack(sd.scifact_docs(sf, cache, ("mean",))["mean"]), q_mean
        elif companion == "fde":
            docs = sd.scifact_docs(sf, cache, ("tokens",))["tokens"]  # FDEs of all token states
            x = np.concatenate([fde.encode_sets(docs[s:s + 256], "document") for s in range(0, len(docs), 256)])
            x /= np.linalg.norm(x, axis=1, keepdims=True)
            cq = qf
        comp = {} if x is None else {"companion_pooler": companion, "companion_dim": x.shape[1]}
        coll = FaissCollection.create(root, f"m{i}", CollectionSpec(kind="multi", pooler=pooler, dim=384,
                                                                     precision=precision, **comp))
        for s in range(0, len(vecs), 500):
            coll.add(sf.doc_ids[s:s + 500], vecs[s:s + 500], companion=None if x is None else x[s:s + 500])
        coll.commit()
        build = time.perf_counter() - t0
        nbytes = coll.stats()["bytes_on_disk"]

        def one(j: int):
            if x is None:
                return coll.search([q_tokens[j]], k=10)[0]
            return coll.search([q_tokens[j]], k=10, mode="two_stage", candidates=n, companion_queries=cq[j:j + 1])[0]

        one(0)
        hits, lat = {}, []
        n_q = len(sf.query_ids) if x is not None else 30  # exhaustive is ~2 s a query
        for j, qid in enumerate(sf.query_ids[:n_q]):
            t0 = time.perf_counter()
            hits[qid] = one(j)
            lat.append(1000 * (time.perf_counter() - t0))
        if x is None:  # nDCG of the exhaustive scan from batched calls
            for s in range(0, len(sf.query_ids), 50):
                hits.update(zip(sf.query_ids[s:s + 50], coll.search(q_tokens[s:s + 50], k=10)))
        label = f"embedpool {pooler} {precision}, " + (f"{companion} companion N={n}" if companion else "exhaustive")
        rows.append({"system": label, "bytes_per_doc": round(nbytes / len(sf.doc_ids), 1),
                     "build_s": round(build, 2), **pct(lat), "latency_queries": n_q,
                     "ndcg@10": ndcg10(sf.qrels, hits)})
        log(rows[-1])
        coll.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=HERE / ".venv-plaid")
    ap.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--docs", type=int)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return
    import index as bi  # bench/index.py: SciFact loading, ranx nDCG, tables
    import scifact_data as sd

    sf, cache, _ = bi._scifact(args.docs, 1)
    q = sd.scifact_queries(sf, cache)
    q_tokens, q_mean = q["tokens"], np.stack(q["mean"])
    docs = sd.scifact_docs(sf, cache, ("tokens",))["tokens"]
    out = {"documents": len(sf.doc_ids), "queries": len(sf.query_ids), "loadavg_1m_start": round(os.getloadavg()[0], 2),
           **bi.cpu_flags()}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "vectors.npz"
        np.savez(data, docs=np.concatenate(docs), doc_lengths=[len(d) for d in docs],
                 queries=np.concatenate(q_tokens), query_lengths=[len(x) for x in q_tokens])
        py = args.venv / "bin" / "python"
        if not py.exists():
            raise SystemExit(f"no fast-plaid venv at {args.venv}; see the module docstring")
        w = subprocess.run([str(py), __file__, "--worker", str(data), tmp], capture_output=True, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        if w.returncode != 0:
            raise SystemExit("fast-plaid failed:\n" + w.stderr[-4000:])
        plaid = json.loads(w.stdout.strip().splitlines()[-1])
        out["fast_plaid_torch"] = plaid["torch"]
        rows = []
        for c in plaid["configs"]:
            hits = {qid: [_Hit(sf.doc_ids[i], s) for i, s in top] for qid, top in zip(sf.query_ids, c.pop("top10"))}
            rows.append({"system": f"fast-plaid nbits={c['nbits']} (tokens)", "bytes_per_doc": round(c["bytes"] / len(docs), 1),
                         "build_s": c["build_s"], "p50_ms": c["p50_ms"], "p99_ms": c["p99_ms"],
                         "latency_queries": len(sf.query_ids), "ndcg@10": bi.ndcg10(sf.qrels, hits)})
            print(rows[-1], flush=True)
        rows += embedpool_side(Path(tmp), sf, cache, sd, q_tokens, q_mean, bi.ndcg10, lambda r: print(r, flush=True))
    out["rows"] = rows
    out["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    (HERE / "results" / "plaid.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nSciFact test, {out['documents']:,} documents, {out['queries']} queries; one thread; "
          f"load average {out['loadavg_1m_start']}-{out['loadavg_1m_end']}; fast-plaid on torch {out['fast_plaid_torch']}\n")
    from embedpool.app.tables import render_table

    print(render_table(["system", "bytes/doc", "build s", "p50 ms", "p99 ms", "nDCG@10"],
                      [[r["system"], f"{r['bytes_per_doc']:,.0f}", r["build_s"], r["p50_ms"], r["p99_ms"],
                        f"{r['ndcg@10']:.4f}"] for r in rows], markdown=True))
    print("\nwrote bench/results/plaid.json")


class _Hit:
    def __init__(self, id_: str, score: float) -> None:
        self.id, self.score = id_, score


if __name__ == "__main__":
    main()
