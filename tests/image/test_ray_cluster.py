"""`embedpool index --runner ray` on a Ray cluster of containers: a head and two workers from the
Ray image, each with its own address on a podman network. The job run on the head equals the
in-process job of the same image (ids, vectors within 1e-6); with a worker container stopped in
the middle it either finishes (Ray retries what was lost) or fails saying what was lost, and a
rerun then equals the uninterrupted job."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from job_testutil import assert_same_collections, job_state
from podman_util import RAY_IMAGE, RayCluster, podman

pytestmark = pytest.mark.image

N_DOCS = 1000
POOLERS = ["mean", "cluster:pool_factor=4"]  # a single-vector and a multi-vector collection
NAMES = ["sf-mean", "sf-cluster-pool_factor-4"]
JOB = ["/corpus/corpus.jsonl", "--collection", "sf", *[a for p in POOLERS for a in ("--pooler", p)],
       "--commit-every", "100", "--no-progress", "--json"]


def _writable(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o777)  # the image's user (uid 10001) writes here
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("raycluster")
    root.chmod(0o755)
    corpus = root / "corpus"
    corpus.mkdir(mode=0o755)
    with open(data_dir / "scifact" / "corpus.jsonl") as f, open(corpus / "corpus.jsonl", "w") as out:
        for _, line in zip(range(N_DOCS), f):
            out.write(line)
    (corpus / "corpus.jsonl").chmod(0o644)
    return corpus, _writable(root / "data")


@pytest.fixture(scope="module")
def in_process(folders):
    """The in-process job of the same image, as the reference."""
    corpus, data = folders
    t0 = time.monotonic()
    r = podman("run", "--rm", "-v", f"{corpus}:/corpus:ro", "-v", f"{data}:/data", RAY_IMAGE,
               "embedpool", "index", *JOB, "--data-dir", "/data/local", timeout=1200)
    print(f"\nin-process job: {r.stdout.strip()[-400:]}")
    return data / "local", time.monotonic() - t0


@pytest.fixture(scope="module")
def cluster(folders):
    corpus, data = folders
    with RayCluster(corpus, data, workers=2, cpus=2) as c:
        yield c


def test_cluster_job_equals_the_in_process_job(cluster, in_process, folders):
    _, data = folders
    local, local_s = in_process
    t0 = time.monotonic()
    r = podman(*cluster.index_command(*JOB, "--data-dir", "/data/ray", "--workers", "2", "--worker-threads", "1"),
               timeout=1200)
    took = time.monotonic() - t0
    print(f"\nin-process job {local_s:.0f} s, cluster job {took:.0f} s; summary {r.stdout.strip()[-400:]}")
    assert_same_collections(local, data / "ray", NAMES, N_DOCS, atol=1e-6)


def test_a_stopped_worker_is_retried_or_named_and_a_rerun_equals(cluster, in_process, folders):
    _, data = folders
    local, _ = in_process
    out = data / "ray-stopped"
    cmd = ["bash", "-c", f'. "{Path(__file__).resolve().parents[2] / "deploy" / "podman-lib.sh"}"; podman_ "$@"',
           "podman", *cluster.index_command(*JOB, "--data-dir", "/data/ray-stopped", "--workers", "2",
                                            "--worker-threads", "1")]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # stop a worker once the job has committed something (it is under way on both workers)
    t0 = time.monotonic()
    while (job_state(out / NAMES[0]) or {}).get("committed_records", 0) < 100:
        assert job.poll() is None, job.communicate()
        assert time.monotonic() - t0 < 600, "the job committed nothing in 10 minutes"
        time.sleep(0.5)
    podman("stop", "-t", "0", cluster.workers[1])
    stdout, stderr = job.communicate(timeout=1200)
    print(f"\njob after a stopped worker: exit {job.returncode}\n{stderr[-1500:]}")
    if job.returncode != 0:
        # failed: it says what was lost, and a rerun (it resumes) on what is left equals the job
        assert any(w in stderr.lower() for w in ("node", "worker", "actor")), stderr[-3000:]
        podman(*cluster.index_command(*JOB, "--data-dir", "/data/ray-stopped", "--workers", "1",
                                      "--worker-threads", "1"), timeout=1200)
    assert_same_collections(local, out, NAMES, N_DOCS, atol=1e-6)
