"""The index job on a Ray cluster of containers vs the in-process job of the same image (issue 25):
the first 1,000 SciFact documents, ``mean`` + ``cluster:pool_factor=4``, in one run.

Sides: ``embedpool index`` in one container of the Ray image (in-process runner), and the same
command with ``--runner ray`` on the head of a cluster of a head (no CPUs) and two worker
containers (2 Ray CPUs each, one actor of 1 thread per worker), each container on its own address
of a podman network (tests/image/podman_util.py's RayCluster, as the image tests run it).
Reported per side: docs/s of the job by its own clock (``seconds`` of its summary: model loading
of the Ray workers included, the driver's excluded), docs/s of the whole command (wall clock:
container or Ray start-up excluded, the driver's model load included), and each container's peak
memory from its cgroup (page cache included). On 2 cores expect no speed-up: the point is that
it runs on more than one node.

    make image-ray && flock /tmp/embedpool-bench.lock .venv/bin/python bench/ray_containers.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "image"))

from index_runners import machine  # noqa: E402
from podman_util import CGROUP_PEAK, RAY_IMAGE, RayCluster, inspect, peak_memory, podman  # noqa: E402

N_DOCS = 1000
JOB = ["/corpus/corpus.jsonl", "--collection", "sf", "--pooler", "mean", "--pooler", "cluster:pool_factor=4",
       "--commit-every", "100", "--no-progress", "--json"]


def _summary(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("{"):])


def _side(summary: dict, wall: float, memory: dict[str, int]) -> dict:
    secs = summary.get("seconds") or wall
    return {"job_seconds": round(secs, 1), "docs_per_s_job": round(N_DOCS / secs, 2),
            "command_seconds": round(wall, 1), "docs_per_s_command": round(N_DOCS / wall, 2),
            "peak_memory_mb": {k: round(v / 2**20) for k, v in memory.items()}}


def main() -> None:
    mach = machine()
    print(json.dumps(mach))
    scifact = ROOT.parent / "shared" / "data" / "scifact" / "corpus.jsonl"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        root.chmod(0o755)
        corpus, data = root / "corpus", root / "data"
        corpus.mkdir(mode=0o755)
        data.mkdir(mode=0o777)
        data.chmod(0o777)
        with open(scifact) as f, open(corpus / "corpus.jsonl", "w") as out:
            for _, line in zip(range(N_DOCS), f):
                out.write(line)
        (corpus / "corpus.jsonl").chmod(0o644)

        name = "embedpool-bench-inprocess"
        podman("rm", "-f", name, check=False)
        t0 = time.monotonic()
        r = podman("run", "--name", name, "-v", f"{corpus}:/corpus:ro", "-v", f"{data}:/data", RAY_IMAGE,
                   "sh", "-c", f'embedpool index "$@"; cat {CGROUP_PEAK[0]} 2>/dev/null || cat {CGROUP_PEAK[1]}',
                   "sh", *JOB, "--data-dir", "/data/local",
                   timeout=1800)
        wall = time.monotonic() - t0
        lines = r.stdout.strip().splitlines()
        local = _side(_summary("\n".join(lines[:-1])), wall, {"container": int(lines[-1])})
        podman("rm", "-f", name, check=False)
        print("in-process:", json.dumps(local))

        with RayCluster(corpus, data, workers=2, cpus=2) as cluster:
            t0 = time.monotonic()
            r = podman(*cluster.index_command(*JOB, "--data-dir", "/data/ray", "--workers", "2",
                                              "--worker-threads", "1"), timeout=1800)
            wall = time.monotonic() - t0
            mem = {"head": peak_memory(cluster.head),
                   **{f"worker{i}": peak_memory(w) for i, w in enumerate(cluster.workers)}}
            ray = _side(_summary(r.stdout), wall, mem)
        print("ray cluster:", json.dumps(ray))

    res = {"machine": mach, "image": RAY_IMAGE, "image_bytes": inspect(RAY_IMAGE)["Size"], "docs": N_DOCS,
           "in_process": local, "ray_cluster": ray,
           "ratio_docs_per_s_job": round(ray["docs_per_s_job"] / local["docs_per_s_job"], 2)}
    out = ROOT / "bench" / "results" / "ray_containers.json"
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"\n| side | job docs/s | command docs/s | peak memory per container (MB) |\n|---|---:|---:|---|")
    for label, side in (("in-process, 1 container", local), ("Ray: head + 2 worker containers", ray)):
        mem = ", ".join(f"{k} {v:,}" for k, v in side["peak_memory_mb"].items())
        print(f"| {label} | {side['docs_per_s_job']} | {side['docs_per_s_command']} | {mem} |")
    print(f"\nRay / in-process (job docs/s): {res['ratio_docs_per_s_job']}x; written {out}")


if __name__ == "__main__":
    main()
