"""`make image` on a machine that has nothing yet: deploy/podman-image.sh in an empty image store
of its own (PODMAN_STORE: podman's --root/--runroot under a temp folder), so the base image is
debootstrapped from scratch and the API image built on it in every CI run -- a base that only
this machine's default store still holds cannot hide a broken recipe. The image built there
embeds as the host does. The store is removed afterwards.

Minutes (debootstrap, then the image's layers with no cache): ``make test-image``."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from podman_util import LIB, ROOT

pytestmark = [pytest.mark.image, pytest.mark.timeout(3000)]

IMAGE = "localhost/embedpool:from-scratch"


def _in_store(store, script: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f'set -euo pipefail; . "{LIB}"; {script}'], cwd=ROOT,
                          env={**os.environ, "PODMAN_STORE": str(store)}, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """deploy/podman-image.sh run in an empty store: (store, seconds, its output)."""
    store = tmp_path_factory.mktemp("podman-store")
    empty = _in_store(store, "podman_ images --format '{{.Repository}}:{{.Tag}}'", 120)
    assert empty.returncode == 0 and empty.stdout.strip() == "", empty.stdout + empty.stderr
    t0 = time.monotonic()
    r = subprocess.run([str(ROOT / "deploy" / "podman-image.sh")], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PODMAN_STORE": str(store), "IMAGE": IMAGE}, timeout=2700)
    took = time.monotonic() - t0
    print(f"\nmake image in an empty store: {took:.0f} s")
    try:
        assert r.returncode == 0, f"deploy/podman-image.sh failed in an empty store:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
        yield store, took, r.stdout + r.stderr
    finally:
        # not `system reset`: that would also drop the podman networks other tests use
        _in_store(store, "podman_ rm --all --force; podman_ rmi --all --force", 600)
        subprocess.run(["rm", "-rf", str(store)], check=False)


def test_the_base_is_debootstrapped_in_the_empty_store(scratch):
    store, _, log = scratch
    assert "debootstrap bookworm from" in log  # not taken from anywhere else
    images = _in_store(store, "podman_ images --format '{{.Repository}}:{{.Tag}}'", 120).stdout.split()
    recipe = _in_store(store, "base_recipe", 60).stdout.strip()
    assert f"localhost/embedpool-base:bookworm-{recipe}" in images and IMAGE in images, images


def test_the_base_has_what_the_dockerfile_needs(scratch):
    """python on PATH, venv with pip (ensurepip: the package set that made python3.11-venv
    fail to configure), TLS, groupadd/useradd."""
    store, _, _ = scratch
    recipe = _in_store(store, "base_recipe", 60).stdout.strip()
    r = _in_store(store, f"podman_run --rm localhost/embedpool-base:bookworm-{recipe} sh -c "
                         "'python -m venv /tmp/v && /tmp/v/bin/python -m pip --version && "
                         "python -c \"import ssl; print(ssl.OPENSSL_VERSION)\" && command -v groupadd && command -v useradd'", 300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pip " in r.stdout and "OpenSSL" in r.stdout and "useradd" in r.stdout


def test_the_image_built_there_embeds(scratch):
    store, _, _ = scratch
    r = _in_store(store, f"podman_run --rm {IMAGE} embedpool embed --pooler mean 'A fresh machine.'", 600)
    assert r.returncode == 0, r.stdout + r.stderr
    vec = json.loads(r.stdout.splitlines()[-1])["embedding"]
    assert len(vec) == 384 and abs(sum(x * x for x in vec) - 1) < 1e-3


def test_the_build_leaves_no_untagged_images_of_its_own(scratch):
    """The build stage (2.7 GB with torch) and any image the new one replaced are removed after the
    build: a CI that builds at every run on the same machine filled its disk with them."""
    store, _, log = scratch
    left = _in_store(store, "podman_ images --all --filter dangling=true --filter label=io.embedpool.part "
                            "--format '{{.ID}} {{.Size}}'", 120)
    assert left.returncode == 0 and left.stdout.strip() == "", left.stdout + left.stderr
    assert "removed untagged" in log


def test_a_store_without_room_is_refused_before_building(tmp_path_factory):
    """Less free space than a build needs: a message that says so and what to do, exit 2, and nothing
    built (not a failure half-way through pip)."""
    store = tmp_path_factory.mktemp("full-store")  # short: podman refuses a runroot over 50 characters
    r = subprocess.run([str(ROOT / "deploy" / "podman-image.sh")], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PODMAN_STORE": str(store), "IMAGE": IMAGE, "NEED_GB": "1000000"},
                       timeout=300)
    try:
        assert r.returncode == 2, r.stdout + r.stderr
        assert "an image build needs 1000000 GB" in r.stderr and "podman image prune" in r.stderr, r.stderr
        assert "building" not in r.stdout
    finally:
        _in_store(store, "podman_ rmi --all --force", 120)
        subprocess.run(["rm", "-rf", str(store)], check=False)
