"""Attention-head training on synthetic token states (no encoder needed) and on the real one."""

from __future__ import annotations

import numpy as np
import torch

from poolers import build_pooler
from poolers.attention import AttentionHead
from poolers.training import PairData, TrainConfig, cache_token_states, ict_pairs, pad, train_head


def _synthetic(n_pairs: int = 96, dim: int = 32, noise_tokens: int = 12, seed: int = 0) -> PairData:
    """Each pair shares one 'signal' token (marked by a large value in the last dimension)
    hidden among noise tokens; mean pooling drowns the signal, attention can find it."""
    g = torch.Generator().manual_seed(seed)
    queries, docs = [], []
    for _ in range(n_pairs):
        signal = torch.randn(dim, generator=g)
        signal[-1] = 3.0
        q = torch.randn(noise_tokens, dim, generator=g)
        d = torch.randn(noise_tokens + 5, dim, generator=g)
        q[:, -1] = d[:, -1] = 0.0
        queries.append(torch.cat([q, signal[None]]).half())
        docs.append(torch.cat([signal[None], d]).half())
    return PairData(queries, docs, [(i, i) for i in range(n_pairs)])


def test_step0_head_is_mean_pooling():
    data = _synthetic(8)
    head = AttentionHead(32, queries=1, value_projection=True)
    hidden, mask = pad(data.docs)
    out = head(hidden, mask)[:, 0]
    mean = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    torch.testing.assert_close(out, mean, atol=1e-6, rtol=0)


def test_training_reduces_loss_and_changes_the_embedding(tmp_path):
    data = _synthetic()
    cfg = TrainConfig(epochs=15, batch_size=16, lr=5e-2, patience=15, seed=1)
    head, report = train_head(data, 32, cfg)
    assert report.best_dev_loss < 0.5 * report.step0_dev_loss, report
    assert report.history[-1]["train_loss"] < report.history[0]["train_loss"]
    hidden, mask = pad(data.docs[:4])
    mean = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    with torch.no_grad():
        assert not torch.allclose(head(hidden, mask)[:, 0], mean, atol=1e-3)
    # a fixed seed gives the same weights
    head2, _ = train_head(data, 32, cfg)
    for (k, v), (_, v2) in zip(head.state_dict().items(), head2.state_dict().items()):
        assert torch.equal(v, v2), k
    # weights round-trip through safetensors + JSON
    head.save(tmp_path / "h", encoder="synthetic")
    loaded, cfg_json = AttentionHead.load(tmp_path / "h")
    assert cfg_json["encoder"] == "synthetic"
    with torch.no_grad():
        torch.testing.assert_close(loaded(hidden, mask), head(hidden, mask), atol=0, rtol=0)


def test_cosent_objective_learns_gold_order():
    data = _synthetic(64)
    # gold: the true pair is similar (5), a shuffled pair is not (0)
    n = len(data.pairs)
    data.pairs += [(i, (i + 1) % n) for i in range(n)]
    data.scores = [5.0] * n + [0.0] * n
    cfg = TrainConfig(objective="cosent", epochs=10, batch_size=32, lr=5e-2, patience=10, seed=0)
    _, report = train_head(data, 32, cfg)
    assert report.best_dev_loss < report.step0_dev_loss


def test_ict_pairs_split_sentences():
    docs = ["First sentence is here. Second sentence follows it now. Third one closes the doc.", "One only."]
    pairs = ict_pairs(docs, seed=0, min_words=3)
    assert len(pairs) == 1
    q, rest = pairs[0]
    assert q in docs[0] and q not in rest and len(rest.split(". ")) == 2


def test_cached_states_reload_and_trained_head_serves(tmp_path, encoder, embedder):
    texts = ["cached token states", "are computed once"]
    passes = encoder.stats.passes
    a = cache_token_states(encoder, texts, "document", tmp_path)
    b = cache_token_states(encoder, texts, "document", tmp_path)
    assert encoder.stats.passes - passes == 1  # the second call read the cache
    assert all(x.dtype == torch.float16 and torch.equal(x, y) for x, y in zip(a, b))
    data = PairData(a, a, [(0, 0), (1, 1)])
    head, _ = train_head(data, 384, TrainConfig(epochs=2, batch_size=2, dev_fraction=0.5, patience=2))
    with torch.no_grad():
        head.score.weight.normal_(0, 0.3)  # make sure it differs from mean
    head.save(tmp_path / "h", encoder=encoder.model_id)
    spec = f"attention:weights={tmp_path / 'h'}"
    got = embedder.embed(texts, [spec], normalize=False).matrix(spec)
    hidden, mask = pad(a)
    with torch.no_grad():
        direct = head(hidden, mask)[:, 0].numpy()
    np.testing.assert_allclose(got, direct, atol=2e-2)  # cache is float16
    assert build_pooler(spec, model_id=encoder.model_id).head_config["encoder"] == encoder.model_id
