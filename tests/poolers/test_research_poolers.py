"""glot, attnstats and reinpool: each head against its paper's equations written here in plain
torch (per text, padding never seen), untrained behaviour, padding and forward-batch invariance on
the real model, save/load round trips, and training that must beat the untrained head on
synthetic data where the signal hides among noise tokens."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from embedpool.poolers import build_pooler
from embedpool.poolers.attnstats import AttnStatsHead
from embedpool.poolers.glot import GlotHead
from embedpool.poolers.reinpool import ReinPoolHead, ndcg_at_10, reinforce_loss
from embedpool.poolers.training import PairData, TrainConfig, pad, train_head
from test_training import _synthetic  # noqa: E402  (tests/poolers is on sys.path): a signal token among noise

DIM = 16


def _states(lengths=(5, 9, 1, 7), dim=DIM, seed=0):
    g = torch.Generator().manual_seed(seed)
    texts = [torch.randn(n, dim, generator=g) for n in lengths]
    hidden, mask = pad(texts)
    hidden[~mask.bool()] = 123.0  # padding holds garbage: it must never be read
    return texts, hidden, mask


def _randomize(head, seed=1, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return head.eval()


# ------------------------------------------------------------------ references (the papers' equations)
def ref_attnstats(head, x):
    """Okabe et al. 2018, eqs. 1-4, then the segment-level linear layer: one text ``x [n, D]``."""
    W, b = head.attention.weight, head.attention.bias
    v, k = head.score.weight[0], head.score.bias[0]
    e = torch.stack([v @ torch.tanh(W @ h + b) + k for h in x])
    alpha = torch.exp(e) / torch.exp(e).sum()
    mu = sum(a * h for a, h in zip(alpha, x))
    var = sum(a * h * h for a, h in zip(alpha, x)) - mu * mu
    stats = torch.cat([mu, torch.sqrt(torch.clamp(var, min=1e-6))])
    return stats if head.value is None else head.value.weight @ stats + head.value.bias


def ref_glot(head, x):
    """GLOT on one text, edge by edge: threshold graph, GAT layers (PyG GATConv's equations),
    jumping knowledge, attentive readout, projection."""
    n = len(x)
    edges = [[j for j in range(n) if j == i or F.cosine_similarity(x[i], x[j], dim=0) > head.tau] for i in range(n)]
    feats, h = [x], x
    for conv in head.convs:
        z = h @ conv.lin.weight.T
        out = []
        for i in range(n):
            logits = torch.stack([F.leaky_relu(conv.att_src @ z[j] + conv.att_dst @ z[i] + conv.edge, 0.2)
                                  for j in edges[i]])
            alpha = torch.softmax(logits, 0)
            out.append(sum(a * z[j] for a, j in zip(alpha, edges[i])) + conv.bias)
        h = torch.relu(torch.stack(out))
        feats.append(h)
    H = torch.cat(feats, dim=-1)
    lin1, lin2 = head.readout[0], head.readout[2]
    s = torch.stack([lin2.weight[0] @ torch.tanh(lin1.weight @ Hi + lin1.bias) + lin2.bias[0] for Hi in H])
    pooled = (torch.softmax(s, 0)[:, None] * H).sum(0)
    return pooled if head.value is None else head.value.weight @ pooled + head.value.bias


def ref_reinpool_logits(head, x):
    """The policy on one text: multi-head scaled dot-product self-attention over the normalized
    vectors, residual + layer norm, linear classification head."""
    v = x / x.norm(dim=-1, keepdim=True)
    mha, d = head.attention, x.shape[-1]
    Wq, Wk, Wv = mha.in_proj_weight.split(d)
    bq, bk, bv = mha.in_proj_bias.split(d)
    q, k, val = v @ Wq.T + bq, v @ Wk.T + bk, v @ Wv.T + bv
    hd = d // mha.num_heads
    heads = []
    for i in range(mha.num_heads):
        sl = slice(i * hd, (i + 1) * hd)
        att = torch.softmax(q[:, sl] @ k[:, sl].T / math.sqrt(hd), dim=-1)
        heads.append(att @ val[:, sl])
    ctx = torch.cat(heads, -1) @ mha.out_proj.weight.T + mha.out_proj.bias
    y = F.layer_norm(v + ctx, (d,), head.norm.weight, head.norm.bias, head.norm.eps)
    return v, y @ head.keep.weight[0] + head.keep.bias[0]


def ref_reinpool(head, x):
    v, logits = ref_reinpool_logits(head, x)
    keep = logits >= 0
    if not keep.any():
        keep = logits == logits.max()
    return v[keep].mean(0)


# ------------------------------------------------------------------ the heads against the references
@pytest.mark.parametrize("projection", [True, False])
def test_attnstats_is_okabe_weighted_mean_and_std(projection):
    texts, hidden, mask = _states()
    head = _randomize(AttnStatsHead(DIM, value_projection=projection, hidden=8))
    with torch.no_grad():
        out = head(hidden, mask)[:, 0]
        for i, x in enumerate(texts):
            torch.testing.assert_close(out[i], ref_attnstats(head, x), atol=1e-5, rtol=1e-5)
    assert out.shape[-1] == (DIM if projection else 2 * DIM)


@pytest.mark.parametrize("projection", [True, False])
def test_glot_is_graph_gat_readout(projection):
    texts, hidden, mask = _states()
    head = _randomize(GlotHead(DIM, value_projection=projection, hidden=6, gnn_layers=2, tau=0.1), scale=0.4)
    with torch.no_grad():
        out = head(hidden, mask)[:, 0]
        for i, x in enumerate(texts):
            torch.testing.assert_close(out[i], ref_glot(head, x), atol=1e-5, rtol=1e-5)
        adj = head.graph(hidden, mask)
    # the graph is neither empty nor complete on these states (the threshold matters)
    n = len(texts[1])
    assert n < adj[1].sum() < n * n
    assert out.shape[-1] == (DIM if projection else DIM + 2 * 6)


def test_reinpool_policy_and_selection():
    texts, hidden, mask = _states(lengths=(6, 11, 2, 8))
    head = _randomize(ReinPoolHead(DIM, heads=2), scale=0.6)
    with torch.no_grad():
        head.keep.bias.zero_()  # keep some vectors, drop others
        head.norm.bias.zero_()
        logits = head.logits(head.vectors(hidden), mask)
        out = head(hidden, mask)[:, 0]
        queries = head(hidden, mask, role="query")[:, 0]
        for i, x in enumerate(texts):
            v, ref_logits = ref_reinpool_logits(head, x)
            torch.testing.assert_close(logits[i, : len(x)], ref_logits, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out[i], ref_reinpool(head, x), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(queries[i], v.mean(0), atol=1e-6, rtol=1e-6)
    kept = head.select(logits)
    assert ((kept.sum(1) > 0) & (kept.sum(1) < mask.sum(1))).any()  # some text keeps part of its vectors


def test_ndcg_at_10_known_rankings():
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.3], [0.1, 0.9, 0.5, 0.3]])
    relevant = torch.tensor([False, False, True, False])
    got = ndcg_at_10(scores, relevant)
    torch.testing.assert_close(got, torch.tensor([1 / math.log2(3), 1 / math.log2(3)]))
    both = torch.tensor([True, False, True, False])
    torch.testing.assert_close(ndcg_at_10(scores[:1], both), torch.tensor([1.0]))


def test_reinforce_loss_is_the_score_function_estimator():
    """The loss's gradient is -mean((R - b) * grad log pi(a)) for the sampled actions: recomputed
    here from the same draws, with the leave-one-out baseline."""
    texts, hidden, mask = _states(lengths=(6, 4))
    head = _randomize(ReinPoolHead(DIM, heads=2), scale=0.3).train()
    g = torch.Generator().manual_seed(0)
    cands = F.normalize(torch.randn(5, DIM, generator=torch.Generator().manual_seed(1)), dim=-1)
    relevant = torch.zeros(2, 5, dtype=torch.bool)
    relevant[0, 1] = relevant[1, 3] = True
    loss = reinforce_loss(head, hidden, mask, cands, relevant, samples=4, generator=g)
    # the same draws again
    g = torch.Generator().manual_seed(0)
    v = head.vectors(hidden)
    logits = head.logits(v, mask)
    p = torch.sigmoid(logits.masked_fill(~mask.bool(), 0.0))
    draws = (torch.rand((4, *p.shape), generator=g) < p.detach()) & mask.bool()
    total = 0.0
    for b in range(2):
        n = int(mask[b].sum())
        rewards = []
        for s in range(4):
            a = draws[s, b, :n]
            if not a.any():
                a = F.one_hot(logits[b, :n].argmax(), n).bool()
            pooled = F.normalize(v[b, :n][a].mean(0), dim=0)
            scores = cands @ pooled
            rank = int((scores > scores[relevant[b]][0]).sum())  # candidates ranked above the relevant one
            rewards.append(1 / math.log2(rank + 2) if rank < 10 else 0.0)
        for s in range(4):
            a = draws[s, b, :n].float()
            if not a.any():
                a = F.one_hot(logits[b, :n].argmax(), n).float()
            base = (sum(rewards) - rewards[s]) / 3
            logp = (a * F.logsigmoid(logits[b, :n]) + (1 - a) * F.logsigmoid(-logits[b, :n])).sum()
            total = total - (rewards[s] - base) * logp
    torch.testing.assert_close(loss, total / 8, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------ untrained behaviour (documented)
def test_untrained_heads_equal_mean_exactly():
    texts, hidden, mask = _states()
    mean = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    for head in (AttnStatsHead(DIM), GlotHead(DIM)):
        with torch.no_grad():
            torch.testing.assert_close(head(hidden, mask)[:, 0], mean, atol=1e-6, rtol=0)
    unit = F.normalize(hidden, dim=-1)
    token_mean = (unit * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    with torch.no_grad():
        torch.testing.assert_close(ReinPoolHead(DIM, heads=2)(hidden, mask)[:, 0], token_mean, atol=1e-6, rtol=0)


def test_untrained_poolers_on_the_real_model(embedder):
    texts = ["Untrained glot is mean pooling.", "So is attnstats, on every text of any length.", "x"]
    got = embedder.embed(texts, ["mean", "glot", "attnstats", "reinpool", "tokens"], normalize=False)
    np.testing.assert_allclose(got.matrix("glot"), got.matrix("mean"), atol=1e-6, rtol=0)
    np.testing.assert_allclose(got.matrix("attnstats"), got.matrix("mean"), atol=1e-6, rtol=0)
    token_means = np.stack([np.asarray(t).mean(0) for t in got.vectors["tokens"]])
    np.testing.assert_allclose(got.matrix("reinpool"), token_means, atol=1e-6, rtol=0)
    # reinpool pools queries as the mean of their vectors whatever the head
    q = embedder.embed(texts, ["reinpool"], normalize=False, role="query").matrix("reinpool")
    np.testing.assert_allclose(q, token_means, atol=1e-6, rtol=0)


# ------------------------------------------------------------------ training, save/load, serving
def _selection(n_pairs=64, dim=DIM, seed=0):
    """A query is its signal token and 2 noise tokens; its document hides the same signal at a
    random position among 12 noise tokens: keeping the signal alone is what retrieval needs."""
    g = torch.Generator().manual_seed(seed)
    queries, docs = [], []
    for _ in range(n_pairs):
        signal = torch.randn(dim, generator=g)
        signal[-1] = 3.0
        q, d = torch.randn(2, dim, generator=g), torch.randn(12, dim, generator=g)
        q[:, -1] = d[:, -1] = 0.0
        queries.append(torch.cat([signal[None], q]).half())
        pos = int(torch.randint(0, 13, (1,), generator=g))
        docs.append(torch.cat([d[:pos], signal[None], d[pos:]]).half())
    return PairData(queries, docs, [(i, i) for i in range(n_pairs)])


@pytest.mark.parametrize("pooler,cfg", [
    ("glot", dict(lr=1e-2, epochs=8)),
    ("attnstats", dict(lr=2e-2, epochs=8)),
    ("reinpool", dict(lr=2e-2, epochs=10, heads=2, samples=8)),
])
def test_training_beats_the_untrained_head_and_round_trips(tmp_path, pooler, cfg):
    data = _selection() if pooler == "reinpool" else _synthetic(64, DIM, 10)
    config = TrainConfig(pooler=pooler, batch_size=16, patience=20, seed=0, dev_fraction=0.25, **cfg)
    head, report = train_head(data, DIM, config)
    assert report.best_step > 0 and report.best_dev_metric > report.step0_dev_metric + 0.05, report.history
    head.save(tmp_path / pooler, encoder="synthetic")
    loaded = build_pooler(f"{pooler}:weights={tmp_path / pooler}", model_id="synthetic").head
    assert type(loaded) is type(head)
    hidden, mask = pad(data.docs[:6])
    with torch.no_grad():
        torch.testing.assert_close(loaded(hidden, mask), head(hidden, mask), atol=0, rtol=0)
    with pytest.raises(ValueError, match="trained on encoder 'synthetic'"):
        build_pooler(f"{pooler}:weights={tmp_path / pooler}", model_id="other-model")


def test_separate_roles_and_refusals(tmp_path):
    data = _synthetic(24, DIM)
    for pooler in ("glot", "attnstats"):
        head, _ = train_head(data, DIM, TrainConfig(pooler=pooler, roles="separate", epochs=1, batch_size=8))
        _randomize(head.query, seed=2, scale=0.3)
        head.save(tmp_path / pooler, encoder="synthetic")
        p = build_pooler(f"{pooler}:weights={tmp_path / pooler}", model_id="synthetic")
        assert p.role_aware and p.head.roles == "separate"
        hidden, mask = pad(data.docs[:3])
        with torch.no_grad():
            torch.testing.assert_close(p.head(hidden, mask, role="query"), head.query(hidden, mask), atol=0, rtol=0)
    with pytest.raises(ValueError, match="reinpool has no separate"):
        train_head(data, DIM, TrainConfig(pooler="reinpool", roles="separate", epochs=1))
    with pytest.raises(ValueError, match="queries and heads must be 1"):
        GlotHead(DIM, queries=2)
    with pytest.raises(ValueError, match="has no option 'queries'"):
        build_pooler("attnstats:queries=2")


def test_trained_heads_pool_alone_as_in_padded_forward_batches(tmp_path, encoder, embedder, varied_texts):
    """Random (trained-like) heads on the real model: every text gets the vector it gets alone,
    whatever the other texts of its forward batches and their padding."""
    texts = varied_texts[56:80]  # short sentences and long abstracts
    specs = []
    for name, head in (("glot", GlotHead(384)), ("attnstats", AttnStatsHead(384)), ("reinpool", ReinPoolHead(384))):
        _randomize(head, seed=3, scale=0.05)
        if name == "reinpool":
            with torch.no_grad():  # keep about half of the tokens
                head.keep.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(4))
                head.keep.bias.zero_()
        head.save(tmp_path / name, encoder=encoder.model_id)
        specs.append(f"{name}:weights={tmp_path / name}")
    together = embedder.embed(texts, specs, normalize=False)
    mean = embedder.embed(texts, ["mean"], normalize=False).matrix("mean")
    for spec in specs:
        assert not np.allclose(together.matrix(spec), mean, atol=1e-2), spec
    for i in (0, 13, 23):  # a short sentence, a long abstract, the last text
        alone = embedder.embed([texts[i]], specs, normalize=False)
        for spec in specs:
            np.testing.assert_allclose(together.matrix(spec)[i], alone.matrix(spec)[0], atol=2e-5, rtol=1e-4,
                                       err_msg=spec)
