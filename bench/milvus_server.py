"""embedpool over HTTP on a real Milvus server (PyPI's ``milvus`` 2.3, ``make milvus-server``)
next to FAISS and Milvus Lite, in one run (issue 35).

1. A real Milvus standalone server starts (tests/milvus_testutil.py: its own data folder, a free port).
2. ``IndexJob`` indexes the SciFact corpus into it with ``mean`` and ``cluster:pool_factor=4``
   (one forward pass for both; the cluster collection keeps its mean companion rows): the job's
   docs/s, embedding included, and the server's peak RSS while it ran (sampled every 0.2 s).
3. The job's documents are read back (32 gets at once) and copied, vectors as stored, into a
   FAISS folder and a Milvus Lite file and into a second collection of the server: each
   backend's write rate (docs/s, add + commits every 1,024 documents; embedding excluded).
4. Three ``embedpool serve`` processes, one per backend, serve the same collections. The SciFact
   test queries go to each over HTTP one request at a time, the three backends interleaved in
   rotating order: ``/collections/sf-mean/search`` (single vector, k=10) and
   ``/collections/sf-cluster.../search`` with ``mode: two_stage`` (candidates from the companion
   rows, exact MaxSim), p50/p99 per backend, and how many queries got the same top 10 as FAISS.
5. The server's RSS after indexing and after the queries.

    flock /work/locks/cpu.lock .venv/bin/python bench/milvus_server.py [--docs N] [--queries N]

Writes ``bench/results/milvus_server.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))

from milvus_testutil import MilvusServer, free_port  # noqa: E402
from scale import machine  # noqa: E402

POOLERS = ["mean", "cluster:pool_factor=4"]
SCIFACT = Path(os.environ.get("EMBEDPOOL_SCIFACT", ROOT.parent / "shared" / "data" / "scifact"))


class RSSPeak:
    """The peak of ``fn()`` sampled every 0.2 s in a thread (``with`` block)."""

    def __init__(self, fn) -> None:
        self.fn, self.peak, self._stop = fn, 0, threading.Event()

    def __enter__(self) -> "RSSPeak":
        def run():
            while not self._stop.wait(0.2):
                self.peak = max(self.peak, self.fn())
        self._t = threading.Thread(target=run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.fn())


def corpus_file(path: Path, n: int | None) -> int:
    from embedpool.app.datasets import load_beir

    data = load_beir(SCIFACT, "test")
    docs = data.corpus[:n] if n else data.corpus
    with open(path, "w") as f:
        for r in docs:
            f.write(json.dumps({"_id": r.id, "text": r.text}) + "\n")
    return len(docs)


def queries(n: int | None) -> list[str]:
    from embedpool.app.datasets import load_beir

    qs = list(load_beir(SCIFACT, "test").queries.values())
    return qs[:n] if n else qs


def read_all(src, threads: int = 32) -> list[dict]:
    """Every document of ``src``, vectors as stored, ``threads`` gets at once. A strong-consistency
    read of the Milvus server waits for the server's next time tick (200-400 ms per query here,
    whatever its size), so one get at a time took ~0.3 s per document (~30 min for SciFact's
    mean collection, more for the multi-vector one, whose get is 2-3 queries)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads) as ex:
        return list(ex.map(src.get, src.ids()))


def copy(docs: list[dict], spec, dst, batch: int = 256, commit_every: int = 1024) -> float:
    """``docs`` (:func:`read_all`) into ``dst``; docs/s of the writes alone."""
    spent, since = 0.0, 0
    for i in range(0, len(docs), batch):
        part = docs[i:i + batch]
        key = "vector" if "vector" in part[0] else "vectors"
        vecs = np.stack([d[key] for d in part]) if key == "vector" else [d[key] for d in part]
        comp = [d["companion"] for d in part] if "companion" in part[0] else None
        t0 = time.perf_counter()
        dst.add([d["id"] for d in part], vecs, [d["text"] for d in part], [d["metadata"] for d in part],
                model=spec.model, pooler=spec.pooler, **({"companion": comp} if comp is not None else {}))
        since += len(part)
        if since >= commit_every:
            dst.commit()
            since = 0
        spent += time.perf_counter() - t0
    t0 = time.perf_counter()
    dst.commit()
    spent += time.perf_counter() - t0
    return len(docs) / spent


