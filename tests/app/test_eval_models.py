"""Poolers x models in one report: `embedpool eval --model A --model B --pooler ...` scores every
pair in one run. Two tiny random-weight models of different families (tests/family_models.py)
on a SciFact slice and on STS-B pairs: every (model, pooler) row is the one-model run's row, and
the paired test across models is the paired t-test of the two models' per-query nDCG@10 (or,
on STS, 1.0 for a model compared with itself)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import stats

from embedpool.app.cli import main
from family_models import FAMILIES, build


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-models")
    return {name: build(FAMILIES[name], root) for name in ("bert-dense", "roberta")}


POOLERS = ["--pooler", "auto", "--pooler", "mean:model_head=false"]


def _eval(argv: list[str], out) -> dict:
    assert main(["eval", *argv, "--precision", "fp32", "--out", str(out), "--no-progress"]) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_retrieval_scores_every_model_pooler_pair_with_paired_tests(two_models, data_dir, tmp_path):
    a, b = two_models["bert-dense"], two_models["roberta"]
    data = ["--data", str(data_dir / "scifact"), "--max-docs", "60", "--max-queries", "20",
            "--latency-queries", "0"]
    both = _eval([*data, "--model", f"A={a}", "--model", f"B={b}", *POOLERS, "--plot", str(tmp_path / "p.png")],
                 tmp_path / "both.json")
    alone = {n: _eval([*data, "--model", str(p), *POOLERS], tmp_path / f"{n}.json") for n, p in (("A", a), ("B", b))}
    assert [(r["model"], r["pooler"]) for r in both["results"]] == \
        [(m, p) for m in ("A", "B") for p in ("auto", "mean:model_head=false")]
    assert both["baseline_model"] == "A" and (tmp_path / "p.png").stat().st_size > 0
    for r in both["results"]:
        one = next(x for x in alone[r["model"]]["results"] if x["pooler"] == r["pooler"])
        assert r["ndcg@10"] == pytest.approx(one["ndcg@10"]) and r["p_value"] == one["p_value"]
        if r["model"] == "A":
            assert r["p_model"] is None
        else:  # the paired t-test of B's and A's per-query nDCG@10 for the same pooler
            pa, pb = (alone[m]["per_query"][r["pooler"]] for m in ("A", "B"))
            qs = sorted(pa)
            x, y = np.array([pb[q] for q in qs]), np.array([pa[q] for q in qs])
            want = 1.0 if np.allclose(x, y) else stats.ttest_rel(x, y).pvalue
            assert r["p_model"] == pytest.approx(want)
    # the vectors' sizes differ per model and pooler (A's Dense head: 16; raw states: 32)
    bytes_a = {r["pooler"]: r["bytes_per_doc"] for r in both["results"] if r["model"] == "A"}
    assert bytes_a["auto"] < bytes_a["mean:model_head=false"]


def test_sts_compares_models_pooler_by_pooler(two_models, data_dir, tmp_path):
    a = two_models["bert-dense"]
    rep = _eval(["--sts", str(data_dir / "stsb"), "--max-pairs", "80", "--model", f"first={a}",
                 "--model", f"again={a}", "--model", "minilm=default", *POOLERS], tmp_path / "sts.json")
    rows = {(r["model"], r["pooler"]): r for r in rep["results"]}
    assert len(rows) == 6 and rep["models"]["minilm"] == "sentence-transformers/all-MiniLM-L6-v2"
    for p in ("auto", "mean:model_head=false"):
        assert rows[("again", p)]["spearman"] == pytest.approx(rows[("first", p)]["spearman"])
        assert rows[("again", p)]["p_model"] == 1.0  # the same model: no difference at all
        # the real model against a random one: a clear difference
        assert rows[("minilm", p)]["spearman"] > rows[("first", p)]["spearman"] + 0.3
        assert rows[("minilm", p)]["p_model"] < 0.01


def test_model_entries_name_every_model(tmp_path):
    from embedpool.app.evaluation import model_entries
    from embedpool.errors import InvalidError

    folder = tmp_path / "my-model"
    folder.mkdir()
    assert model_entries(None) == [("all-MiniLM-L6-v2", None)]
    assert model_entries([str(folder), "b=org/some-id"]) == [("my-model", str(folder)), ("b", "org/some-id")]
    odd = tmp_path / "a=b"  # a folder whose name has '=' is a folder, not NAME=PATH
    odd.mkdir()
    assert model_entries([str(odd)]) == [("a=b", str(odd))]
    with pytest.raises(InvalidError, match="two models are named 'x'"):
        model_entries(["x=one", "x=two"])
    with pytest.raises(InvalidError, match="NAME=PATH_OR_ID"):
        model_entries(["=nothing"])
