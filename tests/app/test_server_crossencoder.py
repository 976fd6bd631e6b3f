"""Cross-encoder rerankers (issue 53, parts 1 and 3) through a real uvicorn server: tiny random-weight
sequence-classification models built here -- a sentence-transformers ``CrossEncoder`` save
(BERT, one logit), bare transformers checkpoints (BERT with two logits; XLM-R and ModernBERT, mean
pooling head, with one) -- served beside an embedding model from ``--model NAME=PATH`` entries. Their scores on
``/rerank``, ``/tei/rerank`` and ``/v1/rerank`` (Cohere's SDK) equal sentence-transformers'
``CrossEncoder.predict`` on the same folder (fp32 abs ≤ 1e-5, the same order; the ``auto``
precision path ≤ 1e-3), and the bad inputs are clear 4xx answers."""

from __future__ import annotations

import json
import re
import time

import httpx
import numpy as np
import pytest
import torch

from embedpool.app.server import create_app
from embedpool.app.settings import Settings, load_embedder
from embedpool.errors import InvalidError
from family_models import FAMILIES, bpe_tokenizer, build, minilm_tokenizer
from server_testutil import Uvicorn

WINDOW = 48
QUERY = "what reduces stroke risk?"
DOCS = [
    "Aspirin lowers the risk of stroke.",
    "The control group, given placebo, reported more headaches; the treated group fewer strokes!",
    "the study found that patients treated with aspirin had fewer strokes than those given placebo " * 4,  # past the window
    "",
    "Two dogs are running through a field of tall grass.",
    "Stroke risk falls with lower blood pressure.",
]
LONG = DOCS[2]
MAX_REQUEST_TOKENS = 4096  # a rerank of 100 pairs of the window (4,800 tokens) is over it


def _classifier(arch: str, labels: int, seed: int):
    """A random-weight sequence-classification model and its tokenizer (window ``WINDOW``)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                  num_labels=labels, initializer_range=0.1)  # wider than the default: scores spread out
    if arch in ("bert", "modernbert"):
        tok = minilm_tokenizer()
        ids = dict(max_position_embeddings=128, vocab_size=len(tok), pad_token_id=tok.pad_token_id)
        if arch == "bert":
            cfg = tf.BertConfig(**common, **ids)
        else:  # its head pools the mean of the token states (its own, not the [CLS] one)
            cfg = tf.ModernBertConfig(**common, **ids, cls_token_id=tok.cls_token_id, sep_token_id=tok.sep_token_id,
                                      bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id,
                                      global_attn_every_n_layers=2, local_attention=16, classifier_pooling="mean")
    else:
        tok = bpe_tokenizer("roberta")
        cfg = tf.XLMRobertaConfig(**common, max_position_embeddings=WINDOW + 2 + tok.pad_token_id, vocab_size=len(tok),
                                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, type_vocab_size=1)
    tok.model_max_length = WINDOW
    return tf.AutoModelForSequenceClassification.from_config(cfg), tok


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> folder: ``ce`` saved by ``CrossEncoder.save``, ``pair``, ``xlmr`` and ``mbert`` bare
    checkpoints, ``emb`` a tiny embedding model."""
    from sentence_transformers import CrossEncoder

    root = tmp_path_factory.mktemp("rerankers")
    out = {}
    for name, arch, labels, seed in [("ce", "bert", 1, 0), ("pair", "bert", 2, 1), ("xlmr", "xlmr", 1, 2),
                                     ("mbert", "modernbert", 1, 3)]:
        model, tok = _classifier(arch, labels, seed)
        hf = root / f"hf-{name}"
        model.save_pretrained(hf)
        tok.save_pretrained(hf)
        out[name] = hf
    saved = root / "ce-st"
    CrossEncoder(str(out["ce"]), device="cpu").save(str(saved))  # a sentence-transformers CrossEncoder folder
    out["ce"] = saved
    assert json.loads((saved / "config_sentence_transformers.json").read_text())["model_type"] == "CrossEncoder"
    assert not (out["pair"] / "modules.json").exists()
    out["emb"] = build(FAMILIES["bert-dense"], root)
    return out


