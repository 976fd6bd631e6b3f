"""The layering of DESIGN.md, checked on the import statements of every module.

``poolers/`` never imports ``index/`` or ``app/``; ``index/`` never imports ``poolers/`` or
``app/``; ``embedpool/`` (what all three share: the error taxonomy, the CPU's features, the
precisions' names) imports none of them; and no package (nor a benchmark) imports another
package's private names (``_util``, ``_pool_all``, ...).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"poolers": "poolers", "index": "index", "app": "app", "embedpool": "embedpool"}
BANNED = {
    "poolers": {"index", "app"},
    "index": {"poolers", "app"},
    "embedpool": {"poolers", "index", "app"},
    "app": set(),
}


def _imports(path: Path, source: str | None = None) -> list[tuple[int, str, list[str]]]:
    """``(line, absolute module, imported names)`` of every import of the module at ``path``
    (its text, or ``source`` as if it were there)."""
    rel = path.relative_to(ROOT).parts
    tree = ast.parse(source if source is not None else path.read_text(encoding="utf-8"), filename=str(path))
    pkg = ["embedpool"] if rel[0] == "embedpool" else ["embedpool", rel[0]]
    sub = list(rel[1:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = (pkg + sub)[: len(pkg + sub) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((node.lineno, mod, [a.name for a in node.names]))
    return out


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "embedpool":
        return None
    if len(parts) == 1 or parts[1] not in LAYERS:
        return "embedpool"
    return parts[1]


def _sources(*folders: str) -> list[Path]:
    # hidden folders are not the project's sources (bench/.infinity-venv: a peer's own venv)
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py")
                  if "__pycache__" not in p.parts and not any(q.startswith(".") for q in p.relative_to(ROOT).parts))


@pytest.mark.parametrize("layer", sorted(BANNED))
def test_layers_import_only_what_design_allows(layer):
    bad = []
    for path in _sources(layer):
        for line, mod, names in _imports(path):
            targets = {_layer_of(mod)} | {_layer_of(f"{mod}.{n}") for n in names if mod == "embedpool"}
            for target in targets - {None, layer}:
                if target in BANNED[layer]:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
            if layer != "embedpool" and mod.split(".")[0] in ("app", "index", "poolers"):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports top-level {mod!r}: use embedpool.{mod}")
    assert not bad, "layering broken:\n" + "\n".join(bad)


def test_no_private_names_across_packages():
    bad = []
    for path in _sources("app", "index", "poolers", "bench"):
        own = path.relative_to(ROOT).parts[0]
        for line, mod, names in _imports(path):
            target = _layer_of(mod)
            if target is None or target == own:
                continue
            private = [p for p in mod.split(".")[2:] if p.startswith("_") and p != "__init__"]
            private += [n for n in names if n.startswith("_")]
            if private:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {', '.join(private)} from {mod}")
    assert not bad, "private names imported across packages:\n" + "\n".join(bad)


def test_the_checker_sees_a_violation():
    """The checks above read real imports: a relative import out of poolers into index is seen."""
    probe = "from ..index import maxsim\nfrom embedpool.index._util import now_iso\n"
    found = {mod for _, mod, _ in _imports(ROOT / "poolers" / "probe.py", probe)}
    assert found == {"embedpool.index", "embedpool.index._util"}
    assert _layer_of("embedpool.index") == "index" and _layer_of("embedpool.errors") == "embedpool"
