"""The installed package is the source tree: a wheel built from pyproject.toml holds every module
and static file of ``embedpool``, ``app/``, ``index/`` and ``poolers/``. The tests import from
the editable install, which finds a subpackage missing from pyproject's package list anyway; the
API image (``make test-image``) and a ``pip install .`` would not."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> its import name (pyproject's package-dir)
TREES = {"embedpool": "embedpool", "app": "embedpool/app", "index": "embedpool/index", "poolers": "embedpool/poolers"}


def test_a_built_wheel_holds_every_module_and_static_file(tmp_path):
    # built from a copy: setuptools writes build/ and *.egg-info next to pyproject.toml, and a
    # build/lib left from an earlier build would keep files the tree no longer has
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for tree in TREES:
        shutil.copytree(ROOT / tree, src / tree, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = tmp_path.glob("embedpool-*.whl")
    inside = set(zipfile.ZipFile(wheel).namelist())
    expected = set()
    for src, dst in TREES.items():
        for f in (ROOT / src).rglob("*"):
            rel = f.relative_to(ROOT / src)
            if f.is_file() and "__pycache__" not in rel.parts and (f.suffix == ".py" or "static" in rel.parts):
                expected.add(f"{dst}/{rel.as_posix()}")
    assert len(expected) > 100  # the tree was found
    assert sorted(expected - inside) == []
