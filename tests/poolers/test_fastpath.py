"""The int8 fast path (poolers/fastpath.py): close to fp32, artifact built once and reused."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

# bench/encode.py measured min / mean cosine to fp32 of 0.9987 / 0.9993 on the 1,000 SciFact
# documents and 0.9949 / 0.9989 on 2,000 STS-B sentences; these 20 varied texts clear 0.995.
MIN_COSINE = 0.995

TEXTS = [
    "",
    "ok",
    "What is the capital of France?",
    "A man is playing a guitar.",
    "A woman is slicing an onion in the kitchen.",
    "how do i reset my password without access to my email",
    "The Eiffel Tower was completed in 1889 and is 330 metres tall.",
    "Ünïcödé text with émojis 🙂 and symbols ±√∞ → ©",
    "東京は日本の首都であり、世界有数の大都市です。",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "def add(a, b):\n    return a + b  # a tiny function",
    "BRCA1 mutations increase the lifetime risk of breast and ovarian cancer.",
    "Vitamin D supplementation did not reduce the incidence of invasive cancer or cardiovascular "
    "events in a randomized trial of 25,871 adults followed for a median of 5.3 years.",
    "Aspirin " * 40,
    "Mitochondrial dysfunction is a hallmark of aging; " * 30,  # over the 256-token window
    "https://example.com/path?query=1&x=2 #hashtag @mention",
    "1 2 3 4 5 6 7 8 9 10 11 12",
    "The results were statistically significant (p < 0.001, n = 1,204).",
    "Two dogs run through a snowy field.",
    "In the beginning God created the heaven and the earth. And the earth was without form, and "
    "void; and darkness was upon the face of the deep.",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fastpath-cache")


@pytest.fixture(scope="module")
def int8_encoder(cache_dir):
    from embedpool.poolers import FrozenEncoder

    old = os.environ.get("EMBEDPOOL_CACHE_DIR")
    os.environ["EMBEDPOOL_CACHE_DIR"] = str(cache_dir)
    try:
        yield FrozenEncoder(precision="int8")
    finally:
        if old is None:
            os.environ.pop("EMBEDPOOL_CACHE_DIR", None)
        else:
            os.environ["EMBEDPOOL_CACHE_DIR"] = old


def test_int8_mean_close_to_fp32(int8_encoder, embedder):
    from embedpool.poolers import Embedder

    ref = embedder.embed(TEXTS, ["mean"]).matrix("mean")
    fast = Embedder(int8_encoder).embed(TEXTS, ["mean"]).matrix("mean")
    assert fast.shape == ref.shape and fast.dtype == np.float32
    cos = (fast * ref).sum(1)
    assert cos.min() >= MIN_COSINE, f"min cosine {cos.min():.5f} (mean {cos.mean():.5f})"


def test_int8_batch_invariant(int8_encoder):
    """Per-token activation scales: a text's output does not depend on its batch mates."""
    from embedpool.poolers import Embedder

    emb = Embedder(int8_encoder)
    alone = emb.embed([TEXTS[4]], ["mean"]).matrix("mean")[0]
    mixed = emb.embed(TEXTS, ["mean"]).matrix("mean")[4]
    assert float(alone @ mixed) > 0.99999


def test_fp32_graph_matches_transformers(encoder, tmp_path):
    """The ONNX graph itself (float MatMuls) reproduces the transformers forward."""
    import torch

    from embedpool.poolers.fastpath import load_fastpath

    fwd = load_fastpath(encoder.model, "fp32", cache_dir=tmp_path, tokenizer=encoder.tokenizer)
    enc = encoder.tokenizer(TEXTS[:8], padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.inference_mode():
        ref = encoder.model(**enc).last_hidden_state
    out = fwd(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"]).last_hidden_state
    m = enc["attention_mask"].bool()
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert torch.allclose(out[m], ref[m], atol=1e-4)


def test_artifact_cached_and_reused(int8_encoder, cache_dir):
    from embedpool.poolers.fastpath import OnnxEncoderForward, ensure_artifact

    fwd = int8_encoder._forward_fn
    assert isinstance(fwd, OnnxEncoderForward)
    assert fwd.path.parent == cache_dir / "fastpath" and fwd.path.exists()
    mtime = fwd.path.stat().st_mtime_ns
    path, built = ensure_artifact(int8_encoder.model, "int8", cache_dir / "fastpath")
    assert (path, built) == (fwd.path, False)
    assert fwd.path.stat().st_mtime_ns == mtime
    assert [p.name for p in (cache_dir / "fastpath").iterdir()] == [fwd.path.name]


def test_unsupported_architecture_is_a_clear_error(encoder):
    from types import SimpleNamespace

    from embedpool.poolers.fastpath import check_supported

    fake = SimpleNamespace(config=SimpleNamespace(model_type="roberta", position_embedding_type="absolute",
                                                  hidden_act="gelu", is_decoder=False))
    with pytest.raises(ValueError, match="BERT"):
        check_supported(fake)
