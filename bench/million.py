"""A million documents in one collection (issue 23): build, open, search, delete + compact.

Encoding a million documents takes hours on 2 cores, so the documents are synthetic but made of
real vectors (``tests/synthetic_corpus.py``): SciFact documents pooled once by the real default model
with ``cluster:pool_factor=16`` (~20 vectors per document) plus their ``mean``, cached, then
recombined and perturbed into new documents whose companion is the ``mean`` of their vectors.
Queries are the real SciFact test queries (all their token vectors, and their ``mean``): held out,
never in a training sample.

Layouts, each built through the public index interface (``open_collection``, ``add``,
``commit``) in a process of its own, so each peak RSS is its own:

- ``multi``: int8 token vectors + the collection's own ``mean`` companion rows (FAISS factory
  ``--factory``, trained on the first batch -- a sample -- of the corpus);
- ``single``: the ``mean`` vector alone, same factory.

The collections grow in steps (``--sizes``, default 100k, 300k, 1M): each step is a new process
that reopens the collection and appends (so appending to a big collection is what is timed);
after each step, a fresh process opens it (time, RSS over the process's baseline) and searches
(``two_stage``, 100 candidates, one query per call; p50/p99) and measures the companion factory's
recall@100 against exact inner-product search over the same mean vectors. At the last size it
deletes 10% of the documents, compacts (peak RSS), builds the remaining 90% fresh, and compares
both (ids, vectors, exhaustive MaxSim top-10). ``--http`` also starts ``embedpool serve`` over
the data dir and searches through HTTP (query embedding included).

    flock /tmp/embedpool-bench.lock .venv/bin/python bench/million.py encode      # once, ~5 min
    flock /tmp/embedpool-bench.lock .venv/bin/python bench/million.py run --sizes 100000
    flock /tmp/embedpool-bench.lock .venv/bin/python bench/million.py run --http  # to 1M, ~1 h

Data under ``bench/.scale-data`` (gitignored; ``--data``); writes ``bench/results/million.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))  # the synthetic corpus the index tests use too
DATA = HERE / ".scale-data"
SOURCES = HERE / "results" / "cache" / "million_sources.npz"
RESULTS = HERE / "results" / "million.json"
POOLER = "cluster:pool_factor=16"
COMPANION = "mean"
SIZES = (100_000, 300_000, 1_000_000)
TARGETS = {"build_rss_mb": 3072, "build_ratio": 1.3, "open_s": 2.0, "open_rss_mb": 500,
           "p50_ms": 50, "p99_ms": 200, "recall": 0.95}


def rss_mb() -> float:
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return 0.0


def rss_parts(pid: int | str = "self") -> dict[str, float]:
    """What the process holds: its anonymous memory (its own) and its resident file pages
    (mapped page cache: segment codes, libraries), MB."""
    out = {}
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(("RssAnon", "RssFile")):
            out[line.split(":")[0]] = round(int(line.split()[1]) / 1024, 1)
    return {"anon_mb": out.get("RssAnon", 0.0), "file_mb": out.get("RssFile", 0.0)}


def page_cache_mb(folder: Path) -> dict[str, float]:
    """What the page cache holds of a collection's files (``mincore`` over a fresh mapping,
    which faults nothing in), MB, with the files' total size."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    cached = total = 0
    for f in Path(folder).iterdir():
        size = f.stat().st_size if f.is_file() else 0
        total += size
        if not size:
            continue
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                continue
            vec = np.zeros((size + page - 1) // page, np.uint8)
            if libc.mincore(addr, size, vec.ctypes.data) == 0:
                cached += int((vec & 1).sum()) * page
            libc.munmap(addr, size)
        finally:
            os.close(fd)
    return {"page_cache_mb": round(cached / 2**20, 1), "files_mb": round(total / 2**20, 1)}


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


# ---------------------------------------------------------------------- sources
def encode(args) -> int:
    """Pool every SciFact document once with the real model (bench/scifact_data.py's cache)."""
    from scifact_data import EmbeddingCache, load_scifact, scifact_queries

    sf = load_scifact(args.source_docs)
    cache = EmbeddingCache(threads=args.threads)
    docs = cache.embed("scifact", sf.doc_ids, sf.doc_texts, (POOLER, COMPANION), "document")
    q = scifact_queries(load_scifact(None), cache)
    SOURCES.parent.mkdir(parents=True, exist_ok=True)
    vecs = docs[POOLER]
    np.savez(SOURCES, pool=np.concatenate(vecs).astype(np.float32), lens=np.array([len(v) for v in vecs]),
             mean=np.stack(docs[COMPANION]).astype(np.float32),
             q_tokens=np.concatenate(q["tokens"]).astype(np.float32),
             q_lens=np.array([len(v) for v in q["tokens"]]), q_mean=np.stack(q["mean"]).astype(np.float32),
             q_texts=np.array(load_scifact(None).query_texts), model=np.array(cache.embedder().encoder.model_id))
    print(f"{len(vecs)} documents, {sum(len(v) for v in vecs)} vectors, {len(q['tokens'])} queries -> {SOURCES}")
    return 0


def load_sources():
    z = np.load(SOURCES)
    lens = z["lens"]
    docs = np.split(z["pool"], np.cumsum(lens)[:-1])
    queries = np.split(z["q_tokens"], np.cumsum(z["q_lens"])[:-1])
    return docs, queries, z["q_mean"], [str(t) for t in z["q_texts"]], str(z["model"])


def corpus(seed: int = 0):
    from synthetic_corpus import SyntheticCorpus

    docs, *_ = load_sources()
    return SyntheticCorpus(docs, seed=seed)


def spec_for(layout: str, factory: str, model: str):
    from embedpool.index import CollectionSpec

    if layout == "multi":
        return CollectionSpec(kind="multi", model=model, pooler=POOLER, dim=384, precision="int8",
                              companion_pooler=COMPANION, companion_dim=384, companion_factory=factory)
    return CollectionSpec(kind="single", model=model, pooler=COMPANION, dim=384, factory=factory)


def deleted(nums: np.ndarray) -> np.ndarray:
    """The 10% of documents the compaction step deletes (every tenth, from document 3)."""
    return np.asarray(nums) % 10 == 3


# ---------------------------------------------------------------------- build
def build(args) -> int:
    """Grow collection ``args.name`` to ``args.docs`` documents (appending to what it has)."""
    from embedpool.index import open_collection
    from embedpool.index.faiss.single import recommended_training_vectors

    *_, model = load_sources()
    gen = corpus()
    base_rss = rss_mb()
    coll = open_collection(args.data, args.name, spec_for(args.layout, args.factory, model), backend="faiss")
    start = len(coll)
    keep = (lambda n: ~deleted(n)) if args.keep_90 else None
    # the first batch trains the companion / single index: FAISS's recommended sample size
    train = recommended_training_vectors(args.factory) if start == 0 else 0
    pending_bytes, t0, marks, commits = 0, time.perf_counter(), [], []
    step_t, done = t0, start
    buf_ids, buf_docs, buf_comp = [], [], []
    if args.keep_90 and start:
        raise SystemExit(f"--keep-90 builds a new collection; {args.name!r} has {start} documents")
    next_mark = (start // 100_000 + 1) * 100_000
    def flush() -> None:
        nonlocal pending_bytes
        comp = np.concatenate(buf_comp)
        if args.layout == "multi":
            coll.add(buf_ids, buf_docs, companion=comp)
            pending_bytes += sum(len(d) for d in buf_docs) * 388  # int8 codes + scale
        else:
            coll.add(buf_ids, comp)
            pending_bytes += len(comp) * 384 * 4
        buf_ids.clear(), buf_docs.clear(), buf_comp.clear()
        if pending_bytes >= args.commit_mb << 20:
            tc = time.perf_counter()
            coll.commit()
            commits.append(round(time.perf_counter() - tc, 3))
            pending_bytes = 0

    for bt in gen.batches(args.docs, keep):
        if bt.start < start:  # appending: the documents it has are the first ones
            continue
        buf_ids += bt.ids
        if args.layout == "multi":
            buf_docs += bt.docs
        buf_comp.append(bt.companion)
        if sum(map(len, buf_comp)) < train:
            continue
        train = 0
        flush()
        done = bt.start + 1000
        if done >= next_mark:
            next_mark += 100_000
            now = time.perf_counter()
            marks.append({"docs": done, "s": round(now - step_t, 2), "rss_mb": round(rss_mb(), 1),
                          "peak_rss_mb": round(peak_mb(), 1)})
            print(json.dumps(marks[-1]), file=sys.stderr, flush=True)
            step_t = now
    if buf_ids:
        flush()
    tc = time.perf_counter()
    coll.commit()
    commits.append(round(time.perf_counter() - tc, 3))
    out = {"layout": args.layout, "name": args.name, "from": start, "to": len(coll),
           "seconds": round(time.perf_counter() - t0, 2), "per_100k": marks, "commit_s": commits,
           "baseline_rss_mb": round(base_rss, 1), "peak_rss_mb": round(peak_mb(), 1),
           "stats": coll.stats()}
    coll.close()
    print(json.dumps(out))
    return 0


# ---------------------------------------------------------------------- measure
def exact_top(gen, n_docs: int, q: np.ndarray, k: int, keep=None) -> list[set[str]]:
    """Exact inner-product top-k over the companion vectors of the first ``n_docs`` documents."""
    best_s = np.full((len(q), 0), -np.inf, np.float32)
    best_i = np.zeros((len(q), 0), np.int64)
    for bt in gen.batches(n_docs, keep):
        s = q @ bt.companion.T
        nums = np.array([int(i[1:]) for i in bt.ids])
        cs, ci = np.concatenate([best_s, s], 1), np.concatenate([best_i, np.broadcast_to(nums, s.shape)], 1)
        top = np.argpartition(-cs, min(k, cs.shape[1] - 1), axis=1)[:, :k]
        best_s, best_i = np.take_along_axis(cs, top, 1), np.take_along_axis(ci, top, 1)
    return [{f"d{i}" for i in row} for row in best_i]


def measure(args) -> int:
    """Open (time, RSS over baseline), search p50/p99, companion recall@100."""
    from embedpool.index import open_collection

    _, queries, q_mean, _, _ = load_sources()
    import faiss  # noqa: F401  (imported before the baseline: part of any process that opens one)

    base, base_parts = rss_mb(), rss_parts()
    t = time.perf_counter()
    coll = open_collection(args.data, args.name, None, backend="faiss")
    open_s = time.perf_counter() - t
    after_open = rss_mb()
    out = {"layout": args.layout, "name": args.name, "docs": len(coll), "open_s": round(open_s, 3),
           "baseline_rss_mb": round(base, 1), "rss_after_open_mb": round(after_open, 1),
           "open_rss_growth_mb": round(after_open - base, 1), "baseline_parts": base_parts,
           "after_open_parts": rss_parts()}
    nq = len(queries)
    lat = []
    for rep in range(2):  # the first pass warms the page cache of the candidates' pages
        for i in range(nq):
            t = time.perf_counter()
            if args.layout == "multi":
                hits = coll.search([queries[i]], k=10, mode="two_stage", candidates=100,
                                   companion_queries=q_mean[i:i + 1])
            else:
                hits = coll.search(q_mean[i:i + 1], k=10)
            if rep:
                lat.append((time.perf_counter() - t) * 1000)
            assert hits[0]
    out.update(p50_ms=round(pct(lat, 50), 2), p99_ms=round(pct(lat, 99), 2), queries=nq, searches=2 * nq,
               rss_after_search_mb=round(rss_mb(), 1), after_search_parts=rss_parts(),
               collection_files=page_cache_mb(Path(args.data) / args.name))
    if args.layout == "single":  # the factory's recall@100 against exact search, same vectors
        got = [{h.id for h in r} for r in coll.search(q_mean, k=100)]
        want = exact_top(corpus(), out["docs"], q_mean, 100)
        out["recall_at_100"] = round(float(np.mean([len(g & w) / 100 for g, w in zip(got, want)])), 4)
    out["peak_rss_mb"] = round(peak_mb(), 1)
    coll.close()
    print(json.dumps(out))
    return 0


# ---------------------------------------------------------------------- delete + compact
def compact(args) -> int:
    from embedpool.index import open_collection

    coll = open_collection(args.data, args.name, None, backend="faiss")
    n = len(coll)
    gone = [f"d{i}" for i in np.flatnonzero(deleted(np.arange(n)))]
    t = time.perf_counter()
    for a in range(0, len(gone), 10_000):
        coll.delete(gone[a:a + 10_000])
    coll.commit()
    del_s = time.perf_counter() - t
    peak_before = peak_mb()
    t = time.perf_counter()
    coll.compact()
    out = {"name": args.name, "docs_before": n, "deleted": len(gone), "docs_after": len(coll),
           "delete_s": round(del_s, 2), "compact_s": round(time.perf_counter() - t, 2),
           "peak_rss_before_compact_mb": round(peak_before, 1), "peak_rss_mb": round(peak_mb(), 1),
           "stats": coll.stats()}
    coll.close()
    print(json.dumps(out))
    return 0


def compare(args) -> int:
    """The compacted collection against a fresh build of the same 90%: ids, a sample of
    documents' vectors, exhaustive MaxSim top-10."""
    from embedpool.index import open_collection

    _, queries, _, _, _ = load_sources()
    a = open_collection(args.data, args.name, None, backend="faiss")
    b = open_collection(args.data, args.other, None, backend="faiss")
    ids_a, ids_b = a.ids(), b.ids()
    out = {"ids_equal": ids_a == ids_b, "docs": len(ids_a)}
    rng = np.random.default_rng(0)
    sample = [ids_a[i] for i in rng.choice(len(ids_a), 200, replace=False)]
    got = [(a.get(i), b.get(i)) for i in sample]
    out["vectors_equal"] = all(np.array_equal(x["vectors"], y["vectors"]) for x, y in got)
    # companion rows as stored: a quantizing factory (SQ8) trained on another sample rounds them
    # differently, so this is a cosine, not an equality
    out["companion_cos_min"] = round(min(float(x["companion"][0] @ y["companion"][0]) for x, y in got), 5)
    same = []
    for q in queries[:args.exhaustive_queries]:
        ha, hb = a.search([q], k=10)[0], b.search([q], k=10)[0]
        same.append([h.id for h in ha] == [h.id for h in hb] and
                    np.allclose([h.score for h in ha], [h.score for h in hb], atol=1e-5))
    out["exhaustive_top10_equal"] = f"{sum(same)}/{len(same)}"
    out["equal"] = out["ids_equal"] and out["vectors_equal"] and all(same)
    a.close()
    b.close()
    print(json.dumps(out))
    return 0


# ---------------------------------------------------------------------- HTTP
def http(args) -> int:
    """``embedpool serve`` over the data dir; two_stage search of each query text through HTTP."""
    import httpx
    import psutil

    *_, texts, _ = load_sources()
    port = 18000 + os.getpid() % 1000
    env = {**os.environ, "EMBEDPOOL_DATA_DIR": str(args.data), "EMBEDPOOL_PORT": str(port)}
    log = open(Path(args.data) / "serve.log", "w")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "embedpool"), "serve", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=120) as c:
            for _ in range(600):
                try:
                    if c.get(f"{url}/health").json().get("status") == "ready":
                        break
                except Exception:
                    pass
                time.sleep(0.5)
            rss_ready = psutil.Process(proc.pid).memory_info().rss / 2**20
            body = {"mode": "two_stage", "candidates": 100, "k": 10, "include_text": False}
            lat = []
            for rep in range(2):
                for t in texts:
                    t0 = time.perf_counter()
                    r = c.post(f"{url}/collections/{args.name}/search", json={**body, "query": t})
                    r.raise_for_status()
                    if rep:
                        lat.append((time.perf_counter() - t0) * 1000)
            rss = psutil.Process(proc.pid).memory_info().rss / 2**20
            parts = rss_parts(proc.pid)
        out = {"name": args.name, "http_p50_ms": round(pct(lat, 50), 2), "http_p99_ms": round(pct(lat, 99), 2),
               "queries": len(lat), "server_rss_ready_mb": round(rss_ready, 1),
               "server_rss_after_search_mb": round(rss, 1), "server_after_search_parts": parts,
               "collection_files": page_cache_mb(Path(args.data) / args.name)}
    finally:
        proc.terminate()
        proc.wait(30)
    print(json.dumps(out))
    return 0


