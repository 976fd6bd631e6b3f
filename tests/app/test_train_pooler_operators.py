"""``embedpool train-pooler --pooler mixed|gated|gem|ggem`` end to end on tiny data (issue 51): the
same objectives, dev selection, guard and anchor as the other heads, and the saved head serves as
``NAME:weights=DIR``."""

from __future__ import annotations

import json

from embedpool.app import cli
from embedpool.app.commands import train_pooler as cmd
from test_train_pooler_cli import sts_and_beir  # noqa: E402  (tests/app is on sys.path)


def test_train_pooler_generalized_and_gem_heads(embedder, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cmd, "load_embedder", lambda settings: embedder)
    sts, beir = sts_and_beir(tmp_path)
    runs = {  # retrieval pairs guarded by STS with the anchor; STS pairs with a dev split; ggem's --heads
        "mixed": ["--data", str(beir), "--guard-sts", str(sts), "--anchor", "0.5"],
        "gated": ["--sts", str(sts), "--dev-split", "dev", "--no-guard"],
        "gem": ["--data", str(beir), "--roles", "separate", "--no-guard"],
        "ggem": ["--sts", str(sts), "--dev-split", "dev", "--heads", "4", "--guard-data", str(beir)],
    }
    for name, args in runs.items():
        out = tmp_path / name
        assert cli.main(["train-pooler", "--pooler", name, *args, "--epochs", "1", "--out", str(out),
                         "--cache-dir", str(tmp_path / "cache")]) == 0, name
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert summary["pooler"] == f"{name}:weights={out}", name
        config = json.loads((out / "head.json").read_text())
        assert config["kind"] == name and config["encoder"] == embedder.encoder.model_id
        assert embedder.pooler(summary["pooler"]).spec == f"{name}:weights={out}"
        assert embedder.embed(["a cat"], [summary["pooler"]]).matrix(summary["pooler"]).shape == (1, 384)
    assert json.loads((tmp_path / "ggem" / "head.json").read_text())["groups"] == 4
    assert json.loads((tmp_path / "gem" / "head.json").read_text())["roles"] == "separate"
    assert cli.main(["train-pooler", "--pooler", "gem", "--heads", "2", "--sts", str(sts), "--no-guard",
                     "--out", str(tmp_path / "no")]) == 2
    assert "queries and heads must be 1" in capsys.readouterr().err
