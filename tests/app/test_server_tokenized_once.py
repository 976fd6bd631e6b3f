"""A request is tokenized once (issue 34): the limits check tokenizes it, and the batcher's worker
encodes that tokenization. Counted on the real model through real HTTP requests to a uvicorn
server in this process, by wrapping the tokenizer's ``__call__`` (instrumentation: every call
still runs the real tokenizer)."""

from __future__ import annotations

from collections import Counter

import httpx
import numpy as np
import pytest

from embedpool.app.server import create_app
from embedpool.app.settings import Settings
from server_testutil import Uvicorn


@pytest.fixture()
def counted(embedder, tmp_path, monkeypatch):
    """``(url, seen)``: a server on the session's fp32 model; ``seen`` counts every text the
    tokenizer is given (the model has no prompt, so a text is passed as sent)."""
    seen: Counter = Counter()
    cls = type(embedder.encoder.tokenizer)
    real = cls.__call__

    def counting(self, text=None, *args, **kwargs):
        seen.update([text] if isinstance(text, str) else list(text or []))
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(cls, "__call__", counting)
    app = create_app(Settings(data_dir=str(tmp_path), precision="fp32", rerank_cache_mb=0), embedder=embedder)
    with Uvicorn(app) as url:
        yield url, seen


def test_a_request_is_tokenized_once(counted, embedder):
    url, seen = counted
    texts = ["the first of two sentences", "and the second one, a little longer than the first"]
    with httpx.Client(base_url=url, timeout=60) as c:
        # two poolers of one plan: one tokenization
        r = c.post("/embed", json={"inputs": texts, "poolers": ["mean", "cls"]})
        assert r.status_code == 200, r.text
        assert seen == Counter(texts)
        want = embedder.embed(texts, ["mean"]).matrix("mean")
        assert np.allclose(np.asarray(r.json()["results"][0]["embeddings"]), want, atol=1e-5)
        seen.clear()
        r = c.post("/v1/embeddings", json={"input": texts[0], "model": "x"})
        assert r.status_code == 200 and seen == Counter(texts[:1])
        assert r.json()["usage"]["prompt_tokens"] == len(embedder.encoder.tokenizer(texts[0])["input_ids"])
        seen.clear()
        # rerank with truncate=false: the length check is the limits' tokenization, not one of its own
        r = c.post("/rerank", json={"query": "which one is longer", "texts": texts, "truncate": False})
        assert r.status_code == 200, r.text
        assert seen == Counter(["which one is longer", *texts])
        seen.clear()
        r = c.post("/rerank", json={"query": "why " * 300, "texts": texts, "truncate": False})
        assert r.status_code == 422 and r.json()["error"].startswith("query: 302 tokens, over the model's window")
        # refused at the limits check, before the texts (counted again only to name its length)
        assert set(seen) == {"why " * 300}
