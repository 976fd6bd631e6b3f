"""Continuous batching through the server (issue 34): requests that arrive while the model is
busy with a round start as soon as that round ends, not after ``max_wait_ms``. A real uvicorn
server in this process on the session's model, whose ``embed`` is held on an event for the first
round (the "slow engine"); ``max_wait_ms`` is a minute, so a batcher that waited it for the
previous round's clients would miss the timeouts below by far."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from embedpool.app.server import create_app
from embedpool.app.settings import Settings
from server_testutil import Uvicorn


def test_requests_queued_while_the_model_is_busy_start_when_its_round_ends(embedder, tmp_path, monkeypatch):
    entered, gate = threading.Event(), threading.Event()
    rounds: list[list[str]] = []
    real = embedder.embed

    def held(texts, *args, **kwargs):
        rounds.append(list(texts))
        if "the held sentence" in texts:
            entered.set()
            gate.wait(30)
        return real(texts, *args, **kwargs)

    monkeypatch.setattr(embedder, "embed", held)
    app = create_app(Settings(data_dir=str(tmp_path), precision="fp32", rerank_cache_mb=0, max_wait_ms=60_000),
                     embedder=embedder)
    later = ["a sentence sent while the model was busy", "and another one"]

    def post(text: str) -> httpx.Response:
        with httpx.Client(base_url=url, timeout=20) as c:
            return c.post("/v1/embeddings", json={"input": text, "model": "x"})

    with Uvicorn(app) as url, ThreadPoolExecutor(3) as pool:
        batcher = app.state.engines.default.batcher
        first = pool.submit(post, "the held sentence")
        assert entered.wait(20), "the first round did not start"
        waiting = [pool.submit(post, t) for t in later]
        deadline = time.monotonic() + 20
        while batcher.queued_inputs < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert batcher.queued_inputs == 2  # both queued behind the busy model
        gate.set()
        t0 = time.monotonic()
        answers = [f.result() for f in waiting]
        elapsed = time.monotonic() - t0
        assert first.result().status_code == 200
    for r in answers:
        assert r.status_code == 200, r.text
    assert elapsed < 15  # at once (a wait of max_wait_ms would be 60 s; httpx gives up at 20)
    assert sorted(rounds[-1]) == sorted(later)  # one round for the two queued requests
    want = real(later, ["mean"]).matrix("mean")
    got = np.array([r.json()["data"][0]["embedding"] for r in answers])
    assert np.allclose(got, want, atol=1e-5)