def reference(folder, query, docs, raw=False) -> np.ndarray:
    """sentence-transformers' ``CrossEncoder.predict`` on the folder: the score a reranker gives (a
    two-logit head: the softmax probability of the second label), raw: before the activation (two
    logits: their difference, whose sigmoid is that probability)."""
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(str(folder), device="cpu", local_files_only=True)
    pairs = [(query, d) for d in docs]
    if ce.num_labels == 1:
        return ce.predict(pairs, activation_fn=torch.nn.Identity() if raw else None)
    if raw:
        logits = ce.predict(pairs, activation_fn=torch.nn.Identity())
        return logits[:, 1] - logits[:, 0]
    return ce.predict(pairs, apply_softmax=True)[:, 1]


def serve(settings: Settings):
    server = Uvicorn(create_app(settings))
    url = server.__enter__()
    client = httpx.Client(base_url=url, timeout=120)
    deadline = time.monotonic() + 240
    while (r := client.get("/health")).status_code != 200:
        assert time.monotonic() < deadline and r.json()["status"] == "loading", r.text
        time.sleep(0.2)
    return server, client


@pytest.fixture(scope="module")
def client(folders, tmp_path_factory):
    entries = ",".join(f"{n}={folders[n]}" for n in ("ce", "pair", "xlmr", "mbert", "emb"))
    server, c = serve(Settings(model=entries, precision="fp32", max_request_tokens=MAX_REQUEST_TOKENS,
                               data_dir=str(tmp_path_factory.mktemp("data"))))
    try:
        yield c
    finally:
        c.close()
        server.__exit__(None, None, None)


def rounds(client) -> float:
    """The batcher rounds the server has run (all models)."""
    text = client.get("/metrics").text
    return float(re.search(r"^embedpool_batch_size_count (\S+)$", text, re.M).group(1))


def scores_by_index(ranks, key="score") -> np.ndarray:
    got = {r["index"]: r[key] for r in ranks}
    assert sorted(got) == list(range(len(got)))
    return np.asarray([got[i] for i in range(len(got))], dtype=np.float64)


@pytest.mark.parametrize("name", ["ce", "pair", "xlmr", "mbert"])
def test_rerank_scores_equal_crossencoder_predict(client, folders, name):
    want = reference(folders[name], QUERY, DOCS)
    assert np.ptp(want) > 1e-3  # the scores are not all alike: the order means something
    r = client.post("/rerank", json={"model": name, "query": QUERY, "texts": DOCS, "truncate": True,
                                     "return_text": True})
    assert r.status_code == 200, r.text
    ranks = r.json()
    assert np.abs(scores_by_index(ranks) - want).max() <= 1e-5
    assert [x["index"] for x in ranks] == list(np.argsort(-want, kind="stable"))
    assert all(x["text"] == DOCS[x["index"]] for x in ranks)
    raw = client.post("/rerank", json={"model": name, "query": QUERY, "texts": DOCS, "truncate": True,
                                       "raw_scores": True}).json()
    assert np.abs(scores_by_index(raw) - reference(folders[name], QUERY, DOCS, raw=True)).max() <= 1e-5
    assert "text" not in raw[0]


