"""The one data loader (``app/datasets.py``): streaming corpus readers, BEIR corpus/queries/qrels,
STS TSVs, with the header, ``null`` and empty-text rules every command and benchmark relies on."""

from __future__ import annotations

import csv
import io
import sys

import pytest

from embedpool.app import datasets
from embedpool.app.datasets import CorpusSource, Record
from embedpool.errors import InvalidError, NotFoundError


# ------------------------------------------------------------------ readers (no model)
def test_beir_reader_joins_title_and_text(tmp_path):
    p = tmp_path / "corpus.jsonl"
    p.write_text('{"_id": "d1", "title": "Title one", "text": "Body one.", "metadata": {}}\n\n'
                 '{"_id": 7, "title": "", "text": "Body two."}\n')
    recs = list(CorpusSource(str(p)).records())
    assert [(r.id, r.text) for r in recs] == [("d1", "Title one Body one."), ("7", "Body two.")]
    assert CorpusSource(str(p)).count() == 3  # lines, for the ETA


def test_jsonl_reader_with_chosen_fields_and_errors(tmp_path):
    p = tmp_path / "docs.jsonl"
    p.write_text('{"doc": "a", "body": "alpha", "text": "ignored"}\n{"doc": "b", "body": null}\n')
    recs = list(CorpusSource(str(p), id_field="doc", text_field="body").records())
    assert [(r.id, r.text) for r in recs] == [("a", "alpha"), ("b", "")]
    with pytest.raises(InvalidError, match=r"line 1: no id field 'id'"):
        list(CorpusSource(str(p)).records())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "text": "ok"}\n{"id": "y", "text": 3}\n')
    with pytest.raises(InvalidError, match=r"line 2: field 'text' is int"):
        list(CorpusSource(str(bad)).records())
    with pytest.raises(NotFoundError, match="missing.jsonl"):
        CorpusSource(str(tmp_path / "missing.jsonl"))


