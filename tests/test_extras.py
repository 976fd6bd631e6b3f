"""The optional parts (pyproject's extras: ray, milvus, eval, parquet) stay out of the API image;
a command that needs a missing one stops with the install command, before the model loads, and
never as a crash. The extras are blocked here the way a missing package fails (ImportError)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from embedpool.errors import Kind, UnavailableError, import_extra


def _cli_without(module: str, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    code = (f"import sys; sys.modules[{module!r}] = None; from embedpool.app.cli import main; "
            f"sys.exit(main({list(args)!r}))")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return r, time.monotonic() - t0


@pytest.mark.parametrize("module, extra, args", [
    ("ray", "ray", ["index", "{corpus}", "--collection", "x", "--runner", "ray"]),
    ("pymilvus", "milvus", ["index", "{corpus}", "--collection", "x", "--backend", "milvus",
                            "--milvus-uri", "{dir}/m.db"]),
])
def test_a_command_without_its_extra_names_the_install(tmp_path, module, extra, args):
    corpus = tmp_path / "c.txt"
    corpus.write_text("A document.\n")
    args = [a.format(corpus=corpus, dir=tmp_path) for a in args] + ["--data-dir", str(tmp_path)]
    r, _ = _cli_without(module, *args)
    assert r.returncode == 69, r.stderr[-2000:]  # unavailable (sysexits' EX_UNAVAILABLE)
    assert f"pip install 'embedpool[{extra}]'" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_require_imports_or_names_the_extra(monkeypatch):
    assert import_extra("json", "none", "x").dumps([1]) == "[1]"
    monkeypatch.setitem(sys.modules, "ranx", None)
    with pytest.raises(UnavailableError, match=r"Scoring needs ranx.*pip install 'embedpool\[eval\]'") as e:
        import_extra("ranx", "eval", "Scoring")
    assert e.value.kind is Kind.UNAVAILABLE
