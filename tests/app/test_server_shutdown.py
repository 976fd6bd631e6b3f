"""A stopping server (SIGTERM, as ``docker stop`` and Kubernetes send it) on a real uvicorn
subprocess: the requests in flight finish within ``shutdown_timeout``; one that outlasts it gets
a JSON 503 that says to send it again (not uvicorn's bare text 500), and the process exits.

The request is a few seconds of ``landmark`` work on this CPU, sized by measurement
(tests/shutdown_testutil.py)."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
from shutdown_testutil import busy_texts


def sized(server, docs: list[str], seconds: float) -> list[str]:
    def post(texts: list[str]) -> None:
        with server.client() as c:
            r = c.post("/embed", json={"inputs": texts, "pooler": "landmark"})
            assert r.status_code == 200, r.text[:300]

    return busy_texts(docs, post, seconds)


def send_then_stop(server, texts: list[str]) -> tuple[httpx.Response | BaseException, float]:
    """POST ``texts`` in a thread, SIGTERM the server once the request is in flight, and return
    the response (or what the client raised) and the seconds the process took to exit."""
    result: dict = {}

    def call():
        try:
            with server.client(timeout=300) as c:
                result["r"] = c.post("/embed", json={"inputs": texts, "pooler": "landmark"})
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            result["r"] = exc

    t = threading.Thread(target=call)
    t.start()
    time.sleep(1.0)  # the request is read and in the batcher
    assert t.is_alive(), "the request finished before the stop: make it larger"
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(120)
    exited = time.monotonic() - t0
    t.join(60)
    return result["r"], exited


@pytest.mark.timeout(600)
def test_sigterm_lets_the_request_in_flight_finish(start_server, tmp_path, scifact_docs):
    server = start_server(tmp_path / "default", {}).wait_ready()
    texts = sized(server, scifact_docs, 6.0)  # the default shutdown timeout is 30 s
    r, exited = send_then_stop(server, texts)
    assert isinstance(r, httpx.Response), r
    assert r.status_code == 200, r.text[:500]
    assert len(r.json()["embeddings"]) == len(texts)
    # uvicorn re-raises the SIGTERM it handled once it is done (-15 here; 0 as a container's PID 1)
    assert server.proc.returncode in (0, -signal.SIGTERM), server.tail()
    print(f"\n{sum(map(len, texts))} characters; exited {exited:.1f} s after SIGTERM, with the request answered")


@pytest.mark.timeout(600)
def test_a_request_past_the_shutdown_timeout_gets_a_json_503(start_server, tmp_path, scifact_docs):
    server = start_server(tmp_path / "short", {"EMBEDPOOL_SHUTDOWN_TIMEOUT": "0.5"}).wait_ready()
    r, exited = send_then_stop(server, sized(server, scifact_docs, 6.0))
    assert isinstance(r, httpx.Response), r
    assert r.status_code == 503, r.text[:500]
    body = r.json()
    assert body["type"] == "not_ready" and "EMBEDPOOL_SHUTDOWN_TIMEOUT" in body["error"], body
    assert exited < 60, f"the process took {exited:.0f} s to exit"
