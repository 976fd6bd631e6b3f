"""Issue 51's pooling operators (mixed, gated, gem, ggem, softpool, simpool): each against its
paper's equations written here in plain torch per text (float64, padding never seen), the limits
that define them (p=1 GeM = mean exactly, large p -> max within a proven bound, SoftPool on one-hot
activations -> max, SimPool on identical tokens = that token = mean, mixed at a=0/1 = mean/max),
padding and forward-batch invariance on the real model, save/load to the bit, and training on
synthetic data where a peak hides among noise tokens (max finds it, mean drowns it)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from embedpool.poolers import build_pooler
from embedpool.poolers.base import masked_mean
from embedpool.poolers.gem import GeMHead, GGeMHead, generalized_mean
from embedpool.poolers.generalized import GAIN, GatedHead, MixedHead, masked_max
from embedpool.poolers.simpool import sim_pool
from embedpool.poolers.softpool import soft_pool
from embedpool.poolers.training import PairData, TrainConfig, pad, train_head

DIM = 16
TRAINABLE = ("mixed", "gated", "gem", "ggem")


def _states(lengths=(5, 9, 1, 7), dim=DIM, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    texts = [torch.randn(n, dim, generator=g) * scale for n in lengths]
    hidden, mask = pad(texts)
    hidden[~mask.bool()] = 123.0  # padding holds garbage: it must never be read
    return texts, hidden, mask


def _head(kind: str, dim: int = DIM, seed: int = 1):
    """A head of ``kind`` with trained-like (non-starting) parameters."""
    head = {"mixed": MixedHead, "gated": GatedHead, "gem": GeMHead, "ggem": GGeMHead}[kind](dim)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if kind == "mixed":
            head.a.fill_(0.3 / GAIN)  # stored as a / GAIN
        elif kind == "gated":
            head.gate.weight.normal_(0, 0.3, generator=g)
            head.gate.bias.fill_(-0.2)
            head.scale.fill_(0.8 / GAIN)
        else:
            head.p.copy_(4 * torch.rand(head.p.shape, generator=g) / GAIN)  # p in [1, 5)
    return head.eval()


# ------------------------------------------------------------------ references (the papers' equations)
def ref_mixed(a, x):
    """Lee et al. 2016, eq. 2 over one text's tokens ``x [n, D]``."""
    return a * x.max(0).values + (1 - a) * x.mean(0)


def ref_gated(head, x):
    """Lee et al. eq. 3, the gate reading the text's mean and max (and the gate scale c)."""
    mean, top = x.mean(0), x.max(0).values
    w, b = head.gate.weight[0].double(), head.gate.bias[0].double()
    a = head.gate_scale()[0].double() * torch.sigmoid(w @ torch.cat([mean, top]) + b)
    return a * top + (1 - a) * mean


def ref_gem(p, x):
    """Radenovic et al.'s GeM per channel c, ``(mean_t z_tc^p_c)^(1/p_c)``, on the states shifted by
    the channel's minimum over the text, shifted back."""
    low = x.min(0).values
    z = x - low
    return low + torch.stack([z[:, c].pow(p[c]).mean().pow(1 / p[c]) for c in range(x.shape[1])])


def ref_softpool(x):
    """Stergiou et al. 2021, eqs. 1-2, channel by channel: ``sum_t e^x_t x_t / sum_t e^x_t``."""
    return torch.stack([(torch.exp(x[:, c]) / torch.exp(x[:, c]).sum() * x[:, c]).sum() for c in range(x.shape[1])])


def ref_simpool(x):
    """Psomas et al. 2023 with W_q = W_k = I and the token states as values: the GAP query against
    layer-normed keys, softmax over the tokens, the weighted sum."""
    q = x.mean(0)
    k = (x - x.mean(1, keepdim=True)) / torch.sqrt(x.var(1, unbiased=False, keepdim=True) + 1e-6)
    a = torch.softmax(k @ q / math.sqrt(x.shape[1]), 0)
    return (a[:, None] * x).sum(0)


def _ref(kind, head, x):
    x = x.double()
    if kind == "mixed":
        return ref_mixed(head.weight()[0].double(), x)
    if kind == "gated":
        return ref_gated(head, x)
    return ref_gem(head.exponents().double(), x)


@pytest.mark.parametrize("kind", TRAINABLE)
def test_heads_are_their_papers_equations(kind):
    texts, hidden, mask = _states()
    head = _head(kind)
    with torch.no_grad():
        out = head(hidden, mask)[:, 0]
    for i, x in enumerate(texts):
        torch.testing.assert_close(out[i].double(), _ref(kind, head, x), atol=2e-5, rtol=1e-5)