def test_parquet_reader_streams_batches(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 2500  # more than one record batch
    pq.write_table(pa.table({"pid": [f"p{i}" for i in range(n)], "content": [f"text {i}" for i in range(n)],
                             "other": list(range(n))}), tmp_path / "c.parquet", row_group_size=1000)
    src = CorpusSource(str(tmp_path / "c.parquet"), id_field="pid", text_field="content")
    assert src.resolved_format() == "parquet" and src.count() == n
    recs = list(src.records())
    assert len(recs) == n and recs[0] == Record("p0", "text 0") and recs[-1].id == f"p{n - 1}"
    with pytest.raises(InvalidError, match="no column 'id'"):
        list(CorpusSource(str(tmp_path / "c.parquet")).records())


def test_stdin_reader_json_and_plain_lines(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"id": "j", "text": "json line"}\nplain line\n'))
    recs = list(CorpusSource("-").records())
    assert [(r.id, r.text) for r in recs] == [("j", "json line"), ("1", "plain line")]
    assert CorpusSource("-").count() is None


def test_null_and_missing_fields_of_a_beir_corpus(tmp_path):
    p = tmp_path / "corpus.jsonl"
    p.write_text('{"_id": "a", "title": null, "text": "only text"}\n'
                 '{"_id": "b", "title": "Only title", "text": null}\n'
                 '{"_id": "c", "title": "  ", "text": "  padded  "}\n'
                 '{"_id": "d", "text": ""}\n')
    recs = datasets.load_corpus(p)
    assert [(r.id, r.text) for r in recs] == [("a", "only text"), ("b", "Only title"), ("c", "padded"), ("d", "")]


def test_qrels_with_or_without_a_header_beir_or_trec(tmp_path):
    p = tmp_path / "q.tsv"
    want = {"q1": {"d1": 1, "d2": 2}, "q2": {"d3": 1}}
    p.write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\t2\n\nq1\td9\t0\nq2\td3\t1\nq2\td4\t-1\n")
    assert datasets.load_qrels(p) == want  # relevance <= 0 and blank lines dropped
    p.write_text("q1\td1\t1\nq1\td2\t2\nq2\td3\t1\n")  # no header
    assert datasets.load_qrels(p) == want
    p.write_text("q1 0 d1 1\nq1 0 d2 2\nq2 0 d3 1\n")  # TREC: query, iteration, document, relevance
    assert datasets.load_qrels(p) == want


def _beir(tmp_path, corpus: str, queries: str, qrels: str):
    (tmp_path / "qrels").mkdir(exist_ok=True)
    (tmp_path / "corpus.jsonl").write_text(corpus)
    (tmp_path / "queries.jsonl").write_text(queries)
    (tmp_path / "qrels" / "test.tsv").write_text(qrels)
    return datasets.load_beir(tmp_path, "test")


def test_beir_set_keeps_judged_queries_and_pairs_follow_qrels(tmp_path):
    data = _beir(tmp_path,
                 '{"_id": "d1", "title": "T1", "text": "one"}\n{"_id": "d2", "title": "", "text": "two"}\n',
                 '{"_id": "q1", "text": "first"}\n{"_id": "q2", "text": null}\n{"_id": "q3", "text": "unjudged"}\n',
                 "query-id\tcorpus-id\tscore\nq2\td2\t1\nq1\td1\t1\nq1\tmissing\t1\nq4\td1\t1\n")
    assert data.queries == {"q1": "first", "q2": ""}  # file order; unjudged q3 and unknown q4 left out
    assert data.qrels == {"q2": {"d2": 1}, "q1": {"d1": 1, "missing": 1}}
    assert [(r.id, r.text) for r in data.corpus] == [("d1", "T1 one"), ("d2", "two")]
    assert data.pairs() == [("", "two"), ("first", "T1 one")]  # qrels order; unknown documents skipped
    with pytest.raises(NotFoundError, match="qrels/dev.tsv"):
        datasets.load_beir(tmp_path, "dev")


def test_sts_header_columns_empty_sentences_and_bad_rows(tmp_path):
    (tmp_path / "test.tsv").write_text("score\tgenre\tsentence2\tsentence1\n1.5\tnews\tb\ta\n0\tx\t\tlonely\n")
    assert datasets.load_sts(tmp_path) == [("a", "b", 1.5), ("lonely", "", 0.0)]  # any column order
    assert datasets.sts_sentences(tmp_path) == ["a", "b", "lonely", ""]
    assert datasets.sts_sentences(tmp_path, unique=True) == ["a", "b", "lonely"]


BAD = [  # (loader, file name, content, the message must say)
    ("load_corpus", "corpus.jsonl", '{"_id": "a", "title": "no text field"}\n', r"line 1: no text field 'text'"),
    ("load_corpus", "corpus.jsonl", '{"_id": null, "text": "x"}\n', r"line 1: no id field '_id'"),
    ("load_corpus", "corpus.jsonl", '{"_id": "a", "text": "x"}\nnot json\n', r"line 2: not a JSON object"),
    ("load_queries", "queries.jsonl", '{"text": "no id"}\n', r"line 1: no '_id' field"),
    ("load_qrels", "q.tsv", "query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\n", r"q.tsv, line 3: expected"),
    ("load_qrels", "q.tsv", "q1\td1\t1\nq1\td2\thigh\n", r"line 2: expected .* integer score"),
    ("load_sts", "test.tsv", "sentence1\tsentence2\tscore\na\tb\t1\nc\td\n",
     r"line 3: expected sentence1, sentence2 and a numeric score"),
    ("load_sts", "test.tsv", "sentence1\tsentence2\tscore\na\tb\tgood\n", r"test.tsv, line 2"),
]


@pytest.mark.parametrize("loader,name,content,message", BAD)
def test_unreadable_lines_are_named(tmp_path, loader, name, content, message):
    (tmp_path / name).write_text(content)
    arg = tmp_path if loader == "load_sts" else tmp_path / name
    with pytest.raises(InvalidError, match=message):
        getattr(datasets, loader)(arg)


# ------------------------------------------------------------------ the shared data
@pytest.fixture(scope="module")
def scifact(data_dir):
    return datasets.load_beir(data_dir / "scifact", "test")


def test_beir_loader_and_slice(scifact):
    assert len(scifact.corpus) == 5183 and len(scifact.qrels) == 300
    assert sum(len(r) for r in scifact.qrels.values()) == 339
    doc = next(r for r in scifact.corpus if r.id == "4983")
    assert doc.text.startswith("Microstructural development of human newborn cerebral white matter")
    s = datasets.slice_beir(scifact, max_docs=60, seed=3)
    ids = {r.id for r in s.corpus}
    assert len(s.corpus) == 60 and len(s.qrels) >= 20
    assert all(d in ids for rel in s.qrels.values() for d in rel)  # every relevant doc is in the slice
    assert set(s.queries) == set(s.qrels)
    assert [r.id for r in datasets.slice_beir(scifact, max_docs=60, seed=3).corpus] == [r.id for r in s.corpus]


def test_sts_loader(data_dir, tmp_path):
    pairs = datasets.load_sts(data_dir / "stsb", "test")
    assert len(pairs) == 1379 and pairs[0] == ("A girl is styling her hair.", "A girl is brushing her hair.", 2.5)
    (tmp_path / "test.tsv").write_text("a\tb\tc\nx\ty\t1\n")
    with pytest.raises(ValueError, match="sentence1, sentence2 and score"):
        datasets.load_sts(tmp_path)


def test_tsv_readers_agree_with_pandas_on_the_shared_data(data_dir):
    """pandas' own TSV parser as the reference for the STS and qrels files."""
    import pandas as pd

    sts = pd.read_csv(data_dir / "stsb" / "dev.tsv", sep="\t", quoting=csv.QUOTE_NONE, keep_default_na=False,
                      dtype={"sentence1": str, "sentence2": str})
    assert datasets.load_sts(data_dir / "stsb", "dev") == list(zip(sts.sentence1, sts.sentence2, sts.score.astype(float)))
    q = pd.read_csv(data_dir / "scifact" / "qrels" / "train.tsv", sep="\t", dtype=str)
    want: dict[str, dict[str, int]] = {}
    for qid, did, score in zip(q["query-id"], q["corpus-id"], q["score"].astype(int)):
        if score > 0:
            want.setdefault(qid, {})[did] = score
    assert datasets.load_qrels(data_dir / "scifact" / "qrels" / "train.tsv") == want


# ------------------------------------------------------------------ slices (the Ray engine's reads)
def _by_slices(src: CorpusSource, size: int) -> list[Record]:
    out = []
    for s in src.slices(size):
        got = list(src.read_slice(s))
        assert len(got) == s.stop - s.start
        out += got
    return out


@pytest.mark.parametrize("size", [1, 2, 3, 100])
def test_slices_read_the_same_records_as_the_stream(tmp_path, size):
    p = tmp_path / "corpus.jsonl"
    p.write_text('\n{"_id": "a", "title": "T", "text": "one"}\n  \n\u00a0\n{"_id": "b", "text": "two ü"}\r\n'
                 '{"_id": "c", "title": null, "text": "three", "metadata": {"k": 1}}\n\n{"_id": "d", "text": ""}')
    src = CorpusSource(str(p))
    assert _by_slices(src, size) == list(src.records()) and len(list(src.records())) == 4
    assert [s.start for s in src.slices(size)] == list(range(0, 4, size))
    t = tmp_path / "lines.txt"
    t.write_text("first\n\nthird\nfourth\n")
    src = CorpusSource(str(t))
    assert _by_slices(src, size) == list(src.records())
    assert [r.id for r in src.records()] == ["0", "1", "2", "3"]


def test_slices_of_parquet_across_row_groups(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 2500
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(n)], "text": [f"text {i}" for i in range(n)]}),
                   tmp_path / "c.parquet", row_group_size=700)
    src = CorpusSource(str(tmp_path / "c.parquet"))
    assert _by_slices(src, 256) == list(src.records())
    assert list(src.read_slice(src.slices(1000)[1]))[0] == Record("p1000", "text 1000")
    pq.write_table(pa.table({"id": ["x", "y"], "text": pa.array([1, 2])}), tmp_path / "bad.parquet")
    with pytest.raises(InvalidError, match=r"row 0: column 'text' is int, expected a string"):
        list(CorpusSource(str(tmp_path / "bad.parquet")).records())


def test_slice_errors_name_the_same_line_as_the_stream(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text("".join(f'{{"id": "d{i}", "text": "t{i}"}}\n' for i in range(7)) + '\n{"id": "z", "text": 3}\n')
    src = CorpusSource(str(p))
    with pytest.raises(InvalidError, match=r"line 9: field 'text' is int") as stream:
        list(src.records())
    last = src.slices(3)[-1]
    assert (last.start, last.first_line) == (6, 7)
    with pytest.raises(InvalidError) as sliced:
        list(src.read_slice(last))
    assert str(sliced.value) == str(stream.value)
    with pytest.raises(InvalidError, match="stdin"):
        CorpusSource("-").slices(10)
    p.write_text('{"id": "a", "text": "x"}\n')  # the file changed under its slices
    with pytest.raises(InvalidError, match="changed"):
        list(src.read_slice(src.slices(3)[0].__class__(0, 0, 3, 0, 100, 1)))
