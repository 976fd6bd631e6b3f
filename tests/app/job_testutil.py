"""Helpers of the index-job tests (in-process and Ray): the committed job state, a child
``embedpool index`` killed with SIGKILL mid-run, and collection equality."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from embedpool.app.indexing import JOB_PROPERTY
from embedpool.errors import EmbedpoolError
from embedpool.index import FaissCollection, open_collection

ROOT = Path(__file__).resolve().parents[2]


def job_state(folder: Path) -> dict | None:
    """The job state committed in the FAISS collection at ``folder`` (None while there is none)."""
    try:
        with FaissCollection.open(folder.parent, folder.name) as coll:
            raw = coll.get_property(JOB_PROPERTY)
        return json.loads(raw) if raw else None
    except (OSError, EmbedpoolError):  # not created yet, or not a collection
        return None


def kill_mid_run(args: list[str], watch: Path, at_least: int, settle: float = 0.2, timeout: float = 240) -> None:
    """Run ``embedpool ARGS`` in a child process and SIGKILL it ``settle`` seconds after the
    collection at ``watch`` has committed ``at_least`` records."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "embedpool.app.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + timeout
    try:
        while time.time() < deadline and proc.poll() is None:
            st = job_state(watch)
            if st and st["committed_records"] >= at_least:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the indexing child ended before it could be killed:\n" + proc.stdout.read().decode()
        time.sleep(settle)  # land somewhere inside the next batch
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL


def assert_same_collections(a: Path, b: Path, names: list[str], n: int, atol: float, ordered: bool = True,
                            **where) -> None:
    """The FAISS collections ``names`` under ``a`` and those under ``b`` (any backend: ``where``)
    hold the same ``n`` documents (in the same order, if ``ordered``), vectors within ``atol``."""
    for name in names:
        with FaissCollection.open(a, name) as ca, open_collection(b, name, **where) as cb:
            ids = ca.ids()
            assert (cb.ids() if ordered else sorted(cb.ids())) == (ids if ordered else sorted(ids)), name
            assert len(ca) == len(cb) == n, name  # no duplicates, nothing missing
            assert ca.stats()["tombstones"] == 0 and cb.stats()["tombstones"] == 0, name
            assert ca.stats()["vectors"] == cb.stats()["vectors"], name
            for i in ids:
                ga, gb = ca.get(i), cb.get(i)
                key = "vector" if "vector" in ga else "vectors"
                assert ga[key].shape == gb[key].shape, (name, i)
                np.testing.assert_allclose(gb[key], ga[key], rtol=0, atol=atol, err_msg=f"{name} {i}")
                assert ("companion" in ga) == ("companion" in gb), (name, i)
                if "companion" in ga:  # the companion rows the collection keeps
                    assert ga["companion"].shape == gb["companion"].shape, (name, i)
                    np.testing.assert_allclose(gb["companion"], ga["companion"], rtol=0, atol=atol,
                                               err_msg=f"{name} {i} companion")
                assert ga["text"] == gb["text"] and ga["metadata"] == gb["metadata"], (name, i)


def resume_in_process(args: list[str], embedder, monkeypatch, capsys, committed: int, n: int) -> dict:
    """Run ``embedpool ARGS --json`` again in this process (with the session's model, to spare a
    load): it resumes after ``committed`` records and indexes the other ``n - committed``. The summary."""
    from embedpool.app import cli
    from embedpool.app.commands import index as index_cmd

    monkeypatch.setattr(index_cmd, "load_embedder", lambda settings: embedder)
    capsys.readouterr()  # drop what this process printed before (e.g. Ray's console messages)
    assert cli.main(args + ["--json"]) == 0
    out = capsys.readouterr()
    assert f"resuming sf: {committed} records already committed" in out.err
    assert out.out.lstrip().startswith("{"), "stdout is not the JSON summary:\n" + out.out[:2000]
    summary = json.loads(out.out)
    assert summary["records"] == n and summary["indexed_this_run"] == n - committed
    return summary


def long_corpus(path: Path, data_dir: Path, n_docs: int, parts: int, seed: int = 0) -> list:
    """``n_docs`` long documents of ``parts`` SciFact abstracts each (``embedpool eval
    --synthetic-long``'s builder: every document hides one relevant abstract among ``parts - 1``
    others), written as JSON lines; the records."""
    from embedpool.app.datasets import load_beir
    from embedpool.app.evaluation.long import synthetic_long

    data = synthetic_long(load_beir(data_dir / "scifact", "test"), parts - 1, n_queries=None, seed=seed,
                          negatives=0)
    recs = data.corpus[:n_docs]
    assert len(recs) == n_docs
    with open(path, "w") as f:
        for r in recs:
            f.write(json.dumps({"_id": r.id, "text": r.text}) + "\n")
    return recs
