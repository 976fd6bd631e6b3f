"""The API image run as users run it, with podman: its own non-root user and HEALTHCHECK, the
host's vectors from `/embed`, a collection that outlives its container on the same volume, a
`podman stop` that lets an in-flight request finish, and nothing in it the API does not need.
`make test-image` builds the image first (`make image`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from podman_util import API_IMAGE, free_port, healthy, http, inspect, podman, start_api
from shutdown_testutil import busy_texts

pytestmark = pytest.mark.image

TEXTS = ["A man is playing a guitar.", "Stocks fell sharply on Monday.",
         "The mitochondria is the powerhouse of the cell.", "Zwei Hunde spielen im Schnee."]
SIZE_LIMIT = 1.5e9  # the API image's budget (bytes, as podman reports it)


@pytest.fixture(scope="module")
def volume():
    name = f"embedpool-test-{uuid.uuid4().hex[:8]}"
    podman("volume", "create", name)
    yield name
    podman("volume", "rm", "-f", name, check=False)


@pytest.fixture(scope="module")
def api(volume):
    """One API container for the module (the SIGTERM test stops it last)."""
    assert podman("image", "exists", API_IMAGE, check=False).returncode == 0, \
        f"{API_IMAGE} is not built: run `make image` (make test-image does)"
    name, port = f"embedpool-api-{uuid.uuid4().hex[:8]}", free_port()
    start_api(name, volume, port)
    try:
        took = healthy(name)
        print(f"\n{name}: healthy after {took:.1f} s")
        yield name, f"http://127.0.0.1:{port}"
    finally:
        podman("rm", "-f", "-t", "5", name, check=False)


def test_runs_as_its_own_user_and_passes_its_healthcheck(api):
    name, url = api
    cfg = inspect(name)["Config"]
    assert cfg["User"].split(":")[0] not in ("", "0", "root")
    assert podman("exec", name, "id", "-u").stdout.strip() == cfg["User"].split(":")[0]
    # the image's own HEALTHCHECK (kept by the docker format), not a probe of ours
    health = inspect(API_IMAGE)["Config"].get("Healthcheck") or inspect(API_IMAGE).get("Healthcheck")
    assert health and any("/health" in part for part in health["Test"]), health
    state = inspect(name)["State"]
    status = (state.get("Health") or state.get("Healthcheck") or {}).get("Status")
    assert status == "healthy", state
    assert http("GET", f"{url}/health")[0] == 200


def test_embed_equals_the_hosts_vectors(api):
    name, url = api
    _, info = http("GET", f"{url}/info")
    status, body = http("POST", f"{url}/embed", {"inputs": TEXTS, "pooler": "mean"})
    assert status == 200, body
    got = np.array(body["embeddings"], dtype=np.float32)
    # the host's CLI on the encoder path the container chose (auto picks by CPU: same machine)
    cli = Path(sys.executable).with_name("embedpool")
    out = subprocess.run([str(cli), "embed", "--precision", info["precision"], "--pooler", "mean", *TEXTS],
                         capture_output=True, text=True, check=True, timeout=300)
    want = np.array([json.loads(line)["embedding"] for line in out.stdout.splitlines()], dtype=np.float32)
    assert got.shape == want.shape == (len(TEXTS), info["dim"])
    # the image resolves its own library versions: equal to float32 rounding, not bit for bit
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)


def test_collection_survives_a_new_container_on_the_same_volume(api, volume):
    name, url = api
    docs = [{"id": f"d{i}", "text": t, "metadata": {"i": i}} for i, t in enumerate(TEXTS)]
    assert http("POST", f"{url}/collections", {"name": "kept", "pooler": "mean"})[0] in (200, 201)
    status, body = http("POST", f"{url}/collections/kept/documents", docs)
    assert status == 200, body
    query = {"query": "someone plays music", "k": 3}
    status, before = http("POST", f"{url}/collections/kept/search", query)
    assert status == 200 and before["hits"][0]["id"] == "d0", before

    # another container, the same volume: what the first committed is there
    other, port = f"embedpool-api-{uuid.uuid4().hex[:8]}", free_port()
    start_api(other, volume, port)
    try:
        healthy(other)
        status, coll = http("GET", f"http://127.0.0.1:{port}/collections/kept")
        assert status == 200 and coll["documents"] == len(docs), coll
        status, after = http("POST", f"http://127.0.0.1:{port}/collections/kept/search", query)
        assert status == 200
        assert [h["id"] for h in after["hits"]] == [h["id"] for h in before["hits"]]
        np.testing.assert_allclose([h["score"] for h in after["hits"]],
                                   [h["score"] for h in before["hits"]], atol=1e-6)
    finally:
        podman("rm", "-f", "-t", "5", other, check=False)


def test_image_holds_only_what_the_api_needs():
    size = inspect(API_IMAGE)["Size"]
    print(f"\n{API_IMAGE}: {size / 1e9:.2f} GB")
    probe = ("import importlib.util as u, shutil, os; "
             "print([m for m in ('ray', 'pymilvus', 'milvus_lite', 'ranx', 'matplotlib', 'pyarrow', 'pytest',"
             " 'playwright', 'litellm') if u.find_spec(m)]); "
             "print([t for t in ('gcc', 'cc', 'g++', 'make', 'git') if shutil.which(t)]); "
             "print([p for p in ('/src', '/tests', '/opt/venv/lib/python3.11/site-packages/torch/include')"
             " if os.path.exists(p)])")
    out = podman("run", "--rm", API_IMAGE, "python", "-c", probe).stdout.splitlines()
    assert out == ["[]", "[]", "[]"], out
    # an optional part asked for says which extra installs it (and is not a crash)
    r = podman("run", "--rm", API_IMAGE, "sh", "-c", "echo 'A document.' > /tmp/c.txt && "
               "embedpool index /tmp/c.txt --collection x --runner ray", check=False)
    assert r.returncode == 69 and "pip install 'embedpool[ray]'" in r.stderr, (r.returncode, r.stderr[-2000:])
    assert size <= SIZE_LIMIT, f"{size / 1e9:.2f} GB > {SIZE_LIMIT / 1e9} GB"


def test_sigterm_lets_the_request_in_flight_finish(api, scifact_docs):
    """Last: it stops the module's container."""
    name, url = api

    def post(texts: list[str]) -> None:
        status, body = http("POST", f"{url}/embed", {"inputs": texts, "pooler": "landmark"}, timeout=300)
        assert status == 200, (status, str(body)[:300])

    # ~6 s of work on this CPU, measured (a fixed size was 5 s on an AMX Xeon and ~70 s on an
    # AVX2 EPYC, past the shutdown timeout); the image's default shutdown timeout is 30 s
    texts = busy_texts(scifact_docs, post, 6.0)
    result: dict = {}

    def call():
        result["r"] = http("POST", f"{url}/embed", {"inputs": texts, "pooler": "landmark"}, timeout=300)

    t = threading.Thread(target=call)
    t.start()
    time.sleep(1.0)  # the request is in the batcher
    assert t.is_alive(), "the request finished before the stop: make it larger"
    t0 = time.monotonic()
    podman("stop", "-t", "60", name)
    stopped = time.monotonic() - t0
    t.join(60)
    status, body = result["r"]
    assert status == 200 and len(body["embeddings"]) == len(texts), (status, str(body)[:300])
    state = inspect(name)["State"]
    print(f"\npodman stop took {stopped:.1f} s; exit code {state['ExitCode']}")
    assert state["ExitCode"] == 0, podman("logs", name).stderr[-3000:]
    assert stopped < 60, "stopped by SIGKILL after the timeout, not by SIGTERM"
