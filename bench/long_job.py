"""The indexing job on long documents: peak RSS and docs/s at default flags, for a corpus and
for twice its size, against the code before (a git revision) in the same run.

The corpus: ``--docs`` documents of ``--parts`` SciFact abstracts each (default 40 x 60, ~20k
tokens a document, ~0.8M tokens), built by ``embedpool eval --synthetic-long``'s builder
(app/evaluation/long.py); the doubled corpus has ``2 * --docs`` documents. Every case is one
``embedpool index`` process with ``mean``, ``tokens:window=true``,
``cluster:pool_factor=4,window=true``, ``--companion-pooler fde:window=true`` and int8 storage, and no
other flag; its peak RSS is the kernel's high-water mark of that process (``wait4``'s
``ru_maxrss``: every allocator, no sampling gaps). The code before runs from a git worktree of
``--before`` (default efa857b, main before issue 21) put first on ``PYTHONPATH``.

Targets (issue 21): peak RSS <= 2.5 GB at both sizes; docs/s within 10% of the code before.

    flock /tmp/embedpool-bench.lock .venv/bin/python bench/long_job.py              # ~40 min on 2 cores
    .venv/bin/python bench/long_job.py --docs 2 --parts 6 --before none           # a smoke run

Writes ``bench/results/long_job.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
DATA = (ROOT / ".." / "shared" / "data").resolve()
RESULTS = HERE / "results" / "long_job.json"
FLAGS = ["--pooler", "mean", "--pooler", "tokens:window=true", "--pooler", "cluster:pool_factor=4,window=true",
         "--companion-pooler", "fde:window=true", "--storage-precision", "int8", "--no-progress", "--json"]
TARGET_RSS_MB, TARGET_SPEED = 2500, 0.90


def write_corpus(path: Path, n_docs: int, parts: int) -> int:
    """``n_docs`` long documents as JSON lines; returns their characters."""
    from embedpool.app.datasets import load_beir
    from embedpool.app.evaluation.long import synthetic_long

    data = synthetic_long(load_beir(DATA / "scifact", "test"), parts - 1, n_queries=None, seed=0, negatives=0)
    recs = data.corpus[:n_docs]
    if len(recs) < n_docs:
        raise SystemExit(f"SciFact gives {len(recs)} long documents, fewer than {n_docs}")
    with open(path, "w") as f:
        for r in recs:
            f.write(json.dumps({"_id": r.id, "text": r.text}) + "\n")
    return sum(len(r.text) for r in recs)


def old_tree(rev: str, work: Path) -> Path:
    """A folder for ``PYTHONPATH`` whose ``embedpool`` package is the code of ``rev`` (a git
    worktree, its three layers linked under the namespace as the editable install maps them)."""
    tree = work / f"tree-{rev}"
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True,
                       capture_output=True)
    shim = work / f"path-{rev}"
    pkg = shim / "embedpool"
    if not pkg.exists():
        pkg.mkdir(parents=True)
        for f in (tree / "embedpool").iterdir():
            (pkg / f.name).symlink_to(f)
        for layer in ("app", "index", "poolers"):
            (pkg / layer).symlink_to(tree / layer)
    return shim


def run_case(corpus: Path, data_dir: Path, pythonpath: Path | None) -> dict:
    """One ``embedpool index`` process: its summary, wall time and peak RSS."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    cmd = [sys.executable, "-m", "embedpool.app.cli", "index", str(corpus), "--data-dir", str(data_dir),
           "--collection", "L", *FLAGS]
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        # `python -m` puts the working directory first on sys.path: the code before runs from its
        # own folder, or this tree's `embedpool/` would be imported instead of it
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=pythonpath or ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err.read().decode()[-3000:]}")
        summary = json.loads(out.read().decode())
    return {"peak_rss_mb": round(usage.ru_maxrss / 1024, 1), "seconds": round(seconds, 1),
            "docs_per_s": round(summary["records"] / summary["seconds"], 5), "tokens": summary["tokens"], "records": summary["records"],
            "bytes_on_disk": summary["bytes_on_disk"], "job_seconds": summary["seconds"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=40)
    ap.add_argument("--parts", type=int, default=60, help="SciFact abstracts per document (default 60)")
    ap.add_argument("--before", default="efa857b", help="git revision of the code before ('none': skip)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/embedpool-bench-long-job"))
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    from scale import machine

    mach = machine()
    print(f"CPU {mach['cpu']}: {' '.join(mach['cpu_flags'])}; torch {mach['torch_cpu_capability']}; "
          f"load {mach['loadavg_start']}", file=sys.stderr)
    args.work.mkdir(parents=True, exist_ok=True)
    sizes = [args.docs, 2 * args.docs]
    corpora = {}
    for n in sizes:
        corpora[n] = args.work / f"long-{n}x{args.parts}.jsonl"
        chars = write_corpus(corpora[n], n, args.parts)
        print(f"corpus {corpora[n].name}: {n} documents, {chars:,} characters", file=sys.stderr)
    codes = {"new": None}
    if args.before != "none":
        codes = {"before": old_tree(args.before, args.work), **codes}
    cases = []
    for code, path in codes.items():
        for n in sizes if code == "new" else sizes[:1]:  # the code before: the first size (its RSS grows)
            d = args.work / f"data-{code}-{n}"
            shutil.rmtree(d, ignore_errors=True)
            print(f"running {code} on {n} documents ...", file=sys.stderr, flush=True)
            r = {"code": code, "revision": args.before if code == "before" else "working tree", "docs": n,
                 **run_case(corpora[n], d, path)}
            print(f"  {r}", file=sys.stderr, flush=True)
            cases.append(r)
            shutil.rmtree(d, ignore_errors=True)
    before = next((c for c in cases if c["code"] == "before"), None)
    for c in cases:
        c["speed_vs_before"] = round(c["docs_per_s"] / before["docs_per_s"], 3) if before else None
    new = [c for c in cases if c["code"] == "new"]
    targets = {"peak_rss_le_2500_mb": all(c["peak_rss_mb"] <= TARGET_RSS_MB for c in new),
               "docs_per_s_within_10pct": None if before is None else all(
                   c["speed_vs_before"] >= TARGET_SPEED for c in new)}
    out = {"machine": mach, "flags": FLAGS, "parts": args.parts, "cases": cases, "targets": targets,
           "loadavg_end": os.getloadavg()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(table(out))
    return 0


def table(out: dict) -> str:
    from embedpool.app.tables import render_table

    rows = [[f"{c['code']} ({c['revision']})", str(c["docs"]), f"{c['tokens']:,}", f"{c['peak_rss_mb']:,.0f}",
             f"{c['seconds']:.0f}", f"{c['docs_per_s']:.4f}",
             "" if c["speed_vs_before"] is None else f"{c['speed_vs_before']:.2f}x"] for c in out["cases"]]
    lines = [f"CPU flags {' '.join(out['machine']['cpu_flags'])}; {out['parts']} abstracts a document; "
             f"flags: {' '.join(out['flags'])}", "",
             render_table(["code", "documents", "tokens", "peak RSS MB", "seconds", "docs/s", "vs before"], rows,
                          markdown=True)]
    t = out["targets"]
    lines += ["", f"peak RSS <= {TARGET_RSS_MB} MB at both sizes: {'met' if t['peak_rss_le_2500_mb'] else 'missed'}; "
              f"docs/s within 10% of before: "
              + ("not measured" if t["docs_per_s_within_10pct"] is None else
                 "met" if t["docs_per_s_within_10pct"] else "missed")]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
