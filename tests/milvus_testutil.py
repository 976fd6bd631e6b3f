"""A real Milvus standalone server for tests and benchmarks: PyPI's ``milvus`` package (2.3.x;
its ``milvus-server`` runs the server binary from the wheel, with embedded etcd and local
storage), installed in its own venv by ``make milvus-server``.

The server runs in a process group of its own (the ``milvus-server`` wrapper and the ``milvus``
binary it starts), on a free gRPC port and a data folder that survive a restart, so a test can
SIGKILL it mid-job and start it again on the same data. :meth:`MilvusServer.stop` sends SIGTERM
and, since Milvus then waits up to its ``gracefulStopTimeout``, SIGKILL after a few seconds.

    with MilvusServer(tmp_path / "milvus") as srv:   # started; stopped on exit
        open_collection(..., backend="milvus", milvus_uri=srv.uri)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER = Path(os.environ.get("EMBEDPOOL_MILVUS_SERVER", ROOT / ".milvus-venv" / "bin" / "milvus-server"))
START_TIMEOUT = 240.0  # two tries (see start())
STOP_GRACE = 3.0
# the sessions of a killed server's components expire after this many seconds (Milvus' default
# is 30): a restart waits for them before it serves
SESSION_TTL = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MilvusServer:
    """``milvus-server --data DIR --proxy-port PORT`` (started by :meth:`start`)."""

    def __init__(self, data: Path, port: int | None = None) -> None:
        if not SERVER.exists():
            raise AssertionError(f"no Milvus server at {SERVER}: run `make milvus-server` (make test-slow does)")
        self.data = Path(data)
        self.data.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts: list[float] = []  # seconds each start took

    @property
    def log(self) -> Path:
        return self.data / "server.log"

    def start(self, timeout: float = START_TIMEOUT, attempts: int = 2) -> "MilvusServer":
        """Start the server and wait until it answers. Milvus 2.3 standalone restarted after a
        SIGKILL while clients held connections sometimes stays "Initializing" (its components
        keep calling the killed instance's node ids); killed and started again on the same data,
        it serves: so a start that is not serving after ``timeout / attempts`` seconds is tried
        again (each try is in :attr:`starts`)."""
        for attempt in range(attempts):
            t0 = time.monotonic()
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(
                    [str(SERVER), "--data", str(self.data), "--proxy-port", str(self.port),
                     "--extra-config", f"common.session.ttl={SESSION_TTL}"],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            while time.monotonic() - t0 < timeout / attempts:
                if self.proc.poll() is not None:
                    raise AssertionError(f"milvus-server exited {self.proc.returncode} at start:\n{self.tail()}")
                if self._answers():
                    self.starts.append(time.monotonic() - t0)
                    return self
                time.sleep(0.5)
            self.starts.append(-(time.monotonic() - t0))  # a try that did not serve
            self.kill()
        raise AssertionError(f"Milvus not serving on {self.port} after {attempts} tries of {timeout / attempts:.0f} s:"
                             f"\n{self.tail()}")

    def _answers(self) -> bool:
        """The server answers a version RPC (listening is not enough: it accepts before it serves)."""
        try:
            socket.create_connection(("127.0.0.1", self.port), 0.5).close()
        except OSError:
            return False
        from pymilvus import MilvusClient

        try:
            client = MilvusClient(uri=self.uri, dedicated=True, timeout=5)
        except Exception:  # noqa: BLE001 -- not up yet
            return False
        try:
            client.get_server_version()
            client.list_collections()
            return True
        except Exception:  # noqa: BLE001
            return False
        finally:
            client.close()

    def version(self) -> str:
        from pymilvus import MilvusClient

        client = MilvusClient(uri=self.uri, dedicated=True)
        try:
            return client.get_server_version()
        finally:
            client.close()

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)  # the wrapper and the server binary
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL the server (and its wrapper): a crash."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(30)
        self._reap()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after :data:`STOP_GRACE` seconds."""
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            pass
        self._signal(signal.SIGKILL)
        self.proc.wait(30)
        self._reap()

    def _reap(self) -> None:
        """Wait until nothing of the group is left (the binary may outlive the wrapper briefly)."""
        if self.proc is None:
            return
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                return
            time.sleep(0.1)

    def rss(self) -> int:
        """Resident memory of the server's processes (bytes)."""
        import psutil

        if self.proc is None or self.proc.poll() is not None:
            return 0
        parent = psutil.Process(self.proc.pid)
        total = 0
        for p in [parent, *parent.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def __enter__(self) -> "MilvusServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
