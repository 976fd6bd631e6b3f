"""`embedpool embed --pooler splade` prints each text's non-zero weights as `{indices, values}`
(`--sparse-tokens`: with the tokenizer's strings of the indices), as the HTTP `/embed` answers them,
not the vocabulary-sized list it printed before; every other pooler prints what it did. Real parts:
the CLI in its own process on the tiny random MLM model, against sentence-transformers' SparseEncoder
on the same folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["the cat sat on the mat", "stock market fell", "heavy rain and storm for the weekend"]


def _embed(model: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "embedpool.app.cli", "embed", *TEXTS, "--model", model,
                           "--precision", "fp32", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def _lines(p: subprocess.CompletedProcess) -> list[dict]:
    assert p.returncode == 0, p.stderr
    lines = [json.loads(x) for x in p.stdout.splitlines()]
    assert [x["index"] for x in lines] == list(range(len(TEXTS)))
    return lines


@pytest.fixture(scope="module")
def splade(tmp_path_factory):
    from splade_testutil import make_splade_model

    path, st = make_splade_model(tmp_path_factory.mktemp("splade"))
    return path, st


def test_splade_prints_indices_values_and_tokens(splade):
    path, st = splade
    want = st.encode(TEXTS, convert_to_tensor=True).to_dense().numpy()
    assert (want != 0).sum(1).min() > 0 and (want == 0).any()  # sparse rows, none empty: a real check
    rows = [x["embedding"] for x in _lines(_embed(path, "--pooler", "splade", "--sparse-tokens"))]
    for row, w in zip(rows, want):
        assert set(row) == {"indices", "values", "tokens"}
        assert row["indices"] == np.flatnonzero(w).tolist()  # ascending ids of the non-zeros
        np.testing.assert_allclose(row["values"], w[w != 0], atol=1e-5)
        assert row["tokens"] == st.tokenizer.convert_ids_to_tokens(row["indices"])
    plain = [x["embedding"] for x in _lines(_embed(path, "--pooler", "splade"))]
    assert plain == [{"indices": r["indices"], "values": r["values"]} for r in rows]  # tokens only on request


def test_other_poolers_print_dense_lists_and_refuse_sparse_tokens(splade):
    import torch
    from transformers import AutoTokenizer, BertModel

    path, _ = splade
    rows = [x["embedding"] for x in _lines(_embed(path, "--pooler", "mean"))]
    assert all(isinstance(r, list) and len(r) == 32 and all(isinstance(v, float) for v in r) for r in rows)
    # the same numbers as before: transformers' hidden states of the folder, mean over the mask, L2-normalized
    enc = AutoTokenizer.from_pretrained(path)(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = BertModel.from_pretrained(path, add_pooling_layer=False).eval()(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    want = torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=-1).numpy()
    np.testing.assert_allclose(np.array(rows), want, atol=1e-5)
    p = _embed(path, "--pooler", "mean", "--sparse-tokens")
    assert p.returncode == 2 and "--sparse-tokens" in p.stderr and "not sparse" in p.stderr and not p.stdout