def serve(env: dict[str, str], folder: Path, precision: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    full = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDPOOL_")}
    full.update({"EMBEDPOOL_DATA_DIR": str(folder), "EMBEDPOOL_LOG_LEVEL": "warning", "OMP_WAIT_POLICY": "PASSIVE",
                 "EMBEDPOOL_PRECISION": precision, **env})
    log = open(folder.parent / f"serve-{port}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "embedpool.app.cli", "serve", "--host", "127.0.0.1",
                             "--port", str(port)], env=full, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        assert proc.poll() is None, f"server {url} exited"
        try:
            if httpx.get(url + "/health", timeout=10).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


def pct(xs: list[float], p: float) -> float:
    return round(float(np.percentile(np.asarray(xs) * 1000, p)), 2)


def exit_on_sigterm() -> None:
    """SIGTERM (``timeout``, ``kill``) unwinds like Ctrl-C, so ``main``'s ``finally`` stops the Milvus
    server (its own process group, which a signal to this process never reaches) and the three
    ``embedpool serve`` processes; Python's default SIGTERM would exit at once and leave them running."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def main() -> None:
    exit_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=None, help="first N SciFact documents (default: all 5,183)")
    ap.add_argument("--queries", type=int, default=None, help="first N test queries (default: all 300)")
    ap.add_argument("--precision", default="fp32",
                    help="encoder path of the indexing job and of the three servers (the same for every backend)")
    ap.add_argument("--out", default=str(HERE / "results" / "milvus_server.json"))
    args = ap.parse_args()

    from embedpool.app.datasets import CorpusSource
    from embedpool.app.indexing import IndexJob
    from embedpool.app.settings import Settings, load_embedder
    from embedpool.index import open_collection
    from embedpool.index.milvus.versions import features_of

    out: dict = {"machine": machine()}
    m = out["machine"]
    print(f"machine: {m['cpu']} x{m['cpus']} {' '.join(m['cpu_flags'])}; load {m['loadavg_start']}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-milvus-"))
    procs: list[subprocess.Popen] = []
    srv = MilvusServer(work / "milvus")
    try:
        srv.start()
        print(f"milvus server: pid {srv.proc.pid}, {srv.uri}", flush=True)
        out["server"] = {"version": features_of(srv.version()).name, "start_s": round(srv.starts[0], 1),
                         "rss_idle_mb": round(srv.rss() / 2**20)}
        corpus = work / "corpus.jsonl"
        n = corpus_file(corpus, args.docs)
        src = CorpusSource(str(corpus))
        embedder = load_embedder(Settings(precision=args.precision, data_dir=str(work)))
        out["encoder_precision"] = embedder.encoder.precision
        milvus = dict(backend="milvus", milvus_uri=srv.uri)
        with RSSPeak(srv.rss) as peak, IndexJob(embedder, work / "job", "sf", POOLERS, source=src.describe(),
                                                commit_every=1024, progress=False, **milvus) as job:
            summary = job.run(src.records(), total=n)
        names = [c["collection"] for c in summary["collections"]]
        out["index"] = {"documents": n, "job_docs_per_s": summary["docs_per_s"], "job_seconds": summary["seconds"],
                        "tokens": summary["tokens"], "server_peak_rss_mb": round(peak.peak / 2**20),
                        "server_rss_after_mb": round(srv.rss() / 2**20), "collections": names}
        print(f"indexed {n} documents into {out['server']['version']}: {summary['docs_per_s']} docs/s", flush=True)

        faiss_dir, lite = work / "faiss", str(work / "lite" / "lite.db")
        writes: dict[str, dict[str, float]] = {"faiss": {}, "milvus-lite": {}, "milvus-server": {}}
        for name in names:
            with open_collection(work / "job", name, **milvus) as s:
                t0 = time.perf_counter()
                docs, spec = read_all(s), s.spec  # read once, written to each side
                print(f"read {len(docs)} documents of {name} back in {time.perf_counter() - t0:.0f}s", flush=True)
            for side, kw, target in (("faiss", {}, name),
                                     ("milvus-lite", dict(backend="milvus", milvus_uri=lite), name),
                                     ("milvus-server", milvus, name + "-copy")):
                with open_collection(faiss_dir, target, spec, **kw) as d:
                    writes[side][name] = round(copy(docs, spec, d), 1)
            del docs
        out["write_docs_per_s"] = writes
        print("writes (docs/s):", writes, flush=True)

        sides = {"faiss": {"EMBEDPOOL_BACKEND": "faiss"},
                 "milvus-lite": {"EMBEDPOOL_BACKEND": "milvus", "EMBEDPOOL_MILVUS_URI": lite},
                 "milvus-server": {"EMBEDPOOL_BACKEND": "milvus", "EMBEDPOOL_MILVUS_URI": srv.uri}}
        urls = {}
        for side, env in sides.items():
            (work / f"serve-{side}").mkdir(exist_ok=True)
            p, url = serve(env, faiss_dir if side == "faiss" else work / f"serve-{side}", args.precision)
            procs.append(p)
            urls[side] = url
        for (side, url), p in zip(urls.items(), procs):
            wait_ready(url, p)
        qs = queries(args.queries)
        cases = {"single (mean)": (names[0], {}), "two_stage (cluster:pool_factor=4)": (names[1], {"mode": "two_stage"})}
        lat: dict = {}
        same: dict = {}
        with httpx.Client(timeout=120) as c:
            for case, (name, extra) in cases.items():
                lat[case] = {s: [] for s in urls}
                tops: dict = {s: [] for s in urls}
                order = list(urls)
                for qi, q in enumerate(qs):
                    for s in order[qi % 3:] + order[:qi % 3]:  # rotating order
                        t0 = time.perf_counter()
                        r = c.post(f"{urls[s]}/collections/{name}/search", json={"query": q, "k": 10, **extra})
                        lat[case][s].append(time.perf_counter() - t0)
                        assert r.status_code == 200, (s, r.text)
                        tops[s].append([h["id"] for h in r.json()["hits"]])
                same[case] = {s: sum(a == b for a, b in zip(tops[s], tops["faiss"])) for s in urls}
        out["queries"] = len(qs)
        out["latency_ms"] = {case: {s: {"p50": pct(v, 50), "p99": pct(v, 99)} for s, v in d.items()}
                             for case, d in lat.items()}
        out["same_top10_as_faiss"] = same
        out["server"]["rss_after_queries_mb"] = round(srv.rss() / 2**20)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    out["machine"]["loadavg_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")

    print(f"\n{out['server']['version']} server, {n} SciFact documents, {out['queries']} queries over HTTP, k=10, "
          f"encoder {out['encoder_precision']}\n")
    print("| | FAISS | Milvus Lite | Milvus server |\n|---|---|---|---|")
    for case, d in out["latency_ms"].items():
        print(f"| {case} p50 / p99 ms | " + " | ".join(f"{d[s]['p50']} / {d[s]['p99']}" for s in urls) + " |")
        print(f"| {case}: same top 10 as FAISS | " + " | ".join(str(out['same_top10_as_faiss'][case][s]) for s in urls) + " |")
    for name in names:
        print(f"| writes of {name}, docs/s | " + " | ".join(str(writes[s][name]) for s in writes) + " |")
    idx = out["index"]
    print(f"\nindexing job into the server (embedding included): {idx['job_docs_per_s']} docs/s; server RSS: idle "
          f"{out['server']['rss_idle_mb']} MB, peak while indexing {idx['server_peak_rss_mb']} MB, after the queries "
          f"{out['server']['rss_after_queries_mb']} MB")


if __name__ == "__main__":
    main()
