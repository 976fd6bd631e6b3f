"""The evaluation command: metric wiring against hand-computed values, BEIR slices, synthetic long
documents, STS, and an end-to-end run on a small SciFact slice."""

from __future__ import annotations

import json
import math
import time

import pytest

from embedpool.app import datasets
from embedpool.app import evaluation as ev


# ------------------------------------------------------------------ metric wiring (no model)
def test_metrics_match_hand_computed_values():
    qrels = {"q1": {"d1": 1, "d2": 1}, "q2": {"d5": 2}, "q3": {"d9": 1}}
    run = {"q1": {"d3": 0.9, "d1": 0.8, "d2": 0.7},  # relevant at ranks 2 and 3
           "q2": {"d6": 0.9, "d5": 0.5},  # grade-2 document at rank 2
           "q3": {"d8": 0.1}}  # nothing relevant retrieved
    out = ev.score_runs(qrels, {"a": run})["a"]
    ndcg_q1 = (1 / math.log2(3) + 1 / math.log2(4)) / (1 + 1 / math.log2(3))
    ndcg_q2 = (2 / math.log2(3)) / 2
    per = out["per_query"]
    assert per["ndcg@10"]["q1"] == pytest.approx(ndcg_q1, abs=1e-9)  # 0.6934
    assert per["ndcg@10"]["q2"] == pytest.approx(ndcg_q2, abs=1e-9)  # 0.6309
    assert per["ndcg@10"]["q3"] == 0.0
    assert out["metrics"]["ndcg@10"] == pytest.approx((ndcg_q1 + ndcg_q2) / 3, abs=1e-9)
    assert out["metrics"]["mrr@10"] == pytest.approx((1 / 2 + 1 / 2 + 0) / 3)
    assert out["metrics"]["recall@100"] == pytest.approx((1 + 1 + 0) / 3)
    assert out["metrics"]["map@100"] == pytest.approx(((1 / 2 + 2 / 3) / 2 + 1 / 2 + 0) / 3)


def test_a_query_missing_from_the_run_scores_zero_and_p_values_compare_to_baseline():
    qrels = {f"q{i}": {f"d{i}": 1} for i in range(8)}
    good = {q: {next(iter(r)): 1.0, "x": 0.5} for q, r in qrels.items()}
    bad = {q: {"x": 1.0, next(iter(r)): 0.5} for q, r in list(qrels.items())[:7]}  # q7 absent
    out = ev.score_runs(qrels, {"good": good, "bad": bad, "same": dict(good)}, baseline="good")
    assert out["good"]["metrics"]["ndcg@10"] == 1.0 and out["good"]["p_values"] == {}
    assert out["bad"]["per_query"]["ndcg@10"]["q7"] == 0.0
    assert out["bad"]["metrics"]["mrr@10"] == pytest.approx(7 * 0.5 / 8)
    assert out["bad"]["p_values"]["ndcg@10"] < 0.01  # always worse: a clear difference
    assert out["same"]["p_values"]["ndcg@10"] == 1.0  # identical per-query scores
    fisher = ev.score_runs(qrels, {"good": good, "bad": bad}, baseline="good", stat_test="fisher")
    assert fisher["bad"]["p_values"]["ndcg@10"] < 0.05


# ------------------------------------------------------------------ synthetic long documents (no model)
@pytest.fixture(scope="module")
def scifact(data_dir):
    return datasets.load_beir(data_dir / "scifact", "test")


def test_synthetic_long_hides_each_needle_among_k_distractors(scifact):
    by_id = {r.id: r.text for r in scifact.corpus}
    a = ev.synthetic_long(scifact, 4, n_queries=20, seed=1)
    b = ev.synthetic_long(scifact, 16, n_queries=20, seed=1)
    assert set(a.qrels) == set(b.qrels) and len(a.qrels) == 20  # the same queries for every K
    needles = [r for r in a.corpus if r.metadata["needle"]]
    hay = [r for r in a.corpus if not r.metadata["needle"]]
    assert len(needles) == len(hay) and all(r.metadata["parts"] == 5 for r in a.corpus)
    for r in needles:
        assert by_id[r.metadata["needle"]] in r.text and r.id == "long-" + r.metadata["needle"]
    relevant = {d for rel in scifact.qrels.values() for d in rel}
    for r in hay:  # haystacks hold no document relevant to any query
        assert not any(by_id[d] in r.text for d in relevant if by_id[d])
    positions = [r.metadata["position"] for r in needles]
    assert len(set(positions)) > 1  # not always at the start
    for q, rel in a.qrels.items():
        assert set(rel) == {"long-" + d for d in scifact.qrels[q]}
    assert [r.text for r in ev.synthetic_long(scifact, 4, n_queries=20, seed=1).corpus] == [r.text for r in a.corpus]
    zero = ev.synthetic_long(scifact, 0, n_queries=20, seed=1)
    assert all(r.text == by_id[r.metadata["needle"]] for r in zero.corpus if r.metadata["needle"])


