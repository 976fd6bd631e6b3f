"""The batch indexing job: resumability after SIGKILL and Ctrl-C, refused
setting changes, one forward pass per tokenization plan, and the index/search CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from embedpool.app.datasets import CorpusSource, Record
from embedpool.app.indexing import IndexJob, JOB_PROPERTY, collection_name
from embedpool.errors import InvalidError
from embedpool.index import FaissCollection
from job_testutil import assert_same_collections, job_state, kill_mid_run, resume_in_process

POOLERS = ["mean", "cluster:pool_factor=2", "landmark"]


# ------------------------------------------------------------------ names (no model)
def test_collection_names():
    assert collection_name("sf", "mean", several=False) == "sf"
    assert collection_name("sf", "cluster:pool_factor=3", several=True) == "sf-cluster-pool_factor-3"
    assert collection_name("sf", "attention:weights=/tmp/x y", several=True) == "sf-attention-weights-tmp-x-y"


def test_engine_is_the_deprecated_name_of_runner(capsys):
    """``--runner`` chooses where the job embeds; ``--engine``, its older name, still sets it, and
    says it is deprecated in ``--help`` and when used."""
    from embedpool.app.cli import build_parser

    parser = build_parser()
    argv = ["index", "c.jsonl", "--collection", "x"]
    assert parser.parse_args(argv).runner == "in-process"
    assert parser.parse_args([*argv, "--runner", "ray"]).runner == "ray"
    assert capsys.readouterr().err == ""
    assert parser.parse_args([*argv, "--engine", "ray"]).runner == "ray"
    assert "--engine is deprecated, use --runner" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["index", "--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert "--runner {in-process,ray}" in usage and "deprecated: the older name of --runner" in usage


# ------------------------------------------------------------------ helpers
def _corpus(path: Path, data_dir: Path, n: int, chars: int = 400) -> list[Record]:
    """The first ``n`` SciFact documents, cut to ``chars`` characters (fast to encode)."""
    recs = []
    with open(data_dir / "scifact" / "corpus.jsonl") as f:
        for line, _ in zip(f, range(n)):
            d = json.loads(line)
            recs.append(Record(d["_id"], (d["title"] + " " + d["text"])[:chars]))
    with open(path, "w") as f:
        for r in recs:
            f.write(json.dumps({"_id": r.id, "title": "", "text": r.text}) + "\n")
    return recs


def _reference(embedder, corpus_path: Path, out: Path, commit_every=8, batch_docs=8) -> dict:
    src = CorpusSource(str(corpus_path))
    with IndexJob(embedder, out, "sf", POOLERS, source=src.describe(), commit_every=commit_every,
                  batch_docs=batch_docs, progress=False) as job:
        return job.run(src.records(), total=src.count())


# ------------------------------------------------------------------ resumability
def test_sigkill_mid_run_then_rerun_equals_uninterrupted(embedder, data_dir, tmp_path, monkeypatch, capsys):
    from embedpool.app import cli

    n = 64
    corpus = tmp_path / "corpus.jsonl"
    _corpus(corpus, data_dir, n)
    killed = tmp_path / "killed"
    args = ["index", str(corpus), "--data-dir", str(killed), "--collection", "sf",
            *sum((["--pooler", p] for p in POOLERS), []), "--commit-every", "8", "--batch-docs", "8",
            "--no-progress", "--precision", "fp32"]  # the in-process rerun below uses the fp32 embedder
    # the interrupted run: a real child process, killed with SIGKILL right after a commit
    kill_mid_run(args, killed / "sf-mean", at_least=16)
    states = {p.name: job_state(p)["committed_records"] for p in killed.iterdir() if job_state(p)}
    assert set(states) == {"sf-mean", "sf-cluster-pool_factor-2", "sf-landmark"}
    # really interrupted mid-run (collections commit one after the other: they may differ by a batch)
    assert min(states.values()) >= 8 and max(states.values()) < n, states
    for name, c in states.items():  # every collection reopens at its last commit
        with FaissCollection.open(killed, name) as coll:
            assert len(coll) >= c

    # the same command again continues it
    summary = resume_in_process(args, embedder, monkeypatch, capsys, min(states.values()), n)
    assert {c["collection"]: c["documents"] for c in summary["collections"]} == {k: n for k in states}

    ref = tmp_path / "ref"
    _reference(embedder, corpus, ref)
    assert_same_collections(ref, killed, sorted(states), n, atol=2e-5)
    # the multi-vector collection keeps mean companion rows for two_stage, written with its documents
    with FaissCollection.open(killed, "sf-cluster-pool_factor-2") as c:
        assert (c.spec.companion_pooler, c.spec.companion_rows, c.spec.kind) == ("mean", "document", "multi")
        assert c.stats()["companion_rows"] == n

    # a third run has nothing left to do
    assert cli.main(args + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["indexed_this_run"] == 0


def test_ctrl_c_commits_and_resumes(embedder, data_dir, tmp_path):
    n = 40
    corpus = tmp_path / "corpus.jsonl"
    recs = _corpus(corpus, data_dir, n, chars=200)
    src = CorpusSource(str(corpus))

    def interrupted():
        for i, r in enumerate(src.records()):
            if i == 21:
                raise KeyboardInterrupt
            yield r

    out = tmp_path / "a"
    with IndexJob(embedder, out, "sf", ["mean", "tokens"], source=src.describe(), commit_every=100,
                  batch_docs=4, progress=False) as job:
        with pytest.raises(KeyboardInterrupt):
            job.run(interrupted())
    # the 5 whole batches (20 records) were committed on the way out
    assert job_state(out / "sf-mean")["committed_records"] == 20
    assert job_state(out / "sf-tokens")["last_id"] == recs[19].id
    with IndexJob(embedder, out, "sf", ["mean", "tokens"], source=src.describe(), commit_every=100,
                  batch_docs=4, progress=False) as job:
        assert job.start == 20
        s = job.run(src.records())
    assert s["indexed_this_run"] == 20
    ref = tmp_path / "ref"
    with IndexJob(embedder, ref, "sf", ["mean", "tokens"], source=src.describe(), progress=False) as job:
        job.run(src.records())
    assert_same_collections(ref, out, ["sf-mean", "sf-tokens"], n, atol=2e-5)


def test_changed_settings_and_changed_corpus_are_refused(embedder, data_dir, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    _corpus(corpus, data_dir, 8, chars=120)
    src = CorpusSource(str(corpus))
    out = tmp_path / "d"
    with IndexJob(embedder, out, "c", ["mean"], source=src.describe(), progress=False) as job:
        job.run(src.records())
    other = CorpusSource(str(corpus), text_field="text", title_field="title")
    with pytest.raises(InvalidError, match=r"different settings \(source.text_field: None then, 'text' now"):
        IndexJob(embedder, out, "c", ["mean"], source=other.describe(), progress=False).open()
    with pytest.raises(InvalidError, match="dimensions: None then, 128 now"):
        IndexJob(embedder, out, "c", ["mean"], source=src.describe(), dimensions=128, progress=False).open()
    with pytest.raises(InvalidError, match="pooler: 'mean' then, 'cls' now"):
        IndexJob(embedder, out, "c", ["cls"], source=src.describe(), progress=False).open()
    with pytest.raises(ValueError, match="different spec"):  # the collection's own manifest check
        IndexJob(embedder, out, "c", ["mean"], source=src.describe(), factory="HNSW32", progress=False).open()
    # same settings, but the corpus is not the one the collection was made from
    lines = corpus.read_text().splitlines()
    corpus.write_text("\n".join(lines[:7] + [lines[7].replace('"_id": "', '"_id": "X')]) + "\n")
    with IndexJob(embedder, out, "c", ["mean"], source=src.describe(), progress=False) as job:
        with pytest.raises(InvalidError, match="the corpus changed"):
            job.run(src.records())
    # a collection that the job did not write is not adopted
    with FaissCollection.open_or_create(tmp_path / "d", "foreign", FaissCollection.open(out, "c").spec) as c:
        c.add(["z"], np.eye(1, embedder.dim, dtype=np.float32))
        c.commit()
    with pytest.raises(InvalidError, match="not written by `embedpool index`"):
        IndexJob(embedder, out, "foreign", ["mean"], source=src.describe(), progress=False).open()


def test_one_forward_pass_per_plan_for_all_poolers(embedder, data_dir, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    recs = _corpus(corpus, data_dir, 12, chars=300)
    src = CorpusSource(str(corpus))
    enc = embedder.encoder
    texts = [r.text for r in recs]
    standard = sum(embedder.measure(texts, ["mean"]).counts)
    landmark = sum(len(r.ids) for r in enc.tokenize(texts, embedder.pooler("landmark").plan))
    before = enc.stats.tokens
    with IndexJob(embedder, tmp_path / "d", "c", ["mean", "cls", "max", "tokens", "cluster:pool_factor=3",
                                                 "landmark"], source=src.describe(), progress=False) as job:
        s = job.run(src.records())
    # every token went through the encoder exactly once per plan, however many poolers
    assert enc.stats.tokens - before == s["tokens"] == standard + landmark
    assert {c["collection"] for c in s["collections"]} == {
        "c-mean", "c-cls", "c-max", "c-tokens", "c-cluster-pool_factor-3", "c-landmark"}


# ------------------------------------------------------------------ the CLI
def test_index_and_search_cli(embedder, data_dir, tmp_path, monkeypatch, capsys):
    from embedpool.app import cli
    from embedpool.app.commands import index as index_cmd, search as search_cmd

    monkeypatch.setattr(index_cmd, "load_embedder", lambda settings: embedder)
    monkeypatch.setattr(search_cmd, "load_embedder", lambda settings: embedder)
    corpus = tmp_path / "corpus.jsonl"
    recs = _corpus(corpus, data_dir, 10, chars=300)
    d = str(tmp_path / "data")
    assert cli.main(["index", str(corpus), "--data-dir", d, "--collection", "sf", "--pooler", "tokens",
                     "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "10 records" in out and "sf-mean" not in out  # tokens, keeping its mean companion rows itself
    assert [line.split()[:3] for line in out.splitlines() if line.startswith("sf ")] == [["sf", "tokens", "mean"]]
    for mode in ("exhaustive", "two_stage", "tokens"):
        assert cli.main(["search", "--data-dir", d, "--collection", "sf", "--query", recs[3].text,
                         "--query", recs[7].text, "-k", "3", "--mode", mode]) == 0
        lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert [x["hits"][0]["id"] for x in lines] == [recs[3].id, recs[7].id], mode
        assert len(lines[0]["hits"]) == 3 and lines[0]["hits"][0]["text"] == recs[3].text
    # errors are user errors (exit 2), not tracebacks
    assert cli.main(["search", "--data-dir", d, "--collection", "nope", "--query", "x"]) == 2
    assert "no collection 'nope'" in capsys.readouterr().err
    assert cli.main(["index", str(corpus), "--data-dir", d, "--collection", "sf", "--pooler", "tokens",
                     "--text-field", "title", "--no-progress"]) == 2
    assert "different settings" in capsys.readouterr().err


def test_resume_records_but_does_not_compare_the_encoder_path():
    """A job started with one encoder path may be continued with another (fp32 and the paths
    within the quality bar make compatible vectors); other settings still must match."""
    from embedpool.app.indexing import _diff_settings

    old = {"model": "m", "encoder_precision": "fp32", "pooler": "mean"}
    assert _diff_settings(old, {**old, "encoder_precision": "openvino-bf16"}) == []
    assert _diff_settings(old, {**old, "pooler": "cls"}) == ["pooler: 'mean' then, 'cls' now"]


def test_the_analyzer_is_a_collection_setting(embedder, tmp_path):
    """``--analyzer`` reaches the collections' spec (and so their BM25 index); a bad one is
    refused naming the flag, before anything is created; ``none`` keeps no lexical index."""
    from embedpool.index import open_collection

    with pytest.raises(InvalidError, match="--analyzer: .*unknown language 'klingon'"):
        IndexJob(embedder, tmp_path, "bad", ["mean"], analyzer="klingon", progress=False)
    assert not (tmp_path / "bad").exists()
    docs = [Record("a", "Die Katzen laufen schnell nach Hause"), Record("b", "Der Hund schläft")]
    for analyzer, name in (("german", "de"), ("none", "plain")):
        with IndexJob(embedder, tmp_path, name, ["mean"], analyzer=analyzer, progress=False) as job:
            job.run(docs)
        with open_collection(tmp_path, name) as coll:
            assert coll.spec.analyzer == analyzer
            if analyzer == "none":
                with pytest.raises(InvalidError, match="no lexical index"):
                    coll.search(k=2, mode="bm25", texts=["Katze"])
            else:  # the German stemmer: 'Katze' finds 'Katzen'
                assert [h.id for h in coll.search(k=2, mode="bm25", texts=["Katze"])[0]] == ["a"]


def test_a_record_no_backend_stores_fails_naming_its_line_before_its_batch_is_written(embedder, tmp_path, monkeypatch,
                                                                                       capsys):
    """A corpus record whose id or metadata not every backend stores (issue 50) stops the job with
    an error naming the file, line, id and the value's path, raised as the record is read: the
    records of its batch (here records 8-11: calls of 4) are not written, the committed ones stay,
    and a rerun on the corrected corpus resumes. The CLI takes the limits as flags."""
    from embedpool.app import cli
    from embedpool.app.commands import index as index_cmd

    corpus = tmp_path / "corpus.jsonl"
    records = [{"_id": f"r{i}", "text": f"record number {i}", "metadata": {"n": i}} for i in range(12)]
    records[9]["metadata"] = {"n": [1, 2 ** 64]}
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records))
    src = CorpusSource(str(corpus))
    options = dict(source=src.describe(), commit_every=4, batch_docs=4, progress=False)
    with pytest.raises(InvalidError) as e:
        with IndexJob(embedder, tmp_path / "d", "c", ["mean"], **options) as job:
            job.run(src.records(), total=12)
    assert str(e.value).startswith(f"{corpus}, line 10 (id 'r9'): metadata.n[1]: the integer 18446744073709551616 "
                                   "is outside the 64-bit range"), str(e.value)
    with FaissCollection.open(tmp_path / "d", "c") as coll:
        assert coll.ids() == [f"r{i}" for i in range(8)]
    records[9]["metadata"] = {"n": [1, str(2 ** 64)]}  # as the message says: a string
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records))
    with IndexJob(embedder, tmp_path / "d", "c", ["mean"], **options) as job:
        job.run(CorpusSource(str(corpus)).records(), total=12)
    with FaissCollection.open(tmp_path / "d", "c") as coll:
        assert len(coll) == 12 and coll.get("r9")["metadata"] == {"n": [1, "18446744073709551616"]}

    monkeypatch.setattr(index_cmd, "load_embedder", lambda settings: embedder)
    records[3]["metadata"] = {"deep": {"er": [1]}}
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = ["index", str(corpus), "--data-dir", str(tmp_path / "cli"), "--collection", "c", "--no-progress"]
    assert cli.main([*argv, "--max-metadata-depth", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{corpus}, line 4 (id 'r3'): metadata.deep.er: nested 3 levels deep" in err, err
    assert "max_metadata_depth = 2" in err and "Traceback" not in err
    assert cli.main([*argv, "--max-metadata-depth", "3", "--max-metadata-bytes", "20"]) == 2
    assert "line 10 (id 'r9'): metadata: 32 bytes as compact JSON; the limit is max_metadata_bytes = 20" \
        in capsys.readouterr().err
    assert cli.main(argv) == 0
