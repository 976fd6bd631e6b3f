"""The clients people point at TEI / Infinity today, pointed at a real embedpool server with only
the base URL changed (``http://host:port/tei`` for TEI clients, ``http://host:port`` or
``.../v1`` for Cohere-, Infinity- and OpenAI-style ones). Each one's vectors equal ``/embed``'s
for the same texts, its rerank order ``/rerank``'s. Nothing may leave the machine
(``loopback_only``): clients that phone home (LiteLLM's model price list, Haystack's telemetry)
are told not to through their own documented settings.

The client versions are pinned in pyproject.toml's ``test`` extra."""

from __future__ import annotations

import numpy as np
import pytest

TEXTS = ["The cat sat on the mat.", "Stock markets fell sharply on Monday.", "Quantum computers use qubits."]
QUERY = "What do cats do?"


@pytest.fixture(scope="module")
def want(server):
    """``/embed``'s vectors (the server's default pooler, normalized and not) and ``/rerank``'s
    order for the texts, the reference every client is held to."""
    with server.client() as c:
        def embed(**extra):
            r = c.post("/embed", json={"inputs": TEXTS, **extra})
            assert r.status_code == 200, r.text
            return np.asarray(r.json()["embeddings"], dtype=np.float32)

        ranked = c.post("/rerank", json={"query": QUERY, "texts": TEXTS, "truncate": True}).json()
        return {"unit": embed(), "raw": embed(normalize=False), "order": [r["index"] for r in ranked],
                "scores": [r["score"] for r in ranked]}


@pytest.fixture
def offline(loopback_only, monkeypatch):
    """No network beyond loopback, and the clients' own phoning home turned off."""
    import huggingface_hub.constants

    # The test session runs with HF_HUB_OFFLINE=1 (nothing may download a model), under which
    # huggingface_hub refuses every request, even to a local server (a user pointing a client at
    # embedpool has no such setting); without it, the hub fetches a registry of agents from
    # huggingface.co for its User-Agent header. So: offline stays set (no registry fetch), and
    # requests pass its check; loopback_only still fails any request beyond this machine.
    assert huggingface_hub.constants.HF_HUB_OFFLINE
    monkeypatch.setattr(huggingface_hub.constants, "is_offline_mode", lambda: False)
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM: no price list download at import
    monkeypatch.setenv("HAYSTACK_TELEMETRY_ENABLED", "False")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    for var in ("HF_TOKEN", "HF_API_TOKEN", "COHERE_API_KEY", "CO_API_KEY", "JINA_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    return loopback_only


# ---------------------------------------------------------------------- TEI clients (base URL .../tei)
def test_huggingface_hub_inference_client(server, want, offline):
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=f"{server.url}/tei")
    one = client.feature_extraction(TEXTS[0])  # POSTs {"inputs": ...} to the base URL: TEI's default task
    assert one.shape == (1, 384) and np.allclose(one[0], want["unit"][0], atol=1e-6)
    many = client.feature_extraction(TEXTS)
    assert np.allclose(many, want["unit"], atol=1e-6)
    raw = client.feature_extraction(TEXTS, normalize=False, truncate=True, truncation_direction="left")
    assert np.allclose(raw, want["raw"], atol=1e-5)
    # InferenceClient has no rerank call (text_classification is for classifier models)
    assert not hasattr(client, "rerank")


def test_langchain_huggingface_endpoint_embeddings(server, want, offline):
    from langchain_huggingface import HuggingFaceEndpointEmbeddings

    # 1.2.1 is the last release that takes an endpoint URL: 1.2.2 refuses one ("must be a
    # HuggingFace repo ID, not a URL"), so no TEI server at all can be reached through it
    lc = HuggingFaceEndpointEmbeddings(model=f"{server.url}/tei")
    assert np.allclose(lc.embed_documents(TEXTS), want["unit"], atol=1e-6)
    assert np.allclose(lc.embed_query(TEXTS[1]), want["unit"][1], atol=1e-6)