# ---------------------------------------------------------------------- driver
def phase(*argv: str) -> dict:
    """Run one phase in a process of its own; its JSON line."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv]
    print("$", " ".join(cmd[1:]), file=sys.stderr, flush=True)
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if r.returncode:
        raise SystemExit(f"phase {argv[0]} failed ({r.returncode})")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps(res)[:1500], file=sys.stderr, flush=True)
    return res


def machine() -> dict:
    from embedpool.cpu import cpu_features
    from scale import machine as scale_machine

    info = scale_machine()
    f = cpu_features()
    info["all_cpu_flags"] = sorted(f.flags)
    print(f"CPU: {info['cpu']} ({f.summary()}); torch capability {info['torch_cpu_capability']}", flush=True)
    print(f"flags: {' '.join(info['cpu_flags'])}", flush=True)
    return info


def run(args) -> int:
    res = {"machine": machine(), "factory": args.factory, "sizes": args.sizes, "steps": [],
           "targets": TARGETS}
    common = ["--data", str(args.data), "--factory", args.factory]

    def save():
        res["machine"]["loadavg_end"] = os.getloadavg()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2) + "\n")

    for n in args.sizes:
        step = {"docs": n}
        for layout in args.layouts:
            name = f"m-{layout}"
            step[f"build_{layout}"] = phase("build", *common, "--layout", layout, "--name", name, "--docs", str(n),
                                            "--commit-mb", str(args.commit_mb))
            step[f"measure_{layout}"] = phase("measure", *common, "--layout", layout, "--name", name)
        if args.http and n == args.sizes[-1]:
            step["http"] = phase("http", *common, "--name", "m-multi")
        res["steps"].append(step)
        save()
    if args.compact:
        n = args.sizes[-1]
        res["compact"] = phase("compact", *common, "--name", "m-multi")
        res["fresh_90"] = phase("build", *common, "--layout", "multi", "--name", "m-multi-90", "--docs", str(n),
                                "--keep-90", "--commit-mb", str(args.commit_mb))
        res["compare"] = phase("compare", *common, "--name", "m-multi", "--other", "m-multi-90")
        save()
    print(table(res))
    return 0


def table(res: dict) -> str:
    lines = ["| docs | layout | build s/100k first / last | build peak RSS MB | open s | RSS after open (over baseline) MB "
             "| p50 / p99 ms | recall@100 | RSS after 600 searches MB: anon + file | page cache: collection files MB |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for st in res["steps"]:
        for layout in ("multi", "single"):
            b, m = st.get(f"build_{layout}"), st.get(f"measure_{layout}")
            if not b:
                continue
            marks = b["per_100k"]
            speed = f"{marks[0]['s']:.1f} / {marks[-1]['s']:.1f}" if marks else "-"
            lines.append(f"| {st['docs']:,} | {layout} | {speed} | {b['peak_rss_mb']:,.0f} | {m['open_s']:.2f} | "
                         f"{m['rss_after_open_mb']:,.0f} (+{m['open_rss_growth_mb']:,.0f}) | "
                         f"{m['p50_ms']:.1f} / {m['p99_ms']:.1f} | {m.get('recall_at_100', '-')} | {_held(m)} |")
        if "http" in st:
            h = st["http"]
            parts = h.get("server_after_search_parts")
            held = f"{h['server_rss_after_search_mb']:,.0f}" + (
                f" ({parts['anon_mb']:,.0f} + {parts['file_mb']:,.0f})" if parts else "")
            cache = h.get("collection_files")
            lines.append(f"| {st['docs']:,} | multi, HTTP | | | | server at ready {h['server_rss_ready_mb']:,.0f} | "
                         f"{h['http_p50_ms']:.1f} / {h['http_p99_ms']:.1f} | | server {held} | "
                         + (f"{cache['page_cache_mb']:,.0f} of {cache['files_mb']:,.0f} |" if cache else "|"))
    return "\n".join(lines)


def _held(m: dict) -> str:
    """'RSS after searches (anon + file) | page cache of the collection's files' cells."""
    p, c = m.get("after_search_parts"), m.get("collection_files")
    if not p:
        return f"{m['rss_after_search_mb']:,.0f} | "
    return (f"{m['rss_after_search_mb']:,.0f} ({p['anon_mb']:,.0f} + {p['file_mb']:,.0f}) | "
            f"{c['page_cache_mb']:,.0f} of {c['files_mb']:,.0f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    enc = sub.add_parser("encode", help="pool the SciFact documents once (cached)")
    enc.add_argument("--source-docs", type=int, default=None)
    enc.add_argument("--threads", type=int, default=2)
    ps = {c: sub.add_parser(c) for c in ("run", "build", "measure", "compact", "compare", "http")}
    for p in ps.values():
        p.add_argument("--data", type=Path, default=DATA)
        p.add_argument("--factory", default="IVF1024,SQ8")
        p.add_argument("--name", default="m-multi")
        p.add_argument("--layout", choices=["multi", "single"], default="multi")
        p.add_argument("--commit-mb", type=int, default=256, help="commit every this many MB of vectors")
    ps["run"].add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ps["run"].add_argument("--layouts", nargs="+", default=["multi", "single"])
    ps["run"].add_argument("--http", action="store_true")
    ps["run"].add_argument("--compact", action="store_true")
    ps["run"].add_argument("--out", type=Path, default=RESULTS)
    ps["build"].add_argument("--docs", type=int, required=True)
    ps["build"].add_argument("--keep-90", action="store_true")
    ps["compare"].add_argument("--other", required=True)
    ps["compare"].add_argument("--exhaustive-queries", type=int, default=5)
    args = ap.parse_args(argv)
    return {"encode": encode, "run": run, "build": build, "measure": measure, "compact": compact,
            "compare": compare, "http": http}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