# ------------------------------------------------------------------ end to end (real model)
def test_eval_on_a_scifact_slice(embedder, scifact, tmp_path, monkeypatch, capsys):
    """The eval command on a 40-document slice. (The issue asks for 300 documents in well under a
    minute; the shared 2-core machine encodes 1-7 SciFact documents/s depending on load, so the
    time bound is on what the evaluation adds to encoding.)"""
    from embedpool.app import cli
    from embedpool.app.commands import eval as eval_cmd

    monkeypatch.setattr(eval_cmd, "load_embedder", lambda settings: embedder)
    out, md, png = tmp_path / "report.json", tmp_path / "report.md", tmp_path / "report.png"
    ev.score_runs({"q": {"d": 1}}, {"r": {"q": {"d": 1.0}}})  # ranx's one-off numba start-up, untimed
    tokens_before = embedder.encoder.stats.tokens
    t = time.perf_counter()
    assert cli.main(["eval", "--data", str(scifact.info["path"]), "--max-docs", "40", "--seed", "3", "--latency-queries", "4",
                     "--pooler", "mean", "--pooler", "cls", "--pooler", "cluster:pool_factor=2",
                     "--mode", "exhaustive", "--mode", "two_stage", "--out", str(out), "--markdown", str(md),
                     "--plot", str(png), "--no-progress"]) == 0
    elapsed = time.perf_counter() - t
    table = capsys.readouterr().out
    assert "nDCG@10" in table and "cluster:pool_factor=2" in table

    report = json.loads(out.read_text())
    encode = report["index"]["seconds"]
    print(f"eval on 40 documents: {elapsed:.1f}s, of which indexing (encoding) {encode:.1f}s")
    assert elapsed - encode < 60, f"evaluation took {elapsed:.0f}s beyond the {encode:.0f}s of indexing"
    assert report["documents"] == 40 and report["baseline"] == "mean"
    rows = {(r["pooler"], r["mode"]): r for r in report["results"]}
    assert list(rows) == [("mean", None), ("cls", None), ("cluster:pool_factor=2", "exhaustive"),
                          ("cluster:pool_factor=2", "two_stage")]
    for r in rows.values():
        for key in ("pooler", "ndcg@10", "recall@100", "mrr@10", "bytes_per_doc", "p_value"):
            assert key in r
        assert 0 <= r["ndcg@10"] <= 1 and r["documents"] == 40 and r["query_latency_ms"] > 0
    assert rows[("mean", None)]["p_value"] is None
    assert all(0 <= r["p_value"] <= 1 for k, r in rows.items() if k != ("mean", None))
    assert rows[("mean", None)]["ndcg@10"] > 0.7  # relevant docs among 30 random others
    assert rows[("mean", None)]["recall@100"] == 1.0  # the whole slice is within the top 100
    # a multi-vector pooler costs many vectors per document, and its collection keeps a mean
    # companion row per document (float32 token vectors, 16 bytes of offsets and ids)
    cl, cl2 = rows[("cluster:pool_factor=2", "exhaustive")], rows[("cluster:pool_factor=2", "two_stage")]
    assert cl["vectors_per_doc"] > 20
    assert cl["bytes_per_doc"] == cl2["bytes_per_doc"] == pytest.approx(
        cl["vectors_per_doc"] * 384 * 4 + 16 + 384 * 4)
    # all the poolers of a plan came from one forward pass over the corpus and one over the queries
    # (plus the first 4 queries once more, one at a time, for the latency figure)
    sl = datasets.slice_beir(scifact, 40, seed=3)
    queries = [scifact.queries[q] for q in sl.qrels]
    count = lambda texts: sum(embedder.measure(texts, ["mean"]).counts)  # noqa: E731 - standard-plan tokens
    expected = count([r.text for r in sl.corpus]) + count(queries) + count(queries[:4])
    assert embedder.encoder.stats.tokens - tokens_before == expected
    assert "| `mean` |" in md.read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_without_latency_queries_reports_no_search_time(embedder, scifact, tmp_path, monkeypatch, capsys):
    """--latency-queries 0 measures no search time: the report says so (None), it does not crash."""
    from embedpool.app import cli
    from embedpool.app.commands import eval as eval_cmd

    monkeypatch.setattr(eval_cmd, "load_embedder", lambda settings: embedder)
    out = tmp_path / "report.json"
    assert cli.main(["eval", "--data", str(scifact.info["path"]), "--max-docs", "10", "--seed", "1",
                     "--latency-queries", "0", "--pooler", "mean", "--out", str(out), "--no-progress"]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["search_ms"] is None and 0 <= row["ndcg@10"] <= 1


def test_bm25_and_hybrid_rows_beside_the_pooler(embedder, scifact, tmp_path, monkeypatch, capsys):
    """--mode bm25,hybrid: a BM25 row whose nDCG@10 is bm25s' own on the slice (same tokenization,
    scores ranked by ranx here), and per pooler a hybrid row; at --weight 1 the hybrid row is the
    vector row exactly (its paired p-value against it is 1)."""
    import bm25s
    import Stemmer

    from embedpool.app import cli
    from embedpool.app.commands import eval as eval_cmd

    monkeypatch.setattr(eval_cmd, "load_embedder", lambda settings: embedder)
    out = tmp_path / "report.json"
    assert cli.main(["eval", "--data", str(scifact.info["path"]), "--max-docs", "16", "--seed", "2",
                     "--latency-queries", "1", "--pooler", "mean", "--mode", "bm25,hybrid", "--weight", "1",
                     "--out", str(out), "--no-progress"]) == 0
    assert "p vs bm25" in capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = {r["label"]: r for r in report["results"]}
    assert list(rows) == ["bm25", "mean", "mean [hybrid]"] and report["baseline"] == "mean"
    assert rows["bm25"]["kind"] == "lexical" and rows["mean [hybrid]"]["mode"] == "hybrid"
    assert rows["mean [hybrid]"]["ndcg@10"] == rows["mean"]["ndcg@10"] and rows["mean [hybrid]"]["p_vs_vector"] == 1.0
    assert 0 <= rows["mean [hybrid]"]["p_vs_bm25"] <= 1 and 0 <= rows["bm25"]["p_value"] <= 1
    sl = datasets.slice_beir(scifact, 16, seed=2)
    stem = Stemmer.Stemmer("english").stemWords
    ref = bm25s.BM25(method="robertson", k1=1.2, b=0.75)
    ref.index(bm25s.tokenize([r.text for r in sl.corpus], stemmer=stem, show_progress=False), show_progress=False)
    run = {}
    for q in sl.qrels:
        terms = bm25s.tokenize([sl.queries[q]], stemmer=stem, return_ids=False, show_progress=False)[0]
        scores = ref.get_scores(list(dict.fromkeys(terms))) if terms else []
        run[q] = {r.id: float(x) for r, x in zip(sl.corpus, scores) if x > 0}
    assert rows["bm25"]["ndcg@10"] == pytest.approx(ev.score_runs(sl.qrels, {"ref": run})["ref"]["metrics"]["ndcg@10"],
                                                    abs=1e-9)


def test_sts_eval_on_a_slice(embedder, data_dir, tmp_path):
    pairs = datasets.load_sts(data_dir / "stsb", "test")[:150]
    report = ev.evaluate_sts(embedder, pairs, ["mean", "cls"])
    rows = {r["pooler"]: r for r in report["results"]}
    assert rows["mean"]["spearman"] > 0.75 and rows["mean"]["p_value"] is None
    assert rows["cls"]["spearman"] < rows["mean"]["spearman"] and 0 < rows["cls"]["p_value"] <= 1
    ev.write_outputs(report, tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.png")
    assert json.loads((tmp_path / "r.json").read_text())["results"][0]["spearman"] == rows["mean"]["spearman"]


def _beir_folder(src: datasets.BeirData, train: datasets.BeirData, root, n: int = 6, others: int = 8):
    """A small BEIR folder from SciFact: the documents judged for ``n`` test and ``n`` train
    queries plus ``others``, with both splits' qrels."""
    test_q, train_q = list(src.qrels)[:n], list(train.qrels)[:n]
    keep = {d for q in test_q for d in src.qrels[q]} | {d for q in train_q for d in train.qrels[q]}
    keep |= set([r.id for r in src.corpus if r.id not in keep][:others])
    (root / "qrels").mkdir(parents=True)
    with open(root / "corpus.jsonl", "w") as f:
        for r in src.corpus:
            if r.id in keep:
                f.write(json.dumps({"_id": r.id, "title": "", "text": r.text}) + "\n")
    with open(root / "queries.jsonl", "w") as f:
        for q in test_q:
            f.write(json.dumps({"_id": q, "text": src.queries[q]}) + "\n")
        for q in train_q:
            f.write(json.dumps({"_id": q, "text": train.queries[q]}) + "\n")
    for name, data, qs in (("test", src, test_q), ("train", train, train_q)):
        (root / "qrels" / f"{name}.tsv").write_text(
            "query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t{s}\n" for q in qs for d, s in data.qrels[q].items()))
    return root


def test_a_tuned_fusion_chooses_its_weight_on_the_dev_split_and_the_collection_keeps_it(
        embedder, scifact, data_dir, tmp_path, monkeypatch, capsys):
    """--fusion rrf,zscore:tuned: a hybrid row per fusion; the tuned one's weight is chosen on the
    train queries, stored in the collection, and a hybrid search of it that names no fusion (the
    service's default) scores the tuned row's nDCG@10 on the test queries. Tuning on the reported
    split is refused."""
    from embedpool.app import cli
    from embedpool.app.commands import eval as eval_cmd
    from embedpool.app.evaluation.fusion import GRID
    from embedpool.app.retrieval import Search, retrieve
    from embedpool.index import open_collection

    folder = _beir_folder(scifact, datasets.load_beir(data_dir / "scifact", "train"), tmp_path / "beir")
    monkeypatch.setattr(eval_cmd, "load_embedder", lambda settings: embedder)
    out, idx = tmp_path / "report.json", tmp_path / "idx"
    args = ["eval", "--data", str(folder), "--latency-queries", "1", "--pooler", "mean", "--mode", "bm25,hybrid",
            "--fusion", "rrf,zscore:tuned", "--index-dir", str(idx), "--out", str(out), "--no-progress"]
    assert cli.main(args) == 0
    report = json.loads(out.read_text())
    rows = {r["label"]: r for r in report["results"]}
    assert list(rows) == ["bm25", "mean", "mean [hybrid rrf]", "mean [hybrid zscore:tuned]"]
    rrf, tuned = rows["mean [hybrid rrf]"], rows["mean [hybrid zscore:tuned]"]
    assert (rrf["fusion"], rrf["weight"], rrf["tuned"]) == ("rrf", 0.5, None)
    assert tuned["fusion"] == "zscore" and tuned["weight"] in GRID and tuned["tuned"]["split"] == "train"
    assert tuned["tuned"]["queries"] == 6 and 0 <= tuned["p_vs_bm25"] <= 1 and 0 <= tuned["p_vs_vector"] <= 1
    data = datasets.load_beir(folder, "test")
    with open_collection(idx, "eval") as coll:
        assert coll.tuned_fusion() == ("zscore", tuned["weight"])
        qids = list(data.qrels)
        hits = retrieve(embedder, [data.queries[q] for q in qids], Search(coll, embedder.natural_dim, k=100,
                                                                          mode="hybrid"))
    run = {q: {h.id: h.score for h in hs} for q, hs in zip(qids, hits)}
    assert ev.score_runs(data.qrels, {"r": run})["r"]["metrics"]["ndcg@10"] == pytest.approx(tuned["ndcg@10"])
    capsys.readouterr()
    assert cli.main([*args, "--tune-split", "test"]) == 2
    assert "never chosen on the reported split" in capsys.readouterr().err