def test_llamaindex_text_embeddings_inference(server, want, offline):
    from llama_index.embeddings.text_embeddings_inference import TextEmbeddingsInference

    li = TextEmbeddingsInference(model_name="all-MiniLM-L6-v2", base_url=f"{server.url}/tei")
    assert np.allclose(li.get_text_embedding_batch(TEXTS), want["unit"], atol=1e-6)
    assert np.allclose(li.get_query_embedding(TEXTS[2]), want["unit"][2], atol=1e-6)


def test_haystack_huggingface_api_text_embedder(server, want, offline):
    from haystack.utils import Secret
    from haystack_integrations.common.huggingface_api.utils import HFEmbeddingAPIType
    from haystack_integrations.components.embedders.huggingface_api import HuggingFaceAPITextEmbedder

    embedder = HuggingFaceAPITextEmbedder(api_type=HFEmbeddingAPIType.TEXT_EMBEDDINGS_INFERENCE,
                                          api_params={"url": f"{server.url}/tei"},
                                          token=Secret.from_token("unused"))
    out = embedder.run(text=TEXTS[0])["embedding"]  # Haystack asks for normalize=false by default
    assert np.allclose(out, want["raw"][0], atol=1e-5)
    unit = HuggingFaceAPITextEmbedder(api_type="text_embeddings_inference", api_params={"url": f"{server.url}/tei"},
                                      normalize=True, token=Secret.from_token("unused"))
    assert np.allclose(unit.run(text=TEXTS[1])["embedding"], want["unit"][1], atol=1e-6)


# LiteLLM's `huggingface/` provider with api_base=".../tei" gets the right vectors, but after each
# call its cost calculator fetches the model's config.json from huggingface.co (for any model not
# in its price list, register_model notwithstanding): it cannot pass loopback_only, so LiteLLM is
# tested through its `openai/` and `infinity/` providers below.


# ---------------------------------------------------------------------- OpenAI-like embeddings (.../v1)
def test_llamaindex_openai_like_embedding(server, want, offline):
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding

    li = OpenAILikeEmbedding(model_name="all-MiniLM-L6-v2", api_base=f"{server.url}/v1", api_key="unused",
                             max_retries=0)
    assert np.allclose(li.get_text_embedding_batch(TEXTS), want["unit"], atol=1e-6)


@pytest.mark.parametrize("provider", ["openai", "infinity"])
def test_litellm_embedding(server, want, offline, provider):
    import litellm

    out = litellm.embedding(model=f"{provider}/all-MiniLM-L6-v2", api_base=f"{server.url}/v1", api_key="unused",
                            input=TEXTS)
    assert np.allclose([d["embedding"] for d in out.data], want["unit"], atol=1e-6)
    assert out.usage.prompt_tokens > 0


# ---------------------------------------------------------------------- Cohere-style rerank
def test_langchain_cohere_rerank_compressor(server, want, offline):
    from langchain_cohere import CohereRerank
    from langchain_core.documents import Document

    rr = CohereRerank(model="rerank-english-v3.0", base_url=server.url, cohere_api_key="unused", top_n=2)
    docs = rr.compress_documents([Document(page_content=t, metadata={"i": i}) for i, t in enumerate(TEXTS)], QUERY)
    assert [d.metadata["i"] for d in docs] == want["order"][:2]
    assert np.allclose([d.metadata["relevance_score"] for d in docs], want["scores"][:2], atol=1e-6)


def test_litellm_rerank(server, want, offline):
    import litellm

    out = litellm.rerank(model="cohere/rerank-english-v3.0", api_base=server.url, api_key="unused",
                         query=QUERY, documents=TEXTS, top_n=3, return_documents=True)
    assert [r["index"] for r in out.results] == want["order"]
    assert np.allclose([r["relevance_score"] for r in out.results], want["scores"], atol=1e-6)
    assert [r["document"]["text"] for r in out.results] == [TEXTS[i] for i in want["order"]]
    # Infinity's shape is the same but for `document`, a bare string there where Cohere and Jina
    # send {"text": ...} (what embedpool answers): LiteLLM's infinity/ provider, which asks for the
    # documents unless told not to, reads the scores only with return_documents=False
    inf = litellm.rerank(model="infinity/any", api_base=f"{server.url}/v1", api_key="unused", query=QUERY,
                         documents=TEXTS, top_n=2, return_documents=False)
    assert [r["index"] for r in inf.results] == want["order"][:2]
