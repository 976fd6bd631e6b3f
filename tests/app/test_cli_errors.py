"""The CLI ends every error with the exit code of its kind, from the one table: user errors 2,
an unavailable backend 69, and an unexpected exception (a bug) 70 with its traceback, never the
usage error it used to be."""

from __future__ import annotations

import json

from embedpool.app import cli
from embedpool.errors import InvalidError, Kind


def test_an_unexpected_type_error_is_internal_not_usage(monkeypatch, capsys):
    from embedpool.app.commands import embed as embed_cmd

    def broken_loader(settings):  # a bug somewhere below the command
        return len(settings, "extra")

    monkeypatch.setattr(embed_cmd, "load_embedder", broken_loader)
    code = cli.main(["embed", "some text"])
    err = capsys.readouterr().err
    assert code == 70  # sysexits' EX_SOFTWARE
    assert "internal error" in err and "bug" in err and "TypeError" in err
    assert "Traceback (most recent call last)" in err and "broken_loader" in err


def test_bad_input_and_usage_errors_exit_2(monkeypatch, capsys, embedder, tmp_path):
    from embedpool.app.commands import embed as embed_cmd

    monkeypatch.setattr(embed_cmd, "load_embedder", lambda settings: embedder)
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"text": "fine"}\n{"text": "bad \\ud800 text"}\n')  # a lone surrogate in JSON
    assert cli.main(["embed", "--input", str(lines)]) == 2
    err = capsys.readouterr().err
    assert "input 1 is not valid Unicode" in err and "Traceback" not in err
    lines.write_text('plain text\n{"text": "fine"}\n{"text": "unterminated\n')  # a malformed JSON line
    assert cli.main(["embed", "--input", str(lines)]) == 2  # an error, not the text '{"text": ...'
    err = capsys.readouterr().err
    assert f"{lines}, line 3: invalid JSON" in err and "Traceback" not in err
    lines.write_text('{"title": "no text"}\n')
    assert cli.main(["embed", "--input", str(lines)]) == 2
    assert f"{lines}, line 1: a JSON line needs a string 'text' field" in capsys.readouterr().err
    assert cli.main(["embed", "--input", str(tmp_path / "missing.txt")]) == 2  # a file that is not there
    assert "missing.txt" in capsys.readouterr().err
    assert cli.main(["embed", "x", "--pooler", "median"]) == 2
    assert "unknown pooler 'median'" in capsys.readouterr().err
    assert cli.main(["embed", "x", "--dimensions", "0"]) == 2
    assert cli.main(["embed", "ok"]) == 0
    assert len(json.loads(capsys.readouterr().out.splitlines()[0])["embedding"]) == 384


def test_an_unreachable_backend_is_unavailable(capsys, tmp_path):
    code = cli.main(["search", "--data-dir", str(tmp_path), "--backend", "milvus",
                     "--milvus-uri", "http://127.0.0.1:9", "--collection", "c", "--query", "q"])
    err = capsys.readouterr().err
    assert code == 69, err  # sysexits' EX_UNAVAILABLE
    assert "cannot connect to Milvus" in err and "Traceback" not in err


def test_usage_error_is_raised_for_options_that_do_not_go_together(capsys, tmp_path):
    code = cli.main(["train-pooler", "--corpus", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "h")])
    assert code == 2 and "--corpus needs --self-supervised ict" in capsys.readouterr().err
    assert issubclass(InvalidError, ValueError) and InvalidError.kind is Kind.INVALID
