"""The companion index read into memory (today) against mapped in place (FAISS' ``IO_FLAG_MMAP_IFC``).

At a million documents a FAISS collection's ``IVF1024,SQ8`` companion is ~400 MB of codes and
ids, read whole into the process when the collection opens (docs/scale.md: +412 MB over the
baseline, 2.22 s with the file out of the page cache). FAISS 1.10+ can instead map an
``ArrayInvertedLists`` file in place: the lists become views of the file's pages, read when a
search probes them and held by the page cache, not the process. This benchmark measures what
that would change before the collection code is redesigned for it (a mapped list cannot be
written -- FAISS aborts the process on ``add`` or ``remove_ids`` -- so deltas, new rows and
tombstones would need a second, in-memory index beside the mapped base):

- ``build``: an ``IVF1024,SQ8`` inner-product index over ``--rows`` normalized random vectors of
  ``--dim`` components (the companion's factory and metric; random vectors spread rows evenly
  over the lists, as the SciFact-derived ones of ``bench/million.py`` nearly do), written once;
- per mode (``read``: ``faiss.read_index`` as collections open it; ``mmap``:
  ``IO_FLAG_MMAP_IFC``), cold (the file's pages dropped from the page cache with
  ``posix_fadvise(DONTNEED)`` first) and warm, in a fresh process each: open seconds, the
  process' anonymous and file-backed RSS over its baseline after open and after ``--searches``
  single-query searches (``k=100``, the collections' default ``nprobe``: 1/4 of the lists),
  p50/p99 ms, and what the page cache holds of the file. Both modes must return the same ids.

    flock /tmp/embedpool-bench.lock .venv/bin/python bench/companion_mmap.py

Writes ``bench/results/companion_mmap.json``; the file under ``bench/.scale-data`` (gitignored).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from million import machine, page_cache_mb, pct, rss_parts  # noqa: E402

DATA = HERE / ".scale-data" / "companion-mmap"
RESULTS = HERE / "results" / "companion_mmap.json"
FACTORY = "IVF1024,SQ8"


def build(args) -> Path:
    import faiss

    path = args.data / f"ivf1024-sq8-{args.rows}x{args.dim}" / "companion.faiss"  # alone in its folder
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)

    def block(n: int) -> np.ndarray:
        x = rng.standard_normal((n, args.dim), dtype=np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    idx = faiss.index_factory(args.dim, FACTORY, faiss.METRIC_INNER_PRODUCT)
    idx.train(block(64 * 1024))
    for a in range(0, args.rows, 100_000):
        n = min(100_000, args.rows - a)
        idx.add_with_ids(block(n), np.arange(a, a + n, dtype=np.int64))
    tmp = path.with_suffix(".tmp")
    faiss.write_index(idx, str(tmp))
    os.replace(tmp, path)
    return path


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def open_phase(args) -> int:
    """One mode in this (fresh) process: a JSON line."""
    import faiss

    from embedpool.index.faiss.single import default_nprobe

    path = Path(args.path)
    rng = np.random.default_rng(1)
    queries = rng.standard_normal((args.searches, args.dim), dtype=np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    faiss.omp_set_num_threads(1)  # one query per call, as a server's request does
    if args.cold:
        drop_cache(path)
    cache_before = page_cache_mb_of(path)
    base = rss_parts()
    t = time.perf_counter()
    idx = faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC if args.mode == "mmap" else 0)
    open_s = time.perf_counter() - t
    after_open = rss_parts()
    ivf = faiss.extract_index_ivf(idx)
    ivf.nprobe = default_nprobe(ivf.nlist)
    times, first = [], None
    for q in queries:
        t = time.perf_counter()
        _, ids = idx.search(q[None, :], 100)
        times.append((time.perf_counter() - t) * 1000)
        if first is None:
            first = ids
    _, check = idx.search(queries[:20], 10)
    after = rss_parts()

    def over(now: dict) -> dict:
        return {k: round(now[k] - base[k], 1) for k in now}

    print(json.dumps({"mode": args.mode, "cold": args.cold, "open_s": round(open_s, 3),
                      "page_cache_before_mb": cache_before, "rss_after_open": over(after_open),
                      "rss_after_searches": over(after), "p50_ms": round(pct(times, 50), 2),
                      "p99_ms": round(pct(times, 99), 2), "page_cache_after_mb": page_cache_mb_of(path),
                      "check_ids": check.tolist()}))
    return 0


def page_cache_mb_of(path: Path) -> float:
    """What the page cache holds of ``path``, MB (``million.page_cache_mb`` of its folder, which
    holds only it)."""
    return page_cache_mb(path.parent)["page_cache_mb"] if path.parent.is_dir() else 0.0


def run(args) -> int:
    info = machine()
    path = build(args)
    size_mb = round(path.stat().st_size / 2**20, 1)
    print(f"{FACTORY}, {args.rows:,} rows x {args.dim}: {size_mb} MB", flush=True)
    cases = []
    for rep in range(args.reps):
        for cold in (True, False):
            for mode in ("read", "mmap"):
                cmd = [sys.executable, __file__, "open", "--path", str(path), "--mode", mode,
                       "--dim", str(args.dim), "--searches", str(args.searches)] + (["--cold"] if cold else [])
                out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout
                case = json.loads(out.strip().splitlines()[-1])
                case["rep"] = rep
                cases.append(case)
                print(json.dumps({k: v for k, v in case.items() if k != "check_ids"}), flush=True)
    same = all(c["check_ids"] == cases[0]["check_ids"] for c in cases)
    for c in cases:
        c.pop("check_ids")
    rows = []
    for cold in (True, False):
        best = {}
        for mode in ("read", "mmap"):
            mine = [c for c in cases if c["mode"] == mode and c["cold"] == cold]
            best[mode] = min(mine, key=lambda c: c["open_s"])
        r, m = best["read"], best["mmap"]
        rows.append({"cold": cold, "read": r, "mmap": m,
                     "open_ratio_mmap_over_read": round(m["open_s"] / max(r["open_s"], 1e-9), 3),
                     "p50_ratio_mmap_over_read": round(m["p50_ms"] / r["p50_ms"], 3)})
    res = {"machine": info, "factory": FACTORY, "rows": args.rows, "dim": args.dim,
           "file_mb": size_mb, "searches": args.searches, "reps": args.reps,
           "same_results": same, "cases": cases, "summary": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(table(res))
    return 0 if same else 1


def table(res: dict) -> str:
    lines = [f"{res['factory']}, {res['rows']:,} rows x {res['dim']} ({res['file_mb']} MB file), "
             f"{res['searches']} searches, best open of {res['reps']}; same results: {res['same_results']}",
             "| page cache | mode | open s | RSS after open MB: anon + file | after searches: anon + file "
             "| p50 / p99 ms | page cache after MB |", "|---|---|---:|---|---|---|---:|"]
    for row in res["summary"]:
        for mode in ("read", "mmap"):
            c = row[mode]
            lines.append(f"| {'cold' if row['cold'] else 'warm'} | {mode} | {c['open_s']:.3f} | "
                         f"{c['rss_after_open']['anon_mb']} + {c['rss_after_open']['file_mb']} | "
                         f"{c['rss_after_searches']['anon_mb']} + {c['rss_after_searches']['file_mb']} | "
                         f"{c['p50_ms']} / {c['p99_ms']} | {c['page_cache_after_mb']} |")
        lines.append(f"| {'cold' if row['cold'] else 'warm'} | mmap / read | {row['open_ratio_mmap_over_read']}x "
                     f"| | | p50 {row['p50_ratio_mmap_over_read']}x | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    op = sub.add_parser("open")
    op.add_argument("--path", required=True)
    op.add_argument("--mode", choices=["read", "mmap"], required=True)
    op.add_argument("--cold", action="store_true")
    for p in (ap, op):
        p.add_argument("--dim", type=int, default=384)
        p.add_argument("--searches", type=int, default=600)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    return open_phase(args) if args.cmd == "open" else run(args)


if __name__ == "__main__":
    raise SystemExit(main())
