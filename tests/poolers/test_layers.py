"""Poolers over every hidden layer (``layermean``, ``maxpoolbert``, ``multilayer``) on the real
default model: the encoder's layer outputs on each path ``auto`` can pick, the poolers against
references written from their papers' definitions with ``transformers``' own
``output_hidden_states``, one forward pass shared with the last-layer poolers, and trained
multi-layer heads saved, loaded and bound to their encoder."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from embedpool.errors import InvalidError
from embedpool.poolers import Embedder, build_pooler
from embedpool.poolers.encoder import default_model_path
from embedpool.poolers.multilayer import MultiLayerHead, MultiLayerRoleHeads
from embedpool.poolers.precision import load_forward, resolve

TEXTS = ["A man is playing a guitar on the stage.", "Two dogs run through a field of tall grass.",
         "Mitochondrial DNA mutations accumulate with age and are associated with decreased respiratory "
         "chain function in skeletal muscle fibres of elderly subjects.", "ok", ""]
N_LAYERS = 7  # all-MiniLM-L6-v2: the embeddings and six transformer layers


@pytest.fixture(scope="module")
def reference_hidden_states():
    """Each text's ``hidden_states`` from ``transformers`` itself (one text at a time, no
    padding): ``[L+1, T, D]`` per text."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path())
    model = AutoModel.from_pretrained(default_model_path()).eval()
    out = []
    with torch.no_grad():
        for text in TEXTS:
            enc = tok(text, return_tensors="pt", truncation=True, max_length=256)
            out.append(torch.stack(model(**enc, output_hidden_states=True).hidden_states)[:, 0])
    return out


def _twin(encoder, path, cache_dir):
    """The session's encoder on another forward path (no second model load)."""
    twin = copy.copy(encoder)
    twin.stats = type(encoder.stats)()
    twin._forward_fn = load_forward(path, encoder.model, encoder.tokenizer, encoder.max_length, cache_dir=cache_dir)
    twin.precision = path
    return twin


def _layers(encoder, texts=TEXTS) -> list[torch.Tensor]:
    """Each text's ``[L+1, n_i, D]`` layers (padding removed) as ``encode(all_layers=True)`` gives them."""
    out: list = [None] * len(texts)
    for ids, st in encoder.encode(texts, all_layers=True):
        assert st.layers is not None and torch.equal(st.layers[-1], st.hidden)  # the last layer is hidden itself
        for j, i in enumerate(ids):
            out[i] = st.layers[:, j][:, st.attention_mask[j].bool()]
    return out


# ---------------------------------------------------------------- the encoder's layers
def test_torch_layers_are_transformers_hidden_states(encoder, reference_hidden_states):
    for got, want in zip(_layers(encoder), reference_hidden_states):
        assert got.shape == want.shape == (N_LAYERS, want.shape[1], 384)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# the OpenVINO paths auto can pick on some CPU (poolers/precision.py's decisions), and this CPU's choice
AUTO_PATH = resolve("auto")[0]
OPENVINO = sorted({"openvino-fp32", *([AUTO_PATH] if AUTO_PATH.startswith("openvino") else [])})


@pytest.mark.parametrize("path", OPENVINO)
def test_openvino_layer_outputs_equal_torch_within_the_paths_tolerance(path, encoder, tmp_path_factory):
    """Every hidden layer is an output of the one converted graph, within the path's
    tolerance of torch fp32: fp32 to float rounding, bf16 to the cosine bar the last layer meets."""
    twin = _twin(encoder, path, tmp_path_factory.mktemp("ov"))
    passes = twin.stats.forward_calls
    got, want = _layers(twin), _layers(encoder)
    assert twin.stats.forward_calls - passes == 1  # one forward for every layer of every text
    for g, w in zip(got, want):
        assert g.shape == w.shape == (N_LAYERS, w.shape[1], 384)
        if path == "openvino-fp32":
            torch.testing.assert_close(g, w, atol=2e-4, rtol=1e-3)
        else:
            cos = torch.nn.functional.cosine_similarity(g, w, dim=-1)
            assert cos.min() >= 0.99, f"{path}: min per-token cosine {cos.min():.4f}"
    # without a layer pooler the path returns the last layer alone
    (_, st), = list(twin.encode(TEXTS[:2]))
    assert st.layers is None
    # and the untrained multi-layer pooler is mean on this path too, to the bit
    r = Embedder(twin).embed(TEXTS, ["mean", "multilayer"], normalize=False)
    assert np.array_equal(r.matrix("mean"), r.matrix("multilayer"))


