"""``embedpool index --runner ray``: the index job on a real local Ray (started here, 2 CPUs, a
small object store): the same collections as the in-process job, resumable after SIGKILL of the
driver, and a bad record fails the job by name with nothing after the last commit written.
The SIGKILL and Milvus worker-write cases take minutes: they run in `make test-slow`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from embedpool.app.datasets import CorpusSource
from embedpool.app.indexing import IndexJob, JOB_PROPERTY
from embedpool.errors import InvalidError
from embedpool.index import FaissCollection, open_collection
from job_testutil import assert_same_collections, job_state, kill_mid_run, resume_in_process

import ray  # a dependency (--runner ray): if it is missing these tests must fail, not vanish

POOLERS = ["mean", "cluster:pool_factor=2"]  # a single-vector and a multi-vector pooler
NAMES = ["sf-mean", "sf-cluster-pool_factor-2"]
N_DOCS, BATCH, COMMIT = 300, 16, 32


@pytest.fixture(scope="module")
def ray_address():
    """A local Ray of 2 CPUs for this module; its address, for drivers in other processes."""
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 << 20, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def _slice(path: Path, data_dir: Path, n: int, chars: int = 200, bad: dict | None = None) -> Path:
    """The first ``n`` SciFact documents (BEIR layout), texts cut to ``chars`` characters (fast to
    encode); ``bad``: position -> text to put there instead."""
    with open(data_dir / "scifact" / "corpus.jsonl") as f, open(path, "w") as out:
        for i, line in zip(range(n), f):
            d = json.loads(line)
            d["text"] = (bad or {}).get(i, d["text"][:chars])
            out.write(json.dumps(d) + "\n")
    return path


def _job(embedder, out: Path, src: CorpusSource, **kw) -> IndexJob:
    return IndexJob(embedder, out, "sf", POOLERS, source=src.describe(), commit_every=COMMIT,
                    batch_docs=BATCH, progress=False, **kw)


def _ray_run(embedder, out: Path, src: CorpusSource, workers: int = 2, **kw) -> dict:
    from embedpool.app.rayjob import run_on_ray
    from embedpool.app.settings import Settings

    with _job(embedder, out, src, **kw) as job:
        return run_on_ray(job, src, Settings().model_dump(), workers=workers, threads=1)


def _reference(embedder, data_dir, base: Path, n: int) -> tuple[CorpusSource, Path]:
    """The in-process job over the first ``n`` documents (torch on one thread, as each worker)."""
    import torch

    src = CorpusSource(str(_slice(base / "corpus.jsonl", data_dir, n)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _job(embedder, base / "ref", src) as job:
            job.run(src.records(), total=src.count())
    finally:
        torch.set_num_threads(threads)
    return src, base / "ref"


@pytest.fixture(scope="module")
def reference(embedder, data_dir, tmp_path_factory):
    """The 300-document slice, long enough to kill the driver mid-run (the slow tests)."""
    return _reference(embedder, data_dir, tmp_path_factory.mktemp("ray-ref"), N_DOCS)


#: the default run's equality check: three commits of each collection, on both workers
N_SMALL = 3 * COMMIT


def _cpus_free(timeout: float = 60) -> None:
    """Wait until the actors of a dead driver are gone (Ray frees their CPUs)."""
    deadline = time.monotonic() + timeout
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) >= 2, ray.available_resources()


# ------------------------------------------------------------------ the same collections
def test_ray_two_workers_equal_the_in_process_job(ray_address, embedder, data_dir, tmp_path):
    src, ref = _reference(embedder, data_dir, tmp_path, N_SMALL)
    summary = _ray_run(embedder, tmp_path / "ray", src, workers=2)
    assert summary["records"] == summary["indexed_this_run"] == N_SMALL
    assert_same_collections(ref, tmp_path / "ray", NAMES, N_SMALL, atol=1e-6)
    with FaissCollection.open(tmp_path / "ray", "sf-cluster-pool_factor-2") as c:
        # the multi-vector collection keeps its own mean companion rows
        assert c.spec.kind == "multi"
        assert (c.spec.companion_pooler, c.spec.companion_rows) == ("mean", "document")
        assert c.stats()["companion_rows"] == N_SMALL
    # both workers embedded: each block's seconds were added to the job state
    assert all(r["encode_seconds"] > 0 for r in summary["collections"])


# ------------------------------------------------------------------ kill -9 of the driver
@pytest.mark.slow  # minutes on 2 cores: `make test-slow` (CI runs it after `make test`)
def test_sigkill_of_the_driver_then_rerun_equals_uninterrupted(ray_address, embedder, reference, tmp_path,
                                                              monkeypatch, capsys):
    src, ref = reference
    out = tmp_path / "killed"
    args = ["index", src.path, "--data-dir", str(out), "--collection", "sf",
            *sum((["--pooler", p] for p in POOLERS), []), "--commit-every", str(COMMIT),
            "--batch-docs", str(BATCH), "--no-progress", "--runner", "ray", "--ray-address", ray_address,
            "--workers", "2", "--worker-threads", "1", "--precision", "fp32"]  # the rerun uses the fp32 embedder
    kill_mid_run(args, out / "sf-mean", at_least=2 * COMMIT, settle=0.5, timeout=300)
    states = {name: job_state(out / name)["committed_records"] for name in NAMES}
    assert min(states.values()) >= 2 * COMMIT and max(states.values()) < N_DOCS, states
    for name, c in states.items():  # every collection reopens at its last commit
        with FaissCollection.open(out, name) as coll:
            assert len(coll) == c
    _cpus_free()  # the dead driver's workers are gone

    # the same command again (in this process, joined to the same Ray) continues it
    resume_in_process(args, embedder, monkeypatch, capsys, min(states.values()), N_DOCS)
    assert_same_collections(ref, out, NAMES, N_DOCS, atol=1e-6)


# ------------------------------------------------------------------ a bad record
@pytest.mark.parametrize("bad, error, message", [
    (5, InvalidError, r"corpus\.jsonl, line 42: field 'text' is int, expected a string"),  # the read task
    ("\ud800 lone", InvalidError, r"record 41 \(id '\d+'\) cannot be embedded \(its text is not valid Unicode\)"),
], ids=["non-string text", "lone surrogate"])
def test_a_bad_record_fails_the_job_by_name_and_nothing_after_the_last_commit_is_written(
        ray_address, embedder, data_dir, tmp_path, bad, error, message):
    n = 48
    src = CorpusSource(str(_slice(tmp_path / "corpus.jsonl", data_dir, n, chars=100, bad={41: bad})))
    with open(src.path) as f:
        ids = [json.loads(line)["_id"] for line in f]

    def only_committed(out: Path) -> int:
        """Each collection holds exactly the records its job state says, whole blocks before
        the bad record's (record 41's block starts at 32)."""
        for name in NAMES:
            c = job_state(out / name)["committed_records"]
            assert c % COMMIT == 0 and c <= 32, c
            with FaissCollection.open(out, name) as coll:
                assert coll.ids() == ids[:c] and coll.stats()["tombstones"] == 0
                assert all(coll.get(i)["text"] for i in coll.ids())
        return c

    with pytest.raises(error, match=message):
        _ray_run(embedder, tmp_path / "out", src, workers=2)
    only_committed(tmp_path / "out")
    # the same job in-process fails the same way (after committing the first 32 records)
    with _job(embedder, tmp_path / "here", src) as job, pytest.raises(error, match=message):
        job.run(src.records())
    assert only_committed(tmp_path / "here") == 32


# ------------------------------------------------------------------ Milvus: every worker writes its rows
@pytest.mark.slow  # minutes on 2 cores: `make test-slow`
def test_milvus_server_workers_write_their_own_rows(ray_address, embedder, reference, milvus_lite_server,
                                                   tmp_path):
    """A Milvus server takes concurrent writers: the workers upsert their blocks themselves, the
    driver commits; the collections equal the in-process FAISS ones (in the order blocks were
    written, which two workers need not keep)."""
    src, ref = reference
    where = {"backend": "milvus", "milvus_uri": milvus_lite_server.uri}
    summary = _ray_run(embedder, tmp_path, src, workers=2, **where)
    assert summary["runner"]["writes"] == "workers"
    assert summary["records"] == summary["indexed_this_run"] == N_DOCS
    assert_same_collections(ref, tmp_path, NAMES, N_DOCS, atol=1e-6, ordered=False, **where)
    last_id = list(src.records())[-1].id
    for name in NAMES:
        with open_collection(tmp_path, name, **where) as coll:
            state = json.loads(coll.get_property(JOB_PROPERTY))
        assert state["committed_records"] == N_DOCS and state["last_id"] == last_id
