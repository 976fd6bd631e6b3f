"""The index job's runners side by side (issue 15): ``embedpool index`` over the SciFact corpus
with ``mean`` + ``cluster:pool_factor=4``, in-process vs ``--runner ray`` with 1 and 2 workers, in
one run (``bench/index.py --runners``).

Every side is the real command in a child process of its own (a fresh data dir, the same corpus,
the same poolers, the same 2 cores): the in-process job on torch's default threads, Ray with 1
worker of 2 threads and with 2 workers of 1 thread (the local Ray the driver starts itself). A
sampler reads the kernel's RSS high-water mark (``VmHWM``) of the driver and of every Ray
embedding worker (``ray::MapWorker`` processes under the driver) every 0.2 s. Reported per side:
docs/s of the job (its own clock: from the first block asked for to the last commit, model
loading of the workers included for Ray, the driver's model load excluded on both sides), docs/s
of the whole command (wall clock, process start to exit: Ray's start-up included), and peak RSS.

    flock /tmp/embedpool-bench.lock .venv/bin/python bench/index.py --runners [--docs N]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POOLERS = ("mean", "cluster:pool_factor=4")
SIDES = (("in-process", []),
         ("ray, 1 worker x 2 threads", ["--runner", "ray", "--workers", "1", "--worker-threads", "2"]),
         ("ray, 2 workers x 1 thread", ["--runner", "ray", "--workers", "2", "--worker-threads", "1"]))


def _hwm_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _embedding_workers(root) -> list:
    import psutil

    out = []
    for p in root.children(recursive=True):
        try:
            if "MapWorker" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            continue
    return out


def run_side(corpus: Path, data_dir: Path, extra: list[str], commit_every: int) -> dict:
    """One ``embedpool index`` child; its summary, wall time and peak RSS (driver, workers)."""
    import psutil

    cmd = [sys.executable, "-m", "embedpool.app.cli", "index", str(corpus), "--data-dir", str(data_dir),
           "--collection", "sf", *sum((["--pooler", p] for p in POOLERS), []), "--commit-every",
           str(commit_every), "--no-progress", "--json", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root = psutil.Process(proc.pid)
    driver, workers, n = 0.0, {}, 0
    while proc.poll() is None:
        driver = max(driver, _hwm_mb(proc.pid) or 0.0)
        if n % 10 == 0:  # new workers are rare: look for them every 2 s
            for w in _embedding_workers(root):
                workers.setdefault(w.pid, 0.0)
        for pid in workers:
            workers[pid] = max(workers[pid], _hwm_mb(pid) or 0.0)
        n += 1
        time.sleep(0.2)
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    s = json.loads(out)
    return {"command": " ".join(cmd[2:]), "summary": s, "wall_s": round(wall, 1),
            "job_docs_per_s": s["docs_per_s"], "wall_docs_per_s": round(s["indexed_this_run"] / wall, 2),
            "driver_peak_rss_mb": round(driver), "worker_peak_rss_mb": [round(v) for v in workers.values()],
            "loadavg_1m_end": round(os.getloadavg()[0], 2)}


def _corpus(docs: int | None, tmp: Path, scifact: Path) -> Path:
    if not docs:
        return scifact / "corpus.jsonl"
    path = tmp / f"scifact-{docs}.jsonl"
    with open(scifact / "corpus.jsonl") as f, open(path, "w") as out:
        for _, line in zip(range(docs), f):
            out.write(line)
    return path


def bench_runners(scifact: Path, docs: int | None, commit_every: int = 1024) -> dict:
    """Every side of :data:`SIDES` over the corpus (first ``docs`` documents), one after another."""
    res: dict = {"poolers": list(POOLERS), "docs_arg": docs, "sides": {}}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = _corpus(docs, Path(tmp), scifact)
        for label, extra in SIDES:
            load = round(os.getloadavg()[0], 2)
            print(f"  {label} ... (load {load})", file=sys.stderr, flush=True)
            r = run_side(corpus, Path(tmp) / label.replace(" ", "_").replace(",", ""), extra, commit_every)
            res["sides"][label] = {**r, "loadavg_1m_start": load}
            print(f"    {r['job_docs_per_s']} docs/s (job), {r['wall_docs_per_s']} (wall), driver "
                  f"{r['driver_peak_rss_mb']} MB, workers {r['worker_peak_rss_mb']} MB", file=sys.stderr, flush=True)
    base = res["sides"]["in-process"]
    for r in res["sides"].values():
        r["job_x_in_process"] = round(r["job_docs_per_s"] / base["job_docs_per_s"], 3)
        r["wall_x_in_process"] = round(r["wall_docs_per_s"] / base["wall_docs_per_s"], 3)
    res["documents"] = base["summary"]["records"]
    return res


def machine() -> dict:
    """CPU model and vector flags, torch's CPU capability, load average."""
    import platform

    import torch

    model, flags = platform.processor(), set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    return {"cpu": model, "cpus": os.cpu_count(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_flags": sorted(f for f in flags if f.startswith(("avx", "amx", "fma")) or f == "f16c"),
            "loadavg_start": [round(x, 2) for x in os.getloadavg()]}


def markdown(res: dict) -> str:
    from embedpool.app.tables import render_table

    rows = [[label, r["summary"]["records"], r["job_docs_per_s"], f"{r['job_x_in_process']:.2f}x",
             r["wall_docs_per_s"], f"{r['wall_x_in_process']:.2f}x", r["driver_peak_rss_mb"],
             " / ".join(str(x) for x in r["worker_peak_rss_mb"]) or "-",
             f"{r['loadavg_1m_start']} / {r['loadavg_1m_end']}"]
            for label, r in res["sides"].items()]
    return render_table(["runner", "docs", "docs/s (job)", "x in-process", "docs/s (wall)", "x in-process",
                         "driver peak RSS MB", "worker peak RSS MB", "load start / end"], rows, markdown=True)