def test_tei_and_cohere_bodies(client, folders, loopback_only):
    import cohere

    want = reference(folders["ce"], QUERY, DOCS)
    order = list(np.argsort(-want, kind="stable"))
    # TEI's body under the model's TEI base URL; an unset truncate cuts at the window (TEI's default)
    r = client.post("/models/ce/tei/rerank", json={"query": QUERY, "texts": DOCS, "return_text": True})
    assert r.status_code == 200, r.text
    assert np.abs(scores_by_index(r.json()) - want).max() <= 1e-5
    assert [x["index"] for x in r.json()] == order and r.json()[0]["text"] == DOCS[order[0]]
    info = client.get("/models/ce/tei/info").json()
    assert info["model_type"] == {"reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}}
    assert info["max_input_length"] == WINDOW
    # Cohere's body, through Cohere's own SDK: documents as strings and as {"text"} objects, top_n
    co = cohere.ClientV2(api_key="unused", base_url=str(client.base_url))
    out = co.rerank(model="ce", query=QUERY, documents=DOCS, top_n=3)
    assert [x.index for x in out.results] == order[:3]
    assert np.abs(np.asarray([x.relevance_score for x in out.results]) - want[order[:3]]).max() <= 1e-5
    body = {"model": "pair", "query": QUERY, "documents": [{"text": d} for d in DOCS], "return_documents": True}
    r = client.post("/v1/rerank", json=body)
    assert r.status_code == 200, r.text
    pair = reference(folders["pair"], QUERY, DOCS)
    assert np.abs(scores_by_index(r.json()["results"], "relevance_score") - pair).max() <= 1e-5
    assert all(x["document"]["text"] == DOCS[x["index"]] for x in r.json()["results"])
    assert r.json()["model"] == str(folders["pair"]) and r.json()["usage"]["total_tokens"] > 0
    raw = client.post("/v1/rerank", json={**body, "raw_scores": True}).json()["results"]
    assert np.abs(scores_by_index(raw, "relevance_score") - reference(folders["pair"], QUERY, DOCS, raw=True)).max() <= 1e-5


def test_many_pairs_are_batched_over_rounds_and_requests(client, folders):
    """80 pairs of the whole window (3,840 tokens) take two of the batcher's 2,048-token rounds,
    while other requests share them: every score stays the reference's, in request order."""
    import concurrent.futures

    docs = [f"{i} {LONG}" for i in range(80)]
    want = reference(folders["ce"], QUERY, docs)
    small = [(f"query {i}", DOCS[:3]) for i in range(6)]

    def rank(query, texts):
        r = client.post("/rerank", json={"model": "ce", "query": query, "texts": texts, "truncate": True})
        assert r.status_code == 200, r.text
        return scores_by_index(r.json())

    before = rounds(client)
    assert np.abs(rank(QUERY, docs) - want).max() <= 1e-5
    deadline = time.monotonic() + 10  # a round is counted after its answers are delivered
    while rounds(client) - before < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rounds(client) - before >= 2  # alone, it took more than one round
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        big = pool.submit(rank, QUERY, docs)
        others = [pool.submit(rank, q, t) for q, t in small]
        assert np.abs(big.result() - want).max() <= 1e-5
        for (q, t), f in zip(small, others):
            assert np.abs(f.result() - reference(folders["ce"], q, t)).max() <= 1e-5


def test_bad_input(client, folders):
    # over the window with truncate=false: 422 naming the text, as for embeddings (TEI's shape on /tei)
    r = client.post("/rerank", json={"model": "ce", "query": QUERY, "texts": DOCS})  # POST /rerank: truncate false
    assert r.status_code == 422 and "texts[2]" in r.text and f"window of {WINDOW}" in r.text, r.text
    r = client.post("/models/ce/tei/rerank", json={"query": QUERY, "texts": DOCS, "truncate": False})
    assert r.status_code == 422 and r.json()["error_type"] == "Validation" and "texts[2]" in r.json()["error"]
    # more tokens than max_request_tokens: 413
    r = client.post("/rerank", json={"model": "ce", "query": QUERY, "texts": [LONG] * 100, "truncate": True})
    assert r.status_code == 413 and "max_request_tokens" in r.text, r.text
    # empty documents
    assert client.post("/rerank", json={"model": "ce", "query": QUERY, "texts": []}).status_code == 422
    r = client.post("/models/ce/tei/rerank", json={"query": QUERY, "texts": []})
    assert r.status_code == 400 and r.json()["error_type"] == "Empty"
    assert client.post("/v1/rerank", json={"model": "ce", "query": QUERY, "documents": []}).status_code == 422
    # a pooler means nothing to a cross-encoder
    r = client.post("/rerank", json={"model": "ce", "query": QUERY, "texts": DOCS[:2], "pooler": "mean"})
    assert r.status_code == 422 and "pooler" in r.text
    # a reranker asked for embeddings, on every embedding route: 422 naming the model and what it is
    for path, body in [("/embed", {"model": "pair", "inputs": ["x"]}),
                       ("/v1/embeddings", {"model": "pair", "input": ["x"]}),
                       ("/models/pair/tei/embed", {"inputs": ["x"]}),
                       ("/models/pair/tei/v1/embeddings", {"input": "x", "model": "pair"}),
                       ("/tokenize", {"model": "pair", "inputs": ["x"]}),
                       ("/collections", {"name": "c1", "model": "pair"})]:
        r = client.post(path, json=body)
        assert r.status_code == 422, (path, r.text)
        assert "'pair' is a reranker" in r.text and "/rerank" in r.text, (path, r.text)
    # and the reverse: an embedding model's rerank keeps scoring by its vectors (MaxSim of `tokens`)
    r = client.post("/rerank", json={"model": "emb", "query": QUERY, "texts": DOCS[:2], "truncate": True})
    assert r.status_code == 200 and len(r.json()) == 2
    # a collection on the embedding model works beside the rerankers (the first model is one)
    r = client.post("/collections", json={"name": "c2", "model": "emb"})
    assert r.status_code in (200, 201), r.text
    r = client.post("/collections/c2/documents", json={"documents": [{"id": "a", "text": DOCS[0]}]})
    assert r.status_code in (200, 201), r.text
    assert client.post("/collections/c2/search", json={"query": QUERY, "k": 1}).status_code == 200


def test_info_says_which_models_are_rerankers(client, folders):
    info = client.get("/info").json()
    kinds = {m["name"]: (m["kind"], m["dim"], m["num_labels"], m["max_length"]) for m in info["models"]}
    assert kinds == {"ce": ("reranker", None, 1, WINDOW), "pair": ("reranker", None, 2, WINDOW),
                     "xlmr": ("reranker", None, 1, WINDOW), "mbert": ("reranker", None, 1, WINDOW),
                     "emb": ("embedding", 16, None, WINDOW)}
    assert info["dim"] is None and info["default_pooler"] is None  # the default model is a reranker
    served = {m["id"] for m in client.get("/v1/models").json()["data"]}
    assert {"ce", "pair", "xlmr", "emb", str(folders["ce"])} <= served


def test_cli_refuses_a_reranker_for_embeddings(folders):
    with pytest.raises(InvalidError, match="is a reranker"):
        load_embedder(Settings(model=str(folders["pair"])))


def test_auto_precision_path_within_1e3(folders, tmp_path_factory):
    """The ``auto`` path of this CPU (OpenVINO bf16 on AVX-512-BF16, ...) on a server: every score
    within 1e-3 of ``CrossEncoder.predict`` fp32, and the order equal wherever the reference's
    scores are more than twice that apart."""
    server, c = serve(Settings(model=f"ce={folders['ce']}", precision="auto",  # every head: the slow test below
                               data_dir=str(tmp_path_factory.mktemp("auto"))))
    try:
        from embedpool.poolers.precision import resolve

        paths = {m["name"]: m["precision"] for m in c.get("/info").json()["models"]}
        assert paths == {"ce": resolve("auto")[0]}  # built, not fallen back to fp32
        for name in ("ce",):
            want = reference(folders[name], QUERY, DOCS)
            ranks = c.post("/rerank", json={"model": name, "query": QUERY, "texts": DOCS, "truncate": True}).json()
            got = scores_by_index(ranks)
            assert np.abs(got - want).max() <= 1e-3, (name, paths[name])
            pos = {x["index"]: k for k, x in enumerate(ranks)}
            for i in range(len(DOCS)):
                for j in range(len(DOCS)):
                    if want[i] > want[j] + 2e-3:
                        assert pos[i] < pos[j], (name, paths[name], i, j)
    finally:
        c.close()
        server.__exit__(None, None, None)


def test_collection_search_rerank_stage(client, folders):
    """`rerank_model` on a collection's search: the best `rerank_candidates` of the search (any mode,
    hybrid included) scored by the reranker, the best `k` answered in its order with its scores,
    which equal CrossEncoder.predict of the query and each candidate's text."""
    texts = DOCS + ["Blood pressure drugs cut strokes by a third.", "Headaches were more common with placebo.",
                    "A recipe for sourdough bread.", "The stock market closed higher on Friday."]
    assert client.post("/collections", json={"name": "docs", "model": "emb", "pooler": "mean"}).status_code in (200, 201)
    r = client.post("/collections/docs/documents",
                    json={"documents": [{"id": f"d{i}", "text": t} for i, t in enumerate(texts)]})
    assert r.status_code in (200, 201), r.text
    queries = [QUERY, "headaches and placebo"]
    for mode in ("exhaustive", "bm25", "hybrid"):
        plain = client.post("/collections/docs/search", json={"queries": queries, "mode": mode, "k": 6}).json()
        r = client.post("/collections/docs/search", json={"queries": queries, "mode": mode, "k": 3,
                                                          "rerank_model": "ce", "rerank_candidates": 6})
        assert r.status_code == 200, r.text
        for query, candidates, got in zip(queries, plain["results"], r.json()["results"]):
            want = reference(folders["ce"], query, [h["text"] for h in candidates])
            order = np.argsort(-want, kind="stable")[:3]
            assert [h["id"] for h in got] == [candidates[i]["id"] for i in order], mode
            assert np.abs(np.asarray([h["score"] for h in got]) - want[order]).max() <= 1e-5
            assert all(h["text"] == texts[int(h["id"][1:])] for h in got)
        assert r.json()["usage"]["tokens"] > plain["usage"]["tokens"]
    one = client.post("/collections/docs/search", json={"query": QUERY, "k": 2, "rerank_model": "pair",
                                                        "include_text": False}).json()
    assert len(one["hits"]) == 2 and "text" not in one["hits"][0]
    # errors: an embedding model as the reranker, candidates without a reranker, an unknown model
    r = client.post("/collections/docs/search", json={"query": QUERY, "rerank_model": "emb"})
    assert r.status_code == 422 and "rerank_model" in r.text and "embedding model" in r.text, r.text
    r = client.post("/collections/docs/search", json={"query": QUERY, "rerank_candidates": 5})
    assert r.status_code == 422 and "rerank_model" in r.text, r.text
    assert client.post("/collections/docs/search", json={"query": QUERY, "rerank_model": "nope"}).status_code == 404


#: the paths `auto` chooses from on some CPU (poolers/precision.py's decisions), and bf16 autocast
AUTO_CANDIDATES = ["openvino-bf16", "openvino-fp32", "bf16-weights", "bf16"]


@pytest.mark.slow
@pytest.mark.parametrize("path", AUTO_CANDIDATES)
def test_every_auto_candidate_path_within_1e3(folders, path, tmp_path, monkeypatch):
    """Each path ``auto`` may choose on some CPU, asked for by name, on every reranker built here:
    scores within 1e-3 of ``CrossEncoder.predict`` fp32 (ModernBERT cannot run on OpenVINO: asked
    for by name, refused with the reason)."""
    from embedpool.poolers import CrossEncoderModel

    monkeypatch.setenv("EMBEDPOOL_CACHE_DIR", str(tmp_path))
    for name in ("ce", "pair", "xlmr", "mbert"):
        if name == "mbert" and path.startswith("openvino"):
            with pytest.raises(InvalidError, match="local attention"):
                CrossEncoderModel(str(folders[name]), precision=path)
            continue
        model = CrossEncoderModel(str(folders[name]), precision=path)
        assert model.precision == path
        got = model.scores(QUERY, DOCS)
        err = np.abs(got - reference(folders[name], QUERY, DOCS)).max()
        assert err <= 1e-3, (path, name, err)