# ---------------------------------------------------------------- the poolers against references
def test_untrained_multilayer_equals_mean_of_the_last_layer_exactly(embedder, varied_texts):
    for role in ("document", "query"):
        r = embedder.embed(varied_texts[:40], ["mean", "multilayer", "multilayer:queries=3"], role=role,
                           normalize=False)
        assert np.array_equal(r.matrix("mean"), r.matrix("multilayer"))
        for mean, several in zip(r.matrix("mean"), r.vectors["multilayer:queries=3"]):
            assert several.shape == (3, 384) and all(np.array_equal(mean, v) for v in several)


def test_layermean_is_the_papers_first_last_average(embedder, reference_hidden_states):
    """First-last average (Su et al. 2021; SimCSE ``avg_first_last``): the token mean of the
    first transformer layer's and the last layer's states averaged; ``all`` every layer's."""
    r = embedder.embed(TEXTS, ["layermean", "layermean:layers=all", "layermean:layers=0+2+-1"], normalize=False)
    for i, h in enumerate(reference_hidden_states):  # h: [L+1, T, D], every token a real one
        first_last = ((h[1] + h[-1]) / 2).mean(dim=0)
        np.testing.assert_allclose(r.vectors["layermean"][i], first_last.numpy(), atol=1e-5)
        np.testing.assert_allclose(r.vectors["layermean:layers=all"][i], h.mean(dim=(0, 1)).numpy(), atol=1e-5)
        np.testing.assert_allclose(r.vectors["layermean:layers=0+2+-1"][i],
                                   ((h[0] + h[2] + h[6]) / 3).mean(dim=0).numpy(), atol=1e-5)


def test_maxpoolbert_is_the_papers_max_over_the_last_layers_cls(embedder, reference_hidden_states):
    """MaxCLS (Behrendt et al. 2025): element-wise max of the [CLS] state over the last k layers."""
    r = embedder.embed(TEXTS, ["maxpoolbert", "maxpoolbert:layers=last1", "maxpoolbert:layers=all"], normalize=False)
    for i, h in enumerate(reference_hidden_states):
        cls = h[:, 0]  # [L+1, D]
        want = torch.maximum(torch.maximum(cls[-3], cls[-2]), cls[-1])
        np.testing.assert_allclose(r.vectors["maxpoolbert"][i], want.numpy(), atol=1e-5)
        np.testing.assert_allclose(r.vectors["maxpoolbert:layers=last1"][i], cls[-1].numpy(), atol=1e-5)
        np.testing.assert_allclose(r.vectors["maxpoolbert:layers=all"][i], cls.max(dim=0).values.numpy(), atol=1e-5)
    assert not np.allclose(r.vectors["maxpoolbert"][0], r.vectors["maxpoolbert:layers=last1"][0], atol=1e-3)


def test_bad_layer_options_are_refused_with_the_valid_forms(embedder):
    for spec in ("layermean:layers=first", "maxpoolbert:layers=last0", "layermean:layers=1+x"):
        with pytest.raises(InvalidError, match="use all, last<k>"):
            build_pooler(spec)
    with pytest.raises(ValueError, match="has 7 hidden layers"):
        embedder.embed(["x"], ["layermean:layers=1+9"])


# ---------------------------------------------------------------- one forward pass
class _CountingForward:
    """The encoder's real forward, counting calls and whether each asked for every layer."""

    def __init__(self, forward) -> None:
        self.forward, self.calls = forward, []

    def __call__(self, **kw):
        self.calls.append(bool(kw.get("output_hidden_states")))
        return self.forward(**kw)


def test_layer_and_last_layer_poolers_share_one_forward_pass(encoder, varied_texts):
    twin = copy.copy(encoder)
    twin.stats = type(encoder.stats)()
    twin._forward_fn = counting = _CountingForward(encoder._forward_fn)
    emb = Embedder(twin)
    texts = varied_texts[:30]
    emb.embed(texts, ["mean"])
    alone = list(counting.calls)
    assert alone and not any(alone)  # no layer pooler: the last layer alone
    counting.calls.clear()
    specs = ["mean", "attention", "layermean", "maxpoolbert", "multilayer", "cls"]
    both = emb.embed(texts, specs)
    assert len(counting.calls) == len(alone) and all(counting.calls)  # the same batches, once, with layers
    assert twin.stats.per_plan == {"standard": 2}  # one pass per call
    ref = Embedder(encoder).embed(texts, specs)
    for spec in specs:
        np.testing.assert_allclose(both.matrix(spec), ref.matrix(spec), atol=1e-6)


# ---------------------------------------------------------------- trained heads
def _trained(cls, seed: int = 0, **kw):
    torch.manual_seed(seed)
    head = cls(384, N_LAYERS, value_projection=True, **kw)
    with torch.no_grad():
        for m in head.modules():
            if isinstance(m, MultiLayerHead):
                m.score.weight.normal_(0, 0.5)
                m.layer_mix.normal_(0, 0.3)
                m.value.weight.add_(0.01 * torch.randn(384, 384))
    return head.eval()


