"""The read consistency a server and ``embedpool search`` open Milvus collections with (issue 50,
item 5): by default Session -- a single API server reads its own writes at once without waiting
for the Milvus server's time tick (~4 ms a search where Strong took ~370) -- and Strong where
replicas are configured (EMBEDPOOL_REPLICAS above 1: a write through one replica is read through
the other at once; the slow tests in test_milvus_server.py run two replicas so). An explicit level
wins; the indexing job's reads are always Strong (its storage keywords carry no level, and
``index.open_collection`` reads Strong without one)."""

from __future__ import annotations

import pytest

from embedpool.app.cli import build_parser
from embedpool.app.settings import Settings, from_args


@pytest.mark.parametrize("flags,level", [
    ([], "Session"),
    (["--replicas", "2"], "Strong"),
    (["--replicas", "1"], "Session"),
    (["--replicas", "3", "--milvus-consistency", "Session"], "Session"),
    (["--milvus-consistency", "Strong"], "Strong"),
    (["--milvus-consistency", "Bounded"], "Bounded"),
])
def test_the_server_reads_session_unless_replicas_are_configured(monkeypatch, flags, level):
    for var in ("EMBEDPOOL_REPLICAS", "EMBEDPOOL_MILVUS_CONSISTENCY"):
        monkeypatch.delenv(var, raising=False)
    args = build_parser().parse_args(["serve", "--backend", "milvus", *flags])
    assert from_args(args).store(reads=True)["milvus_consistency"] == level
    assert "milvus_consistency" not in from_args(args).store()  # the job's storage: Strong, always


def test_replicas_from_the_environment_and_search(monkeypatch):
    monkeypatch.delenv("EMBEDPOOL_MILVUS_CONSISTENCY", raising=False)
    monkeypatch.setenv("EMBEDPOOL_REPLICAS", "2")
    assert Settings().store(reads=True)["milvus_consistency"] == "Strong"
    monkeypatch.delenv("EMBEDPOOL_REPLICAS")
    search = build_parser().parse_args(["search", "--collection", "c", "--query", "q", "--backend", "milvus"])
    assert from_args(search).store(reads=True)["milvus_consistency"] == "Session"
    with pytest.raises(ValueError):
        Settings(replicas=0)
    with pytest.raises(ValueError):
        Settings(milvus_consistency="session")  # Milvus' names, exactly
