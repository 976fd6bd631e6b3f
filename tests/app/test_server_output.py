"""Output precision, base64, query role on the OpenAI route, TEI's prompt_name and
truncation_direction -- against a real server, with sentence-transformers as the reference."""

from __future__ import annotations

import base64
import warnings

import numpy as np
import pytest

QUERY_PROMPT = "query: "  # the prompt conftest.prompted_model_copy writes

TEXTS = ["The cat sat on the mat.", "Stock markets fell sharply on Monday.", "Quantum computers use qubits.",
         "She baked bread for the neighbours.", "Rain is expected tomorrow."]
PRECISIONS = ["float16", "int8", "uint8", "binary", "ubinary"]
DTYPES = {"float32": "<f4", "float16": "<f2", "int8": "i1", "uint8": "u1", "binary": "i1", "ubinary": "u1"}


def quantize_embeddings(*args, **kwargs):
    from sentence_transformers.util.quantization import quantize_embeddings as reference

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return reference(*args, **kwargs)


def unit(dim: int) -> np.ndarray:
    return np.stack([-np.ones(dim), np.ones(dim)]).astype(np.float32)


def post(client, path, body, status=200):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()


def test_quantized_outputs_equal_sentence_transformers(client):
    for pooler, dims in (("mean", None), ("mean", 100), ("tokens", None)):
        body = {"inputs": TEXTS, "pooler": pooler, "dimensions": dims}
        floats = post(client, "/embed", body)["embeddings"]
        floats = [np.asarray(e, dtype=np.float32) for e in floats]
        dim = floats[0].shape[-1]
        for precision in PRECISIONS:
            got = post(client, "/embed", {**body, "precision": precision})
            assert got["precision"] == precision
            if precision == "float16":
                want = [f.astype(np.float16) for f in floats]
            elif pooler == "tokens":  # a list of [n_i, dim] matrices, as sentence-transformers takes them
                want = quantize_embeddings(floats, precision, ranges=unit(dim))
            else:
                want = list(quantize_embeddings(np.stack(floats), precision, ranges=unit(dim)))
            for g, w in zip(got["embeddings"], want):
                assert np.array_equal(np.asarray(g, dtype=w.dtype), w), (pooler, precision)
            b64 = post(client, "/embed", {**body, "precision": precision, "encoding_format": "base64"})["embeddings"]
            for s, w in zip(b64, want):
                decoded = np.frombuffer(base64.b64decode(s), dtype=DTYPES[precision])
                assert np.array_equal(decoded.reshape(w.shape), w), (pooler, precision, "base64")
        b64 = post(client, "/embed", {**body, "encoding_format": "base64"})["embeddings"]  # float32
        for s, f in zip(b64, floats):
            assert np.array_equal(np.frombuffer(base64.b64decode(s), dtype="<f4").reshape(f.shape), f)


def test_int8_codes_do_not_depend_on_batch_mates(client):
    """The point of fixed ranges: a text gets the same codes alone or with any other texts
    (per-batch calibration, sentence-transformers' default, would not)."""
    together = post(client, "/embed", {"inputs": TEXTS, "precision": "int8"})["embeddings"]
    for text, codes in zip(TEXTS, together):
        alone = post(client, "/embed", {"inputs": text, "precision": "int8"})["embeddings"][0]
        assert alone == codes
    floats = np.asarray(post(client, "/embed", {"inputs": TEXTS})["embeddings"], dtype=np.float32)
    per_batch = quantize_embeddings(floats, "int8")
    per_other_batch = quantize_embeddings(floats[:3], "int8")
    assert not np.array_equal(per_batch[:3], per_other_batch)  # why the server does not do it


def test_int8_with_calibrated_ranges(client):
    calib = np.asarray(post(client, "/embed", {"inputs": [f"{t} ({i})" for i, t in enumerate(TEXTS * 4)]})["embeddings"],
                       dtype=np.float32)
    ranges = np.vstack([calib.min(0), calib.max(0)])
    floats = np.asarray(post(client, "/embed", {"inputs": TEXTS})["embeddings"], dtype=np.float32)
    for precision in ("int8", "uint8"):
        got = post(client, "/embed", {"inputs": TEXTS, "precision": precision, "ranges": ranges.tolist()})
        want = quantize_embeddings(floats, precision, calibration_embeddings=calib)
        assert np.array_equal(np.asarray(got["embeddings"]), want)
    # unnormalized vectors: fine with ranges, refused without
    raw = np.asarray(post(client, "/embed", {"inputs": TEXTS, "normalize": False})["embeddings"], dtype=np.float32)
    r = np.vstack([raw.min(0), raw.max(0)])
    got = post(client, "/embed", {"inputs": TEXTS, "normalize": False, "precision": "uint8", "ranges": r.tolist()})
    assert np.array_equal(np.asarray(got["embeddings"]), quantize_embeddings(raw, "uint8", ranges=r))


