"""Crash safety: a writer process is SIGKILLed at random moments; every reopen must load and
hold exactly the batches whose commit returned (or, if the kill landed after the durable point
but before the child could print, those plus the one in flight) -- their vectors, their lexical
(BM25) hits and their metadata filters alike, never one without the other."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from embedpool.index import FaissCollection, dequantize, quantize
from index_crash_workload import NAME, batch, committed_batches, expected, term
from index_testutil import managed_files

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TRIALS_PER_KIND = 4


def _run_and_kill(data_dir: Path, kind: str, delay: float) -> tuple[int, int]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(HERE / "index_crash_workload.py"), str(data_dir), kind],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        first = proc.stdout.readline()
        if not first.startswith("start "):
            proc.kill()
            raise AssertionError(f"child failed to start: {first!r} {proc.stderr.read()}")
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        rest = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        err = proc.stderr.read()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL, f"child ended on its own ({proc.returncode}): {err}"
    start = int(first.split()[1])
    done = [int(line.split()[1]) for line in rest.splitlines() if line.startswith("committed ")]
    assert done == list(range(start, start + len(done)))
    return start, start + len(done)


def _check_state(coll: FaissCollection, c: int, kind: str) -> None:
    want = expected(c, kind)
    assert sorted(coll.ids()) == sorted(want)
    assert len(coll) == len(want) == coll.stats()["documents"]
    for i, (text, vec) in want.items():
        got = coll.get(i)
        assert got["text"] == text and got["metadata"] == {"batch": int(text.split("@")[1].split()[0])}
        if kind == "single":
            np.testing.assert_array_equal(got["vector"], vec)
        else:
            np.testing.assert_array_equal(got["vectors"], dequantize(*quantize(vec, "int8")))
    if not want:
        assert coll.search(k=3, mode="bm25", texts=[term("b0-2", 0)]) == [[]]
        return
    # lexical hits agree: each version's own word finds it; a deleted document's, or the word of
    # the version an upsert replaced, finds nothing
    last = c - 1
    ids, _, _, deletes = batch(last, kind)
    words = {term(i, int(want[i][0].split("@")[1].split()[0])): i for i in sorted(want)[:: max(1, len(want) // 5)]}
    gone = [term(d, last - 1) for d in deletes] + ([term(ids[-1], last - 1)] if last else [])
    hits = coll.search(k=2, mode="bm25", texts=[*words, *gone])
    assert [[h.id for h in r][:1] for r in hits[:len(words)]] == [[i] for i in words.values()]
    assert hits[len(words):] == [[] for _ in gone]
    # metadata filters agree: the last batch's documents, exactly
    vecs = {"single": lambda i: want[i][1][None, :], "multi": lambda i: [want[i][1]]}[kind]
    in_last = {i for i, (t, _) in want.items() if t.split("@")[1].split()[0] == str(last)}
    got = coll.search(vecs(sorted(want)[0]), k=len(want), filter={"batch": last})[0]
    assert {h.id for h in got} == in_last
    # vectors and documents agree through search too
    probe = sorted(want)[:: max(1, len(want) // 5)]
    if kind == "single":
        hits = coll.search(np.stack([want[i][1] for i in probe]), k=1)
    else:
        hits = coll.search([want[i][1] for i in probe], k=1)
    assert [h[0].id for h in hits] == probe


@pytest.mark.parametrize("kind", ["single", "multi"])
def test_sigkill_during_writes_leaves_last_commit(tmp_path, kind):
    rng = np.random.default_rng(7 if kind == "single" else 8)
    data_dir = tmp_path / kind
    in_flight_seen = 0
    for trial in range(TRIALS_PER_KIND):
        start, printed = _run_and_kill(data_dir, kind, delay=float(rng.uniform(0.05, 0.8)))
        coll = FaissCollection.open(data_dir, NAME)
        try:
            found = committed_batches(coll)
            c = len(found)
            assert found == list(range(c)), f"trial {trial}: batches {found} are not a prefix"
            assert c >= start
            assert c in (printed, printed + 1), f"trial {trial}: printed {printed}, found {c}"
            in_flight_seen += c == printed + 1
            _check_state(coll, c, kind)
            # no leftovers of the interrupted commit once a reader opened without a writer around
            files = managed_files(data_dir / NAME)
            if kind == "single":
                assert files == ({coll._vec.file} if c else set())
            else:
                assert len(files) == 2 * coll.stats()["segments"]
        finally:
            coll.close()