@pytest.mark.parametrize("roles", ["shared", "separate"])
def test_a_trained_multilayer_head_round_trips_to_identical_vectors(roles, tmp_path, embedder, encoder):
    head = _trained(MultiLayerRoleHeads if roles == "separate" else MultiLayerHead, queries=2)
    head.save(tmp_path / "h", encoder=encoder.model_id, objective="test")
    spec = f"multilayer:weights={tmp_path / 'h'}"
    out = {role: embedder.embed(TEXTS, [spec], role=role, normalize=False).vectors[spec] for role in ("query", "document")}
    # the head in memory on the encoder's layers gives the same vectors
    (ids, st), = list(encoder.encode(TEXTS, all_layers=True))
    with torch.no_grad():
        direct = head(st.layers, st.pool_mask, role="document")
    for j, i in enumerate(ids):
        np.testing.assert_allclose(out["document"][i], direct[j].numpy(), atol=1e-6)
    # a second load, and the pooler saved as a folder of its own, reproduce it exactly
    pooler = build_pooler(spec, model_id=encoder.model_id)
    again = type(pooler).load(pooler.save(tmp_path / "pooler"))
    for p in (pooler, again):
        for role in ("query", "document"):
            for j, i in enumerate(ids):
                assert np.array_equal(p.pool_role(st, role)[j].numpy(), out[role][i])
    assert pooler.queries == 2 and pooler.multi_vector and pooler.role_aware == (roles == "separate")
    assert (roles == "separate") == (not np.allclose(out["query"][0], out["document"][0], atol=1e-4))
    mean = embedder.embed(TEXTS, ["mean"], normalize=False).matrix("mean")
    assert not np.allclose(out["document"][0][0], mean[0], atol=1e-3)  # trained: no longer mean


def test_a_head_trained_for_another_encoder_is_refused(tmp_path, encoder):
    _trained(MultiLayerHead).save(tmp_path / "other", encoder="some/other-model")
    with pytest.raises(ValueError, match="trained on encoder 'some/other-model', but this encoder is"):
        build_pooler(f"multilayer:weights={tmp_path / 'other'}", model_id=encoder.model_id)
    # a head for an encoder of another depth says so when it meets this one's layers
    MultiLayerHead(384, 13).save(tmp_path / "deep", encoder=encoder.model_id)
    emb = Embedder(encoder)
    with pytest.raises(ValueError, match="mixes 13 hidden layers, but this encoder gives 7"):
        emb.embed(["x"], [f"multilayer:weights={tmp_path / 'deep'}"])


def test_attention_and_multilayer_heads_are_not_interchangeable(tmp_path, encoder):
    from embedpool.poolers.attention import AttentionHead

    _trained(MultiLayerHead).save(tmp_path / "ml", encoder=encoder.model_id)
    AttentionHead(384).save(tmp_path / "att", encoder=encoder.model_id)
    with pytest.raises(InvalidError, match="head for pooler 'multilayer', not 'attention'; use multilayer:weights="):
        build_pooler(f"attention:weights={tmp_path / 'ml'}", model_id=encoder.model_id)
    with pytest.raises(InvalidError, match="head for pooler 'attention', not 'multilayer'; use attention:weights="):
        build_pooler(f"multilayer:weights={tmp_path / 'att'}", model_id=encoder.model_id)


def test_a_trained_multilayer_head_is_batch_invariant_over_long_inputs(tmp_path, embedder, encoder, varied_texts,
                                                                      scifact_docs):
    """Long abstracts (many cut at the 256-token window) beside short texts, with a forward budget
    of two full windows: the texts spread over many padded batches, and each text's vector is
    the one it gets alone."""
    _trained(MultiLayerRoleHeads, queries=2).save(tmp_path / "h", encoder=encoder.model_id)
    spec = f"multilayer:weights={tmp_path / 'h'}"
    texts = [t for pair in zip(scifact_docs[:12], varied_texts[:12]) for t in pair]
    assert sum(len(encoder.tokenizer(t)["input_ids"]) > encoder.max_length for t in texts) >= 3
    old, calls = encoder.max_batch_tokens, encoder.stats.forward_calls
    encoder.max_batch_tokens = 2 * encoder.max_length
    try:
        together = {role: embedder.embed(texts, [spec, "mean"], role=role) for role in ("query", "document")}
    finally:
        encoder.max_batch_tokens = old
    assert encoder.stats.forward_calls - calls >= 2 * 5  # each role's call ran many forward batches
    for i in range(0, len(texts), 5):
        for role, r in together.items():
            alone = embedder.embed([texts[i]], [spec], role=role).vectors[spec][0]
            np.testing.assert_allclose(r.vectors[spec][i], alone, atol=1e-5, err_msg=f"{role} {i}")
