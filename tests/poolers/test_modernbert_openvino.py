"""ModernBERT and OpenVINO: the converted graph turns a padded position whose local-attention
window holds no real token into NaN, and with more layers every vector of that text (found by
bench/families.py: 24 of 128 SciFact documents NaN under ``--precision auto``). So ``auto`` on
a model with local attention runs torch fp32 and says why, and an explicit OpenVINO path is
refused with the reason. A tiny random-weight ModernBERT (4 layers, local window 16, model
window 48) saved through sentence-transformers, as tests/family_models.py builds every family."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedpool.errors import InvalidError
from embedpool.poolers import Embedder, FrozenEncoder

from family_models import FAMILIES, Size, build, reference

# one text far shorter than the other, in one padded batch: most of the short one's padding has
# no real token within the 16-token local window
TEXTS = ["a", "aspirin lowers the risk of stroke in patients " * 6]


@pytest.fixture(scope="module")
def modernbert(tmp_path_factory):
    return build(FAMILIES["modernbert"], tmp_path_factory.mktemp("modernbert"), size=Size(layers=4))


@pytest.mark.slow  # an OpenVINO conversion: 5-11 s
def test_the_openvino_graph_gives_nan_on_padding(modernbert):
    """Why the refusal exists (if OpenVINO stops doing this, the refusal can go)."""
    from embedpool.poolers.runtimes import load_openvino

    enc = FrozenEncoder(str(modernbert), precision="fp32")
    ov = load_openvino(enc.model, enc.tokenizer, "fp32", "test", max_length=enc.max_length)
    batch = enc.tokenizer(TEXTS, padding=True, truncation=True, max_length=enc.max_length, return_tensors="pt")
    assert batch["attention_mask"][0].sum() < 8 and batch["attention_mask"][1].all()
    got = ov(batch["input_ids"], batch["attention_mask"]).last_hidden_state
    assert torch.isnan(got[0]).any()
    assert torch.isfinite(enc.model(**batch).last_hidden_state).all()  # torch keeps them finite


def test_auto_falls_back_to_fp32_and_equals_sentence_transformers(modernbert):
    enc = FrozenEncoder(str(modernbert), precision="auto")
    got = Embedder(enc).embed(TEXTS, ["auto"], normalize=False).matrix("auto")
    expected = reference(modernbert, FAMILIES["modernbert"]).encode_document(TEXTS, convert_to_numpy=True)
    assert np.isfinite(got).all(), enc.precision
    cos = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cos.min() >= 0.999
    assert not enc.precision.startswith("openvino")
    if "not used" in enc.precision_reason:  # this CPU's auto path was an OpenVINO one: the reason says why not
        assert "local attention window" in enc.precision_reason


@pytest.mark.parametrize("precision", ["openvino-fp32", "openvino-bf16"])
def test_an_explicit_openvino_path_is_refused_with_the_reason(modernbert, precision):
    with pytest.raises(InvalidError, match="local attention window"):
        FrozenEncoder(str(modernbert), precision=precision)