def test_softpool_and_simpool_are_their_papers_equations():
    texts, hidden, mask = _states(scale=2.0)
    soft, sim = soft_pool(hidden, mask), sim_pool(hidden, mask)
    for i, x in enumerate(texts):
        torch.testing.assert_close(soft[i].double(), ref_softpool(x.double()), atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(sim[i].double(), ref_simpool(x.double()), atol=2e-5, rtol=1e-5)


# ------------------------------------------------------------------ limits and untrained behaviour
def test_untrained_heads_and_p1_gem_are_mean_exactly():
    _, hidden, mask = _states(scale=3.0)
    mean = masked_mean(hidden, mask)
    with torch.no_grad():
        for head in (MixedHead(DIM), GatedHead(DIM), GeMHead(DIM), GGeMHead(DIM, groups=4)):
            assert torch.equal(head(hidden, mask)[:, 0], mean), head.kind
    assert torch.equal(generalized_mean(hidden, mask, torch.ones(DIM)), mean)


def test_mixed_at_0_and_1_is_mean_and_max_exactly():
    _, hidden, mask = _states()
    with torch.no_grad():
        assert torch.equal(MixedHead(DIM, a=0.0)(hidden, mask)[:, 0], masked_mean(hidden, mask))
        assert torch.equal(MixedHead(DIM, a=1.0)(hidden, mask)[:, 0], masked_max(hidden, mask))
        # the straight-through clamp: a stored outside [0, 1] pools as the boundary
        assert torch.equal(MixedHead(DIM, a=1.7)(hidden, mask), MixedHead(DIM, a=1.0)(hidden, mask))


@pytest.mark.parametrize("p", [8.0, 100.0, 1e4])
def test_gem_tends_to_max_within_its_bound(p):
    """``min + (mean z^p)^(1/p) >= min + (max z^p / n)^(1/p)``, so
    ``0 <= max - GeM_p <= (max - min) * (1 - n^(-1/p))``: the tolerance is that bound (plus float32
    rounding of values of magnitude ~10), which vanishes as p grows."""
    texts, hidden, mask = _states(scale=3.0)
    out = generalized_mean(hidden, mask, torch.full((DIM,), p))
    for i, x in enumerate(texts):
        top, low, n = x.max(0).values, x.min(0).values, len(x)
        bound = (top - low) * (1 - n ** (-1 / p)) + 1e-5 * (1 + top.abs())
        gap = top - out[i]
        assert (gap >= -1e-5 * (1 + top.abs())).all() and (gap <= bound).all(), (p, i, gap.max(), bound.min())


def test_softpool_of_one_hot_activations_is_max_within_its_bound():
    """Each channel one token at ``v`` and the rest at 0: ``v e^v / (e^v + n - 1)``, within
    ``v (n - 1) / (e^v + n - 1)`` of max = v (3e-7 at v = 20, n = 9)."""
    n, v = 9, 20.0
    x = torch.zeros(n, DIM)
    x[torch.arange(DIM) % n, torch.arange(DIM)] = v  # channel c peaks at token c mod n
    out = soft_pool(x[None], torch.ones(1, n))[0]
    expected = v * math.exp(v) / (math.exp(v) + n - 1)
    torch.testing.assert_close(out, torch.full((DIM,), expected), atol=1e-5, rtol=1e-6)
    assert (v - out).abs().max() <= v * (n - 1) / (math.exp(v) + n - 1) + 1e-5
    # an all-equal channel is its mean exactly (every weight e^0 = 1)
    assert torch.equal(soft_pool(torch.full((1, 5, 3), 0.7), torch.ones(1, 5)), torch.full((1, 3), 0.7))


def test_simpool_of_identical_tokens_is_that_token_and_mean():
    token = torch.randn(DIM, generator=torch.Generator().manual_seed(5))
    hidden = token.repeat(2, 6, 1)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    hidden[1, 4:] = 50.0  # padding
    out = sim_pool(hidden, mask)
    assert torch.equal(out, masked_mean(hidden, mask))
    torch.testing.assert_close(out, token.repeat(2, 1), atol=1e-6, rtol=0)


def test_options_and_refusals(tmp_path):
    assert build_pooler("gem:p=1").spec == "gem" and build_pooler("mixed:a=0.5").spec == "mixed:a=0.5"
    for spec, msg in (("gem:p=0.5", "p must be a finite number >= 1"), ("gem:p=inf", "p must be a finite"),
                      ("mixed:a=1.5", r"a must be in \[0, 1\]"), ("softpool:a=1", "has no option 'a'"),
                      ("ggem:p=2", "has no option 'p'")):
        with pytest.raises(ValueError, match=msg):
            build_pooler(spec)
    _head("gem").save(tmp_path / "gem", encoder="synthetic")
    with pytest.raises(ValueError, match="not both"):
        build_pooler(f"gem:weights={tmp_path / 'gem'},p=2", model_id="synthetic")
    with pytest.raises(ValueError, match="holds a head for pooler 'gem'"):
        build_pooler(f"ggem:weights={tmp_path / 'gem'}", model_id="synthetic")
    with pytest.raises(ValueError, match="queries and heads must be 1"):
        GeMHead(DIM, heads=2)
    with pytest.raises(ValueError, match="divide the state size"):
        GGeMHead(DIM, groups=5)
    assert GGeMHead(DIM, heads=4).groups == 4 and GGeMHead(384).groups == 16


# ------------------------------------------------------------------ save/load, training
@pytest.mark.parametrize("kind", TRAINABLE)
def test_save_load_to_the_bit(tmp_path, kind):
    head = _head(kind)
    head.save(tmp_path / kind, encoder="synthetic", objective="infonce")
    pooler = build_pooler(f"{kind}:weights={tmp_path / kind}", model_id="synthetic")
    assert type(pooler.head) is type(head) and pooler.spec == f"{kind}:weights={tmp_path / kind}"
    for (name, a), (_, b) in zip(head.state_dict().items(), pooler.head.state_dict().items()):
        assert torch.equal(a, b), name
    _, hidden, mask = _states()
    with torch.no_grad():
        assert torch.equal(pooler.head(hidden, mask), head(hidden, mask))
    again = type(pooler).load(pooler.save(tmp_path / f"{kind}-pooler"))
    with torch.no_grad():
        assert torch.equal(again.head(hidden, mask), head(hidden, mask))
    with pytest.raises(ValueError, match="trained on encoder 'synthetic'"):
        build_pooler(f"{kind}:weights={tmp_path / kind}", model_id="other-model")


def _peaks(n_pairs=64, dim=DIM, noise_tokens=12, seed=0):
    """Each pair shares a pattern of peaks (4.0 on a random half of the channels) carried by one
    token among N(0, 1) noise tokens: a max finds the pattern, a mean dilutes it among the noise."""
    g = torch.Generator().manual_seed(seed)
    queries, docs = [], []
    for _ in range(n_pairs):
        signal = 4.0 * (torch.rand(dim, generator=g) < 0.5).float()
        q, d = torch.randn(3, dim, generator=g), torch.randn(noise_tokens, dim, generator=g)
        queries.append(torch.cat([q[:1] + signal, q[1:]]).half())
        pos = int(torch.randint(0, noise_tokens + 1, (1,), generator=g))
        docs.append(torch.cat([d[:pos], signal[None] + torch.randn(1, dim, generator=g), d[pos:]]).half())
    return PairData(queries, docs, [(i, i) for i in range(n_pairs)])


@pytest.mark.parametrize("kind,roles", [("mixed", "shared"), ("gated", "shared"), ("gem", "shared"),
                                        ("ggem", "separate")])
def test_training_moves_toward_max_and_beats_mean(tmp_path, kind, roles):
    data = _peaks()
    config = TrainConfig(pooler=kind, roles=roles, lr=5e-2, epochs=8, batch_size=16, patience=20, seed=0,
                         dev_fraction=0.25, heads=4 if kind == "ggem" else 1)
    head, report = train_head(data, DIM, config)
    assert report.best_step > 0 and report.best_dev_metric > report.step0_dev_metric + 0.05, report.history
    head.save(tmp_path / kind, encoder="synthetic")
    pooler = build_pooler(f"{kind}:weights={tmp_path / kind}", model_id="synthetic")
    assert pooler.role_aware == (roles == "separate")
    hidden, mask = pad(data.docs[:6])
    with torch.no_grad():
        assert torch.equal(pooler.head(hidden, mask, role="query"), head(hidden, mask, role="query"))
        assert torch.equal(pooler.head(hidden, mask), head(hidden, mask))


# ------------------------------------------------------------------ the real model
def test_poolers_on_the_real_model_alone_as_in_padded_batches(tmp_path, encoder, embedder, varied_texts):
    """Untrained learnable poolers are mean to the bit through the whole pipeline; every pooler (with
    trained-like heads) gives a text the vector it gets alone, whatever the other texts of its
    forward batches and their padding."""
    texts = varied_texts[62:76]  # 8 STS-B sentences, 6 SciFact abstracts (most over the window)
    specs = ["softpool", "simpool", "gem:p=4", "mixed:a=0.5"]
    for kind in TRAINABLE:
        _head(kind, dim=encoder.hidden_size, seed=3).save(tmp_path / kind, encoder=encoder.model_id)
        specs.append(f"{kind}:weights={tmp_path / kind}")
    together = embedder.embed(texts, ["mean", *TRAINABLE, *specs], normalize=False)  # one forward pass
    mean = together.matrix("mean")
    for kind in TRAINABLE:
        np.testing.assert_array_equal(together.matrix(kind), mean, err_msg=kind)
    for spec in specs:
        assert together.matrix(spec).shape == mean.shape and np.isfinite(together.matrix(spec)).all(), spec
        assert not np.allclose(together.matrix(spec), mean, atol=1e-3), spec
    for i in (0, 9, 13):  # a sentence, an abstract, the last text
        alone = embedder.embed([texts[i]], specs, normalize=False)
        for spec in specs:
            np.testing.assert_allclose(together.matrix(spec)[i], alone.matrix(spec)[0], atol=2e-5, rtol=1e-4,
                                       err_msg=spec)