def test_output_precision_errors(server, client):
    def error(path, body):
        r = client.post(path, json=body)
        assert r.status_code == 422, r.text
        e = r.json()["error"]
        return e if isinstance(e, str) else e["message"]

    assert "needs explicit ranges" in error("/embed", {"inputs": "x", "normalize": False, "precision": "int8"})
    assert "expected 2 lists of 384 numbers" in error("/embed", {"inputs": "x", "precision": "int8",
                                                                  "ranges": [[0.0, 1.0], [1.0, 2.0]]})
    assert "expected 2 lists of 8 numbers" in error("/embed", {"inputs": "x", "precision": "int8", "dimensions": 8,
                                                                "ranges": [[-1.0] * 384, [1.0] * 384]})
    assert "maximum at least its minimum" in error("/embed", {"inputs": "x", "precision": "uint8",
                                                               "ranges": [[1.0] * 384, [-1.0] * 384]})
    assert "only int8 and uint8 use ranges" in error("/embed", {"inputs": "x", "precision": "binary",
                                                                 "ranges": [[-1.0] * 384, [1.0] * 384]})
    assert "precision" in error("/embed", {"inputs": "x", "precision": "int4"})
    assert "float32 only" in error("/v1/embeddings", {"input": "x", "precision": "int8", "encoding_format": "base64"})
    msg = error("/embed", {"inputs": "x", "prompt_name": "query_v2"})
    assert msg.startswith("prompt_name: the model has no prompt 'query_v2'") and "'query', 'document'" in msg
    assert "truncation_direction" in error("/embed", {"inputs": "x", "truncation_direction": "middle"})
    server.alive()


def test_openai_input_type_role_and_precision(client):
    def openai(**extra):
        return [np.asarray(d["embedding"]) for d in post(client, "/v1/embeddings", {"input": TEXTS, **extra})["data"]]

    def embed(**extra):
        return [np.asarray(e) for e in post(client, "/embed", {"inputs": TEXTS, **extra})["embeddings"]]

    for got, want in zip(openai(input_type="query"), embed(role="query")):
        assert np.allclose(got, want, atol=1e-6)
    for kwargs in ({"input_type": "passage"}, {"input_type": "document"}, {"role": "document"}, {}):
        for got, want in zip(openai(**kwargs), embed()):
            assert np.allclose(got, want, atol=1e-6), kwargs
    for got, want in zip(openai(precision="int8"), embed(precision="int8")):
        assert np.array_equal(got, want)
    for got, want in zip(openai(precision="ubinary", dimensions=64), embed(precision="ubinary", dimensions=64)):
        assert np.array_equal(got, want) and len(got) == 8
    r = client.post("/v1/embeddings", json={"input": "x", "input_type": "query", "role": "document"})
    assert r.status_code == 422 and "disagree" in r.json()["error"]["message"]


def test_truncation_direction_left_matches_sentence_transformers(client, st_model):
    long = " ".join(f"sentence {i} talks about topic {i % 7}." for i in range(120))
    right = post(client, "/embed", {"inputs": long})["embeddings"][0]
    left = post(client, "/embed", {"inputs": long, "truncation_direction": "left"})["embeddings"][0]
    assert not np.allclose(left, right, atol=1e-3)
    assert np.allclose(right, st_model.encode(long), atol=1e-5)
    tokenizer = st_model.tokenizer
    tokenizer.truncation_side = "left"
    try:
        want = st_model.encode(long)  # the reference: Hugging Face left truncation, specials kept
    finally:
        tokenizer.truncation_side = "right"
    assert float(np.dot(left, want)) >= 0.99999
    assert post(client, "/embed", {"inputs": "short", "truncation_direction": "left"})["embeddings"] == \
        post(client, "/embed", {"inputs": "short"})["embeddings"]


# ---------------------------------------------------------------------- a model with a query prompt
@pytest.fixture(scope="module")
def prompted_reference(prompted_server):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(prompted_server.model_path), device="cpu", local_files_only=True)


def test_query_prompt_through_openai_input_type(prompted_server, prompted_reference):
    st = prompted_reference
    assert st.prompts["query"] == QUERY_PROMPT
    with prompted_server.client() as c:
        query = np.asarray([d["embedding"] for d in post(c, "/v1/embeddings", {"input": TEXTS, "input_type": "query"})["data"]])
        doc = np.asarray([d["embedding"] for d in post(c, "/v1/embeddings", {"input": TEXTS})["data"]])
        passage = np.asarray([d["embedding"] for d in post(c, "/v1/embeddings", {"input": TEXTS, "input_type": "passage"})["data"]])
        role_query = np.asarray(post(c, "/embed", {"inputs": TEXTS, "role": "query"})["embeddings"])
        named = np.asarray(post(c, "/embed", {"inputs": TEXTS, "prompt_name": "query"})["embeddings"])
        title = np.asarray(post(c, "/embed", {"inputs": TEXTS, "prompt_name": "title"})["embeddings"])
        tokens = post(c, "/tokenize", {"inputs": TEXTS[0], "prompt_name": "query"})[0]
    assert np.allclose(query, role_query, atol=1e-6) and np.allclose(named, role_query, atol=1e-6)
    assert np.allclose(doc, passage, atol=1e-6)
    cos = (query * doc).sum(1)
    assert (cos < 0.999).all(), cos  # the query prompt changes the vector
    # sentence-transformers on the same folder: the prompt by name, and none for documents
    assert ((query * st.encode(TEXTS, prompt_name="query")).sum(1) >= 0.99999).all()
    assert ((doc * st.encode(TEXTS)).sum(1) >= 0.99999).all()
    assert ((title * st.encode(TEXTS, prompt_name="title")).sum(1) >= 0.99999).all()
    # /tokenize shows the prompt's tokens without offsets into the text
    assert [t["text"] for t in tokens[:4]] == ["[CLS]", "query", ":", "The"]  # the text's own characters
    assert tokens[1]["start"] is None and tokens[3]["start"] == 0 and tokens[3]["special"] is False
