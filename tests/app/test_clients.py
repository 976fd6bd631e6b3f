"""Real clients against the running server: the OpenAI Python SDK and LangChain's
``OpenAIEmbeddings``. Nothing may leave the machine: every socket connection that is not to
loopback fails the test (``loopback_only`` in conftest.py; tiktoken, which LangChain imports,
would download its BPE files)."""

from __future__ import annotations

import numpy as np
import pytest

TEXTS = ["The cat sat on the mat.", "Stock markets fell sharply on Monday.", "Quantum computers use qubits."]


def embed(client, texts, **extra) -> np.ndarray:
    r = client.post("/embed", json={"inputs": texts, **extra})
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["embeddings"], dtype=np.float32)


def test_openai_sdk_round_trip(server, client, loopback_only):
    import openai

    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    want = embed(client, TEXTS)
    default = sdk.embeddings.create(model="text-embedding-3-small", input=TEXTS)  # the SDK asks for base64
    assert [d.index for d in default.data] == [0, 1, 2]
    assert default.model == "sentence-transformers/all-MiniLM-L6-v2" and default.usage.prompt_tokens > 0
    assert np.array_equal(np.asarray([d.embedding for d in default.data], dtype=np.float32), want)
    floats = sdk.embeddings.create(model="m", input=TEXTS, encoding_format="float")
    assert np.allclose([d.embedding for d in floats.data], want, atol=1e-7)
    raw = sdk.embeddings.create(model="m", input=TEXTS[0], encoding_format="base64")
    assert isinstance(raw.data[0].embedding, str)  # asked for explicitly: the SDK leaves it encoded
    small = sdk.embeddings.create(model="m", input=TEXTS, dimensions=64)
    assert np.allclose([d.embedding for d in small.data], embed(client, TEXTS, dimensions=64), atol=1e-6)
    query = sdk.embeddings.create(model="m", input=TEXTS, extra_body={"input_type": "query"})
    assert np.allclose([d.embedding for d in query.data], embed(client, TEXTS, role="query"), atol=1e-6)
    codes = sdk.embeddings.create(model="m", input=TEXTS, encoding_format="float", extra_body={"precision": "int8"})
    assert np.array_equal(np.asarray([d.embedding for d in codes.data]), embed(client, TEXTS, precision="int8"))
    with pytest.raises(openai.UnprocessableEntityError) as err:  # 422: the SDK reads OpenAI's error body
        sdk.embeddings.create(model="m", input=[])
    assert err.value.status_code == 422 and "at least one text" in err.value.message
    with pytest.raises(openai.UnprocessableEntityError) as err:  # the SDK's base64 would decode int8 as float32
        sdk.embeddings.create(model="m", input=TEXTS, extra_body={"precision": "int8"})
    assert "encoding_format='float'" in err.value.message


def test_openai_sdk_wrong_key(limited_server, loopback_only):
    import openai

    good = openai.OpenAI(base_url=f"{limited_server.url}/v1", api_key=limited_server.api_key, max_retries=0)
    assert len(good.embeddings.create(model="m", input="hi").data[0].embedding) == 384
    bad = openai.OpenAI(base_url=f"{limited_server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.embeddings.create(model="m", input="hi")
    assert "invalid API key" in err.value.message


def test_langchain_openai_embeddings(server, client, loopback_only):
    from langchain_openai import OpenAIEmbeddings

    common = dict(model="text-embedding-3-small", base_url=f"{server.url}/v1", api_key="unused",
                  check_embedding_ctx_length=False, max_retries=0)
    lc = OpenAIEmbeddings(**common)
    docs = lc.embed_documents(TEXTS)
    assert np.allclose(docs, embed(client, TEXTS), atol=1e-6)
    assert np.allclose(lc.embed_query(TEXTS[0]), embed(client, TEXTS[:1])[0], atol=1e-6)
    small = OpenAIEmbeddings(**common, dimensions=96).embed_documents(TEXTS)
    assert np.asarray(small).shape == (3, 96)
    assert np.allclose(small, embed(client, TEXTS, dimensions=96), atol=1e-6)
    # query vectors through LangChain: the extension field in the request body
    queries = OpenAIEmbeddings(**common, model_kwargs={"extra_body": {"input_type": "query"}})
    assert np.allclose(queries.embed_query(TEXTS[1]), embed(client, TEXTS[1:2], role="query")[0], atol=1e-6)
    floats = OpenAIEmbeddings(**common, model_kwargs={"encoding_format": "float"}).embed_documents(TEXTS)
    assert np.allclose(floats, docs, atol=1e-7)
