"""podman for the image tests, run as `deploy/podman-lib.sh` runs it (the runc runtime, this
machine's rlimits): one place says how containers run here, for `make image` and for these tests."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIB = ROOT / "deploy" / "podman-lib.sh"
API_IMAGE = os.environ.get("EMBEDPOOL_IMAGE", "localhost/embedpool:latest")
RAY_IMAGE = os.environ.get("EMBEDPOOL_RAY_IMAGE", "localhost/embedpool:ray")


def podman(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    """``podman ARGS`` through deploy/podman-lib.sh (``podman run`` with the rlimits)."""
    fn, rest = ("podman_run", args[1:]) if args[:1] == ("run",) else ("podman_", args)
    r = subprocess.run(["bash", "-c", f'. "{LIB}"; {fn} "$@"', "podman", *rest],
                       capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r


def inspect(name: str) -> dict:
    return json.loads(podman("inspect", name).stdout)[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body=None, timeout: float = 120) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def healthy(name: str, timeout: float = 240) -> float:
    """Seconds until the container's own HEALTHCHECK passes (``podman healthcheck run``; no
    systemd timer drives it here). Fails if it exits or never passes."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        state = inspect(name)["State"]
        assert state["Running"], f"{name} exited {state.get('ExitCode')}:\n{podman('logs', name).stderr[-3000:]}"
        if podman("healthcheck", "run", name, check=False).returncode == 0:
            return time.monotonic() - t0
        time.sleep(2)
    raise AssertionError(f"{name} not healthy after {timeout} s:\n{podman('logs', name).stderr[-3000:]}")


def start_api(name: str, volume: str, port: int, *extra: str) -> None:
    """The API image as a user runs it: its own user, CMD and HEALTHCHECK; collections on
    ``volume``; the host's network, on ``port``."""
    podman("rm", "-f", name, check=False)
    podman("run", "-d", "--name", name, "--network", "host", "-e", f"EMBEDPOOL_PORT={port}",
           "-v", f"{volume}:/data", *extra, API_IMAGE)


# a container's peak memory, as its cgroup counts it: v1, then v2
CGROUP_PEAK = ("/sys/fs/cgroup/memory/memory.max_usage_in_bytes", "/sys/fs/cgroup/memory.peak")


def peak_memory(name: str) -> int:
    """The container's peak memory (bytes) by its cgroup: v1's max_usage, v2's memory.peak."""
    for path in CGROUP_PEAK:
        r = podman("exec", name, "cat", path, check=False)
        if r.returncode == 0 and r.stdout.strip().isdigit():
            return int(r.stdout)
    return -1


class RayCluster:
    """A Ray head and ``workers`` worker containers of the Ray image on their own podman network,
    as on separate machines: each node has its own address, they find each other by container
    name, and every node mounts the corpus read-only at /corpus; the head's /data is
    ``data_dir``. Nodes authenticate with one token (Ray's token mode), as docker-compose.yml's
    ``ray`` profile does."""

    def __init__(self, corpus_dir: Path, data_dir: Path, workers: int = 2, cpus: int = 2) -> None:
        tag = uuid.uuid4().hex[:8]
        self.network, self.head = f"embedpool-ray-{tag}", f"embedpool-ray-head-{tag}"
        self.workers = [f"embedpool-ray-worker{i}-{tag}" for i in range(workers)]
        self.corpus_dir, self.data_dir, self.cpus = corpus_dir, data_dir, cpus
        self.token = secrets.token_hex(32)

    def _node(self, name: str, *command: str, data: bool = False) -> None:
        podman("run", "-d", "--name", name, "--hostname", name, "--network", self.network, "--shm-size", "1g",
               "-e", "RAY_AUTH_MODE=token", "-e", f"RAY_AUTH_TOKEN={self.token}",
               "-v", f"{self.corpus_dir}:/corpus:ro", *(["-v", f"{self.data_dir}:/data"] if data else []),
               RAY_IMAGE, *command)

    def __enter__(self) -> "RayCluster":
        assert podman("image", "exists", RAY_IMAGE, check=False).returncode == 0, \
            f"{RAY_IMAGE} is not built: run `make image-ray` (make test-image does)"
        podman("network", "create", self.network)
        self._node(self.head, "ray", "start", "--head", "--port=6379", "--num-cpus=0",
                   "--include-dashboard=false", "--block", data=True)
        for w in self.workers:
            self._node(w, "ray", "start", f"--address={self.head}:6379", f"--num-cpus={self.cpus}", "--block")
        self.wait_nodes(1 + len(self.workers))
        return self

    def alive_nodes(self) -> int:
        probe = "import ray; ray.init('auto', logging_level='ERROR'); print(sum(n['Alive'] for n in ray.nodes()))"
        r = self.exec("python", "-c", probe, check=False, timeout=60)
        return int(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else 0

    def wait_nodes(self, n: int, timeout: float = 180) -> None:
        t0 = time.monotonic()
        while self.alive_nodes() < n:
            if time.monotonic() - t0 > timeout:
                logs = "\n".join(podman("logs", c, check=False).stderr[-1500:] for c in [self.head, *self.workers])
                raise AssertionError(f"Ray cluster: fewer than {n} nodes after {timeout} s\n{logs}")
            time.sleep(2)

    def exec(self, *args: str, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
        return podman("exec", self.head, *args, check=check, timeout=timeout)

    def index_command(self, *args: str) -> list[str]:
        """``embedpool index`` on the head, against the cluster (for ``podman exec``)."""
        return ["exec", self.head, "embedpool", "index", *args, "--runner", "ray",
                "--ray-address", f"{self.head}:6379"]

    def __exit__(self, *exc) -> None:
        for c in [*self.workers, self.head]:
            podman("rm", "-f", "-t", "2", c, check=False)
        podman("network", "rm", "-f", self.network, check=False)
