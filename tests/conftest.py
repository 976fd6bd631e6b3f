"""Shared fixtures: the real default model (loaded once) and the shared evaluation data."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("EMBEDPOOL_SHARED_DATA", ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def data_dir() -> Path:
    assert (DATA / "scifact" / "corpus.jsonl").exists(), f"evaluation data not found at {DATA}"
    return DATA


@pytest.fixture(scope="session")
def encoder():
    from embedpool.poolers import FrozenEncoder

    return FrozenEncoder(precision="fp32")  # the exact path: reference tests pin it


@pytest.fixture(scope="session")
def embedder(encoder):
    from embedpool.poolers import Embedder

    return Embedder(encoder)


@pytest.fixture(scope="session")
def st_model():
    """sentence-transformers' own model on the same weights: the reference."""
    from sentence_transformers import SentenceTransformer

    from embedpool.poolers.encoder import default_model_path

    return SentenceTransformer(default_model_path(), device="cpu")


@pytest.fixture(scope="session")
def scifact_docs(data_dir) -> list[str]:
    docs = []
    with open(data_dir / "scifact" / "corpus.jsonl") as f:
        for line in f:
            d = json.loads(line)
            docs.append((d["title"] + " " + d["text"]).strip())
            if len(docs) >= 200:
                break
    return docs


@pytest.fixture(scope="session")
def varied_texts(scifact_docs, data_dir) -> list[str]:
    """>= 100 varied inputs: STS-B sentences, SciFact abstracts (many over the 256-token window),
    unicode, whitespace and empty strings."""
    sts = []
    with open(data_dir / "stsb" / "test.tsv") as f:
        next(f)
        for line in f:
            s1, s2, _ = line.rstrip("\n").split("\t")
            sts += [s1, s2]
            if len(sts) >= 70:
                break
    special = ["", " ", "a", "ünïcödé ☃ naïve café", "日本語のテキストです。", "emoji 🙂🚀 mix",
               "Ελληνικά κείμενα", "UPPER lower MiXeD 12345", "tabs\tand\nnewlines", "x " * 400]
    return sts + scifact_docs[:24] + special


@pytest.fixture(scope="session")
def colbert_reference(tmp_path_factory):
    """A tiny ColBERT model wrapped and saved by PyLate in its own venv, and PyLate's encodings of
    family_models' queries and documents (see family_models.run_pylate)."""
    from family_models import DOCUMENTS, QUERIES, run_pylate

    return run_pylate(tmp_path_factory.mktemp("colbert"), {"queries": QUERIES, "documents": DOCUMENTS})


@pytest.fixture(scope="session")
def milvus_server(tmp_path_factory):
    """A real Milvus standalone server (2.3, ``make milvus-server``) for the session, started on
    first use; tests that stop or kill it start it again before they end."""
    from milvus_testutil import MilvusServer

    srv = MilvusServer(tmp_path_factory.mktemp("milvus-server")).start()
    try:
        yield srv
    finally:
        srv.stop()
