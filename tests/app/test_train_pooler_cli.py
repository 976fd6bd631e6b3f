"""``embedpool train-pooler`` end to end on tiny data: the pairs come from app/datasets.py
(STS TSV with a dev split; BEIR qrels), token states are cached, and the saved head loads as a
pooler."""

from __future__ import annotations

import json

import pytest

from embedpool.app import cli, datasets
from embedpool.app.commands import train_pooler as cmd

SENTENCES = ["A cat sits on the mat.", "A kitten rests on a rug.", "Stocks fell sharply today.",
             "Markets dropped as investors sold.", "It will rain this weekend.", "Storms are forecast.",
             "The team won the final.", "Fans cheered the champions."]


def _sts(folder, split: str, n: int) -> None:
    rows = ["sentence1\tsentence2\tscore"]
    for i in range(n):
        a, b = SENTENCES[(2 * i) % 8], SENTENCES[(2 * i + 1 + i // 4) % 8]
        rows.append(f"{a}\t{b}\t{5.0 if i < 4 else 1.0}")
    (folder / f"{split}.tsv").write_text("\n".join(rows) + "\n")


def _beir(beir):
    """A BEIR folder: every sentence a document, its upper-cased copy the query (train qrels)."""
    (beir / "qrels").mkdir(parents=True)
    (beir / "corpus.jsonl").write_text("".join(json.dumps({"_id": f"d{i}", "title": "", "text": t}) + "\n"
                                               for i, t in enumerate(SENTENCES)))
    (beir / "queries.jsonl").write_text("".join(json.dumps({"_id": f"q{i}", "text": t.upper()}) + "\n"
                                                for i, t in enumerate(SENTENCES)))
    (beir / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\n"
                                              + "".join(f"q{i}\td{i}\t1\n" for i in range(8)))
    return beir


def sts_and_beir(folder):
    """An STS folder (train 8, dev 5 pairs) and a BEIR folder side by side in ``folder``."""
    sts = folder / "sts"
    sts.mkdir()
    _sts(sts, "train", 8)
    _sts(sts, "dev", 5)
    return sts, _beir(folder / "beir")


def test_train_on_sts_with_a_dev_split_and_on_beir(embedder, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cmd, "load_embedder", lambda settings: embedder)
    sts = tmp_path / "sts"
    sts.mkdir()
    _sts(sts, "train", 8)
    _sts(sts, "dev", 5)
    out = tmp_path / "head-sts"
    assert cli.main(["train-pooler", "--sts", str(sts), "--dev-split", "dev", "--epochs", "1",
                     "--out", str(out), "--cache-dir", str(tmp_path / "cache")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["objective"] == "cosent" and summary["pairs"] == 8 and summary["dev_pairs"] == 5
    assert embedder.pooler(summary["pooler"]).spec.startswith("attention")
    assert cli.main(["train-attention", "--sts", str(sts), "--dev-split", "test", "--out", str(out)]) == 2
    assert "must not look at the test split" in capsys.readouterr().err

    beir = _beir(tmp_path / "beir")
    assert cli.main(["train-pooler", "--data", str(beir), "--epochs", "1", "--out", str(tmp_path / "head-beir"),
                     "--cache-dir", str(tmp_path / "cache")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["objective"] == "infonce" and summary["pairs"] == 8

    # train-pooler: the multilayer head, early stopping guarded by the other task's split
    out = tmp_path / "head-ml"
    assert cli.main(["train-pooler", "--pooler", "multilayer", "--sts", str(sts), "--dev-split", "dev",
                     "--guard-data", str(beir), "--anchor", "0.5", "--epochs", "1", "--out", str(out),
                     "--cache-dir", str(tmp_path / "cache")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["pooler"] == f"multilayer:weights={out}" and summary["anchor"] == 0.5
    assert summary["guard"].endswith("beir train") and summary["guard_metric"] == "ndcg@10"
    report = json.loads((out / "train_report.json").read_text())
    assert all("guard_ndcg@10" in row for row in report["history"])
    assert embedder.pooler(summary["pooler"]).spec.startswith("multilayer")
    assert len(embedder.embed(["a cat"], [summary["pooler"]]).matrix(summary["pooler"])[0]) == 384
    assert cli.main(["train-pooler", "--sts", str(sts), "--guard-data", str(beir), "--guard-split", "test",
                     "--out", str(out)]) == 2
    assert "must not look at a test split" in capsys.readouterr().err
    # the token states are bounded before anything is encoded: every layer's are 7x the last layer's
    passes = embedder.encoder.stats.passes
    assert cli.main(["train-pooler", "--pooler", "multilayer", "--sts", str(sts), "--max-state-bytes", "100000",
                     "--out", str(tmp_path / "too-big"), "--cache-dir", str(tmp_path / "cache-2")]) == 2
    err = capsys.readouterr().err
    assert "with every layer, over --max-state-bytes" in err and "--max-docs" in err
    assert embedder.encoder.stats.passes == passes and not (tmp_path / "too-big").exists()
    assert cli.main(["train-pooler", "--pooler", "attention", "--sts", str(sts), "--max-state-bytes", "100000",
                     "--epochs", "1", "--out", str(tmp_path / "fits"), "--cache-dir", str(tmp_path / "cache-2")]) == 0


def test_train_pooler_glot_attnstats_reinpool_with_anchor_and_guard(embedder, tmp_path, monkeypatch, capsys):
    """The issue-32 heads through the command: BEIR pairs, an STS guard, the anchor; each saved
    head serves as NAME:weights=DIR and reports its trainable parameters."""
    monkeypatch.setattr(cmd, "load_embedder", lambda settings: embedder)
    sts = tmp_path / "sts"
    sts.mkdir()
    _sts(sts, "dev", 5)
    beir = _beir(tmp_path / "beir")
    for name in ("glot", "attnstats", "reinpool"):
        out = tmp_path / name
        assert cli.main(["train-pooler", "--pooler", name, "--data", str(beir), "--guard-sts", str(sts),
                         "--anchor", "0.5", "--epochs", "1", "--out", str(out),
                         "--cache-dir", str(tmp_path / "cache")]) == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert summary["pooler"] == f"{name}:weights={out}" and summary["guard_metric"] == "spearman"
        assert summary["trainable_parameters"] > 100_000
        assert json.loads((out / "head.json").read_text())["kind"] == name
        assert embedder.pooler(summary["pooler"]).spec == f"{name}:weights={out}"
        assert embedder.embed(["a cat"], [summary["pooler"]]).matrix(summary["pooler"]).shape == (1, 384)
    assert cli.main(["train-pooler", "--pooler", "reinpool", "--roles", "separate", "--data", str(beir),
                     "--out", str(tmp_path / "no")]) == 2
    assert "reinpool has no separate" in capsys.readouterr().err


def test_with_distractors_stresses_the_asked_side_of_train_and_dev(encoder):
    """--distractors: every text on the side gets the asked share of distractor tokens (counted by
    the model's tokenizer, its own words in order), a text shared by pairs gets one stressed
    version, the other side and the scores are untouched, and the dev texts are stressed too."""
    tok = encoder.tokenizer
    count = lambda t: len(tok(t, add_special_tokens=False)["input_ids"])  # noqa: E731
    pairs = [(SENTENCES[i % 4], SENTENCES[4 + i % 3]) for i in range(8)]  # documents shared by pairs
    train = cmd.Texts("cosent", pairs, [float(i) for i in range(8)])
    dev = cmd.Texts("cosent", [(SENTENCES[6], SENTENCES[7])], [1.0])
    for ratio in (0.5, 0.9):
        st, sd, frac = cmd.with_distractors(tok, train, dev, ratio, "documents", seed=3)
        assert st.scores == train.scores and [a for a, _ in st.pairs] == [a for a, _ in pairs]
        for (_, b), (_, sb) in zip(pairs + dev.pairs, st.pairs + sd.pairs):
            n = count(b)
            assert count(sb) == n + round(ratio * n / (1 - ratio))
            words = iter(sb.split())
            assert all(w in words for w in b.split())
        stressed = {b: sb for (_, b), (_, sb) in zip(pairs, st.pairs)}
        assert all(stressed[b] == sb for (_, b), (_, sb) in zip(pairs, st.pairs))  # one version per text
        assert frac == pytest.approx(ratio, abs=0.03)
    st, _, _ = cmd.with_distractors(tok, train, None, 0.5, "queries", seed=3)
    assert [b for _, b in st.pairs] == [b for _, b in pairs] and all(count(a) > count(a0) for (a, _), (a0, _)
                                                                     in zip(st.pairs, pairs))
    again, _, _ = cmd.with_distractors(tok, train, None, 0.5, "queries", seed=3)
    assert again.pairs == st.pairs  # seeded
    with pytest.raises(ValueError, match="--distractors must be in"):
        cmd.with_distractors(tok, train, None, 0.99, "documents", seed=0)


def test_train_pooler_with_distractors(embedder, tmp_path, monkeypatch, capsys):
    """The head trains on the stressed texts (those reach the token-state cache), the report and
    the head's config say so, and the head serves; --corpus (ICT) is refused."""
    monkeypatch.setattr(cmd, "load_embedder", lambda settings: embedder)
    seen = []
    states = cmd._states
    monkeypatch.setattr(cmd, "_states", lambda enc, train, *a: seen.append(train) or states(enc, train, *a))
    sts = tmp_path / "sts"
    sts.mkdir()
    _sts(sts, "train", 8)
    _sts(sts, "dev", 5)
    out = tmp_path / "head"
    assert cli.main(["train-pooler", "--pooler", "attnstats", "--sts", str(sts), "--dev-split", "dev",
                     "--distractors", "0.7", "--epochs", "1", "--out", str(out),
                     "--cache-dir", str(tmp_path / "cache")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["distractors"] == 0.7 and summary["distractor_side"] == "documents"
    assert summary["injected_fraction"] == pytest.approx(0.7, abs=0.03)
    clean = [(a, b) for a, b, _ in datasets.load_sts(str(sts), "train")]
    assert [a for a, _ in seen[0].pairs] == [a for a, _ in clean]
    assert all(len(sb.split()) > 2 * len(b.split()) for (_, b), (_, sb) in zip(clean, seen[0].pairs))
    assert json.loads((out / "head.json").read_text())["distractors"] == 0.7
    assert embedder.embed(["a cat"], [summary["pooler"]]).matrix(summary["pooler"]).shape == (1, 384)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"_id": f"d{i}", "text": f"{s} {s}"}) + "\n" for i, s in enumerate(SENTENCES)))
    assert cli.main(["train-pooler", "--corpus", str(corpus), "--self-supervised", "ict", "--distractors", "0.5",
                     "--out", str(tmp_path / "no")]) == 2
    assert "--distractors needs labelled pairs" in capsys.readouterr().err


def test_defaults_follow_the_objective_and_a_folder_beside_guards(embedder, tmp_path, monkeypatch, capsys):
    """Without flags, STS pairs train with CoSENT's settings and retrieval pairs with InfoNCE's
    (poolers.training.OBJECTIVE_DEFAULTS); a folder of the other kind beside the training data
    guards the training by default (significant losses only), unless --no-guard."""
    from embedpool.poolers.training import OBJECTIVE_DEFAULTS

    monkeypatch.setattr(cmd, "load_embedder", lambda settings: embedder)
    sts, beir = sts_and_beir(tmp_path)
    (tmp_path / "unrelated").mkdir()

    def train(*flags: str) -> dict:
        assert cli.main(["train-pooler", *flags, "--epochs", "1", "--out", str(tmp_path / "head"),
                         "--cache-dir", str(tmp_path / "cache")]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    summary = train("--sts", str(sts), "--dev-split", "dev")
    assert {k: summary[k] for k in OBJECTIVE_DEFAULTS["cosent"]} == OBJECTIVE_DEFAULTS["cosent"]
    assert summary["roles"] == "shared"
    assert summary["guard"] == f"{beir} train" and summary["guard_rule"].startswith("significant")
    summary = train("--data", str(beir), "--lr", "0.01", "--guard-tolerance", "0.5")
    assert summary["lr"] == 0.01 and summary["patience"] == OBJECTIVE_DEFAULTS["infonce"]["patience"]
    assert summary["roles"] == "separate"  # query/document pairs: a head for each by default
    assert summary["guard"] == f"{sts} dev" and summary["guard_rule"] == "more than 0.5 below"
    summary = train("--data", str(beir), "--no-guard")
    assert "guard" not in summary
