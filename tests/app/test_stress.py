"""The distractor stress test: the injected fraction is what was asked (counted by the model's
tokenizer, the text's own words kept in order), ratio 0 is the plain evaluation, and the command
writes its table and plot."""

from __future__ import annotations

import json

import pytest

from embedpool.app import datasets
from embedpool.app import evaluation as ev
from embedpool.app.evaluation.stress import Distractors, check_ratios


@pytest.fixture(scope="module")
def sts(data_dir):
    return datasets.load_sts(data_dir / "stsb", "test")[:30]


def test_injected_fraction_is_what_was_asked(encoder, sts, scifact_docs):
    tok = encoder.tokenizer
    pool = Distractors(tok, scifact_docs[:50], seed=1)
    count = lambda t: len(tok(t, add_special_tokens=False)["input_ids"])  # noqa: E731
    texts = [a for a, _, _ in sts[:10]] + scifact_docs[60:63]
    for ratio in (0.1, 0.3, 0.5, 0.7, 0.9):
        for text in texts:
            out, own, added = pool.inject(text, ratio)
            assert own == count(text)
            assert count(out) == own + added  # the stressed text has exactly these tokens
            assert added == round(ratio * own / (1 - ratio))
            assert abs(added / (own + added) - ratio) <= 0.5 / (own + added) / (1 - ratio)
            words = iter(out.split())  # the text's own words, in order, all there
            assert all(w in words for w in text.split())
    assert pool.inject(texts[0], 0.0) == (texts[0], count(texts[0]), 0)
    with pytest.raises(ValueError, match="between 0 and"):
        pool.inject(texts[0], 1.0)
    assert check_ratios([0.5, 0.1]) == [0.0, 0.1, 0.5]  # the clean reference always runs


def test_ratio_zero_is_the_plain_sts_evaluation(embedder, sts, tmp_path):
    report = ev.evaluate_stress(embedder, ["mean", "cls"], [0.5], sts=sts, side="both")
    plain = {r["pooler"]: r for r in ev.evaluate_sts(embedder, sts, ["mean", "cls"])["results"]}
    rows = {(r["pooler"], r["ratio"]): r for r in report["results"]}
    assert report["ratios"] == [0.0, 0.5] and report["metric"] == "spearman"
    for p in ("mean", "cls"):
        assert rows[(p, 0.0)]["spearman"] == plain[p]["spearman"]
        assert rows[(p, 0.0)]["injected_fraction"] == 0.0
        assert rows[(p, 0.5)]["injected_fraction"] == pytest.approx(0.5, abs=0.01)
        assert rows[(p, 0.5)]["spearman"] < plain[p]["spearman"]  # half the tokens are noise
    ev.write_outputs(report, tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.png")
    md = (tmp_path / "r.md").read_text()
    assert "| `mean` |" in md and "50% (" in md
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # two indexings and ranx's start-up: ~30 s idle, minutes on a loaded machine
def test_ratio_zero_is_the_plain_retrieval_evaluation(embedder, data_dir, tmp_path, monkeypatch, capsys):
    """Distractors in the queries: one index of the clean slice, the queries re-embedded per
    ratio; through the CLI."""
    from embedpool.app import cli
    from embedpool.app.commands import eval as eval_cmd

    monkeypatch.setattr(eval_cmd, "load_embedder", lambda settings: embedder)
    data = datasets.slice_beir(datasets.load_beir(data_dir / "scifact", "test"), 12, 4, seed=2)
    plain = ev.evaluate_retrieval(embedder, data, ["mean"], progress=False, latency_queries=0)
    out = tmp_path / "stress.json"
    assert cli.main(["eval", "--data", str(data_dir / "scifact"), "--max-docs", "12", "--max-queries", "4", "--seed", "2",
                     "--pooler", "mean", "--stress", "distractors", "--stress-ratios", "0.7",
                     "--stress-side", "queries", "--latency-queries", "0", "--no-progress",
                     "--out", str(out)]) == 0
    assert "distractor stress test" in capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = {r["ratio"]: r for r in report["results"]}
    assert rows[0.0]["ndcg@10"] == plain["results"][0]["ndcg@10"]
    assert rows[0.7]["injected_fraction"] == pytest.approx(0.7, abs=0.01)
    assert rows[0.7]["documents"] == rows[0.0]["documents"] == 12
