"""Attention-head training on synthetic token states (no encoder needed) and on the real one."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from embedpool.poolers import build_pooler
from embedpool.poolers.attention import AttentionHead, RoleHeads
from embedpool.poolers.states import TokenStates
from embedpool.poolers.multilayer import MultiLayerHead, MultiLayerRoleHeads
from embedpool.poolers.training import (DevItems, Guard, PairData, TrainConfig, cache_token_states, dev_metric,
                                        ict_pairs, ict_positive_states, ict_spans, pad, significantly_below,
                                        split_dev, state_bytes, train_head)


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
    assert report.history[-1]["train_loss"] < report.history[1]["train_loss"]  # [0] is step 0
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
    loaded = AttentionHead.load(tmp_path / "h")
    cfg_json = loaded.get_config_dict()
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


def _mean(states):
    hidden, mask = pad(states)
    return hidden, mask, (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)


def test_step0_head_is_kept_when_training_only_hurts_dev():
    """Dev gold scores are mean pooling's own cosines, so step 0 (= mean) has dev Spearman 1 and
    every trained checkpoint is worse: the untrained head must come back."""
    train = _synthetic(64, seed=0)
    n = len(train.pairs)
    train.pairs += [(i, (i + 1) % n) for i in range(n)]
    train.scores = [5.0] * n + [0.0] * n
    dev = _synthetic(48, seed=1)
    dev.pairs = [(i, (i * 7 + k) % 48) for i in range(48) for k in (0, 1)]
    _, _, mq = _mean(dev.queries)
    _, _, md = _mean(dev.docs)
    dev.scores = [torch.cosine_similarity(mq[a], md[b], dim=0).item() for a, b in dev.pairs]
    cfg = TrainConfig(objective="cosent", epochs=4, batch_size=32, lr=5e-2, patience=20, seed=0, eval_every=2)
    head, report = train_head(train, 32, cfg, dev=dev)
    assert report.metric == "spearman" and report.step0_dev_metric == pytest.approx(1.0)
    later = [r["dev_spearman"] for r in report.history[1:]]
    assert len(later) > 3 and max(later) < 1.0 - 1e-4
    assert report.best_step == 0 and report.best_dev_metric == report.step0_dev_metric
    hidden, mask, mean = _mean(dev.docs[:4])
    with torch.no_grad():
        torch.testing.assert_close(head(hidden, mask)[:, 0], mean, atol=1e-6, rtol=0)


def test_metric_selection_tracks_dev_metric_and_improves_it():
    data = _synthetic()
    cfg = TrainConfig(epochs=6, batch_size=16, lr=5e-2, patience=10, seed=1, eval_every=3)
    _, report = train_head(data, 32, cfg)
    assert report.metric == "ndcg@10"
    assert report.best_dev_metric > report.step0_dev_metric
    assert report.best_dev_metric == max(r["dev_ndcg@10"] for r in report.history)
    steps = [r["step"] for r in report.history]
    assert steps[0] == 0 and steps == sorted(steps) and len(steps) > cfg.epochs + 1  # eval_every adds rows


def test_dev_metric_ndcg_on_known_rankings():
    data = _synthetic(20)
    head = AttentionHead(32).eval()
    cfg = TrainConfig()
    # documents identical to their queries: each query's own document ranks first
    same = PairData(data.queries, data.queries, [(i, i) for i in range(20)])
    assert dev_metric(head, same, range(20), cfg) == ("ndcg@10", pytest.approx(1.0))
    # a query whose only relevant document is not in its top 10 scores 0
    far = PairData([torch.ones(3, 32).half()], [torch.ones(2, 32).half()] * 10 + [-torch.ones(2, 32).half()],
                   [(0, 10)])
    assert dev_metric(head, far, [0], cfg)[1] == 0.0


def test_carved_dev_keeps_a_query_on_one_side():
    groups = [i // 3 for i in range(30)]  # ten queries with three positives each
    train, dev = split_dev(30, 0.2, seed=0, groups=groups)
    assert sorted(train + dev) == list(range(30)) and len(dev) == 6
    assert not {groups[i] for i in train} & {groups[i] for i in dev}


def _role_synthetic(n_pairs: int = 96, dim: int = 32, seed: int = 0) -> PairData:
    """The signal token is marked in dim -1 in queries but dim -2 in documents, and the noise
    tokens carry the other marker: a head that must serve both sides has conflicting targets."""
    g = torch.Generator().manual_seed(seed)
    queries, docs = [], []
    for _ in range(n_pairs):
        signal = torch.randn(dim, generator=g)
        q, d = torch.randn(10, dim, generator=g), torch.randn(14, dim, generator=g)
        qs, ds = signal.clone(), signal.clone()
        qs[-2:] = torch.tensor([0.0, 3.0])
        ds[-2:] = torch.tensor([3.0, 0.0])
        q[:, -2:] = torch.tensor([3.0, 0.0])
        d[:, -2:] = torch.tensor([0.0, 3.0])
        queries.append(torch.cat([q, qs[None]]).half())
        docs.append(torch.cat([ds[None], d]).half())
    return PairData(queries, docs, [(i, i) for i in range(n_pairs)])


def test_separate_role_heads_train_save_load_and_serve_by_role(tmp_path):
    data = _role_synthetic()
    kw = dict(epochs=12, batch_size=16, lr=5e-2, patience=12, seed=0, value_projection=False)
    sep, rep_sep = train_head(data, 32, TrainConfig(roles="separate", **kw))
    shared, rep_shared = train_head(data, 32, TrainConfig(roles="shared", **kw))
    assert isinstance(sep, RoleHeads) and isinstance(shared, AttentionHead)
    # separate heads learn opposite token preferences; one shared head cannot
    assert rep_sep.best_dev_metric > rep_shared.best_dev_metric
    assert rep_sep.best_dev_metric > rep_sep.step0_dev_metric
    assert not torch.allclose(sep.query.score.weight, sep.document.score.weight)
    sep.save(tmp_path / "h", encoder="synthetic")
    loaded = AttentionHead.load(tmp_path / "h")
    cfg = loaded.get_config_dict()
    assert cfg["roles"] == "separate" and isinstance(loaded, RoleHeads)
    pooler = build_pooler(f"attention:weights={tmp_path / 'h'}", model_id="synthetic")
    assert pooler.roles == "separate" and not pooler.multi_vector
    hidden, mask = pad(data.queries[:5])
    states = TokenStates(hidden, mask, torch.zeros_like(mask), torch.arange(5), 5)
    with torch.no_grad():
        as_query = pooler.pool_role(states, "query")
        as_doc = pooler.pool_role(states, "document")
        torch.testing.assert_close(as_query, sep.query(hidden, mask)[:, 0], atol=0, rtol=0)
        torch.testing.assert_close(as_doc, sep.document(hidden, mask)[:, 0], atol=0, rtol=0)
        torch.testing.assert_close(pooler.pool(states), as_doc, atol=0, rtol=0)
    assert not torch.allclose(as_query, as_doc, atol=1e-3)
    with pytest.raises(ValueError, match="role must be one of"):
        pooler.pool_role(states, "passage")
    # a shared head file pools both roles the same way
    shared.save(tmp_path / "s", encoder="synthetic")
    sp = build_pooler(f"attention:weights={tmp_path / 's'}", model_id="synthetic")
    assert sp.roles == "shared"
    torch.testing.assert_close(sp.pool_role(states, "query"), sp.pool_role(states, "document"), atol=0, rtol=0)


def test_multi_head_step0_is_mean_trains_and_round_trips(tmp_path):
    data = _synthetic()
    hidden, mask, mean = _mean(data.docs[:6])
    with torch.no_grad():
        torch.testing.assert_close(AttentionHead(32, heads=4)(hidden, mask)[:, 0], mean, atol=1e-6, rtol=0)
    cfg = TrainConfig(heads=4, epochs=8, batch_size=16, lr=5e-2, patience=8, seed=1)
    head, report = train_head(data, 32, cfg)
    assert head.heads == 4 and head.score.out_features == 4
    assert report.best_dev_metric > report.step0_dev_metric
    with torch.no_grad():
        out = head(hidden, mask)
        # the four heads weight the tokens differently: not one shared weighting of all dimensions
        w = torch.softmax(head.score(hidden).masked_fill(~mask.bool()[..., None], float("-inf")), dim=1)
        assert not torch.allclose(w[..., 0], w[..., 1], atol=1e-3)
    head.save(tmp_path / "mh", encoder="synthetic")
    loaded = AttentionHead.load(tmp_path / "mh")
    cfg_json = loaded.get_config_dict()
    assert cfg_json["heads"] == 4 and loaded.heads == 4
    with torch.no_grad():
        torch.testing.assert_close(loaded(hidden, mask), out, atol=0, rtol=0)
    with pytest.raises(ValueError, match="divide the state size"):
        AttentionHead(32, heads=5)


def test_separate_roles_refused_for_symmetric_sts_pairs():
    data = _synthetic(8)
    data.scores = [1.0] * 8
    with pytest.raises(ValueError, match="symmetric"):
        train_head(data, 32, TrainConfig(objective="cosent", roles="separate", epochs=1))


def test_ict_pairs_split_sentences():
    docs = ["First sentence is here. Second sentence follows it now. Third one closes the doc.", "One only."]
    pairs = ict_pairs(docs, seed=0, min_words=3)
    assert len(pairs) == 1
    q, rest = pairs[0]
    assert q in docs[0] and q not in rest and len(rest.split(". ")) == 2


def test_ict_spans_locate_the_query_sentence():
    docs = ["  Title words here. First real sentence of the text! Another sentence follows it here? End.",
            "No split here", "Short. Tiny."]
    spans = ict_spans(docs, seed=3, min_words=2)
    assert [sp.doc for sp in spans] == [0]
    sp = spans[0]
    assert docs[0][sp.start:sp.end] == sp.sentence and sp.sentence not in sp.rest
    assert ict_pairs(docs, seed=3, min_words=2) == [(sp.sentence, sp.rest)]


def test_ict_positives_drop_the_sentence_tokens(tmp_path, encoder):
    docs = ["Aspirin lowers the risk of stroke. It inhibits platelet aggregation strongly in most adults. "
            "Side effects include bleeding."]
    spans = [sp for seed in range(20) for sp in ict_spans(docs, seed, min_words=3)
             if sp.sentence.startswith("It inhibits")][:1]
    assert spans, "no seed picked the middle sentence"
    states = cache_token_states(encoder, docs, "document", tmp_path)
    (pos,) = ict_positive_states(encoder, docs, states, spans)
    n_sentence = len(encoder.tokenizer(spans[0].sentence, add_special_tokens=False)["input_ids"])
    assert pos.shape[0] == states[0].shape[0] - n_sentence
    ids = encoder.tokenizer(docs[0])["input_ids"]
    first = len(encoder.tokenizer("Aspirin lowers the risk of stroke.")["input_ids"]) - 1  # [CLS] + sentence 1
    torch.testing.assert_close(pos[:first], states[0][:first], atol=0, rtol=0)
    torch.testing.assert_close(pos[first:], states[0][first + n_sentence:], atol=0, rtol=0)
    assert len(ids) == states[0].shape[0]


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


def _cos_to_mean(head, states) -> float:
    """How close the head's vectors stay to mean pooling's on ``states`` (mean cosine)."""
    hidden, mask, mean = _mean(states)
    with torch.no_grad():
        return torch.cosine_similarity(head(hidden, mask)[:, 0], mean, dim=-1).mean().item()


def test_anchor_pulls_the_trained_head_toward_mean():
    data = _synthetic()
    free, free_report = train_head(data, 32, TrainConfig(epochs=10, batch_size=16, lr=5e-2, patience=10, seed=1))
    held, held_report = train_head(data, 32, TrainConfig(epochs=10, batch_size=16, lr=5e-2, patience=10, seed=1,
                                                         anchor=20.0))
    assert free_report.best_step > 0 and held_report.best_step > 0  # both trained
    assert _cos_to_mean(held, data.docs) > _cos_to_mean(free, data.docs) + 0.05
    assert _cos_to_mean(held, data.docs) < 1 - 1e-3  # held near mean, not at it


def test_guard_keeps_no_checkpoint_that_loses_on_another_task():
    """The guard task is scored by mean pooling's own cosines, so the untrained head is perfect
    on it (Spearman 1) and every trained checkpoint loses there."""
    train = _synthetic()
    other = _synthetic(48, seed=2)
    other.pairs = [(i, (i * 5 + k) % 48) for i in range(48) for k in (0, 1)]
    _, _, mq = _mean(other.queries)
    _, _, md = _mean(other.docs)
    other.scores = [torch.cosine_similarity(mq[a], md[b], dim=0).item() for a, b in other.pairs]
    cfg = TrainConfig(epochs=6, batch_size=16, lr=5e-2, patience=6, seed=1, guard_tolerance=0.0)
    free, free_report = train_head(train, 32, cfg)
    assert free_report.best_step > 0 and free_report.best_dev_metric > free_report.step0_dev_metric
    head, report = train_head(train, 32, cfg, guard=Guard(other, "cosent"))
    assert report.guard_metric == "spearman" and report.step0_guard_metric == pytest.approx(1.0)
    assert all(r["guard_refused"] for r in report.history[1:]) and len(report.history) > 2
    assert report.best_step == 0  # the untrained head, i.e. mean
    assert _cos_to_mean(head, train.docs) == pytest.approx(1.0, abs=1e-6)
    # a tolerance as wide as the metric's range refuses nothing: the run is the unguarded one
    loose, loose_report = train_head(train, 32, replace(cfg, guard_tolerance=2.0), guard=Guard(other, "cosent"))
    assert loose_report.best_step == free_report.best_step
    assert loose_report.best_guard_metric < 1.0 - 1e-4
    for (k, v), (_, v2) in zip(loose.state_dict().items(), free.state_dict().items()):
        assert torch.equal(v, v2), k


def test_multilayer_head_trains_on_every_layer_and_serves(tmp_path, encoder, embedder):
    texts = ["cached token states", "are computed once", "for every layer of the encoder"]
    last = cache_token_states(encoder, texts, "document", tmp_path)
    every = cache_token_states(encoder, texts, "document", tmp_path, all_layers=True)
    assert len(list(tmp_path.glob("states-*.pt"))) == 2  # the two caches have their own keys
    # the size estimate made before encoding is what the caches hold
    assert state_bytes(encoder, texts) == sum(x.numel() * 2 for x in last)
    assert state_bytes(encoder, texts, all_layers=True) == sum(x.numel() * 2 for x in every)
    for one, all_ in zip(last, every):
        assert all_.dtype == torch.float16 and all_.shape == (7, *one.shape)  # embeddings + 6 layers
        torch.testing.assert_close(all_[-1], one, atol=0, rtol=0)  # the last layer is the last-layer cache
    data = PairData(every, every, [(0, 0), (1, 1), (2, 2)])
    with pytest.raises(ValueError, match="attention head trains on last-layer states"):
        train_head(data, 384, TrainConfig(epochs=1, batch_size=2))
    with pytest.raises(ValueError, match="multilayer head trains on every layer's states"):
        train_head(PairData(last, last, data.pairs), 384, TrainConfig(pooler="multilayer", epochs=1, batch_size=2))
    for roles, made in (("shared", MultiLayerHead), ("separate", MultiLayerRoleHeads)):
        cfg = TrainConfig(pooler="multilayer", roles=roles, epochs=2, batch_size=3, lr=0.05, dev_fraction=0.34,
                          patience=2)
        head, _ = train_head(data, 384, cfg)
        assert type(head) is made and head.layers == 7
        with torch.no_grad():
            for m in head.modules():
                if isinstance(m, MultiLayerHead):  # make sure it differs from mean
                    m.score.weight.normal_(0, 0.3)
                    m.layer_mix.normal_(0, 0.3)
        head.save(tmp_path / roles, encoder=encoder.model_id)
        spec = f"multilayer:weights={tmp_path / roles}"
        got = embedder.embed(texts, [spec], normalize=False).matrix(spec)
        hidden, mask = pad(every)
        assert hidden.shape[:2] == (7, 3)
        with torch.no_grad():
            direct = head(hidden, mask, role="document")[:, 0].numpy()
        np.testing.assert_allclose(got, direct, atol=2e-2)  # the cache is float16
        mean = embedder.embed(texts, ["mean"], normalize=False).matrix("mean")
        assert not np.allclose(got, mean, atol=1e-2)


def test_layer_lr_scales_the_step_of_the_layer_weights_only():
    """All-layer synthetic states (the signal token is visible in the first layer only): the
    layer weights move further with a larger ``layer_lr``."""
    base = _synthetic(32)
    g = torch.Generator().manual_seed(3)

    def layers(states):
        out = []
        for s in states:
            first = s.clone()
            last = s.clone()
            last[:, -1] = 0.0
            out.append(torch.stack([first, (last + 0.1 * torch.randn(last.shape, generator=g)).half(), last]))
        return out

    data = PairData(layers(base.queries), layers(base.docs), base.pairs)
    cfg = TrainConfig(pooler="multilayer", epochs=1, batch_size=8, lr=1e-3, patience=5, eval_every=1, seed=0)
    moved = {}
    for x in (1.0, 30.0):
        head, report = train_head(data, 32, replace(cfg, layer_lr=x, select="loss"))
        assert report.best_step > 0
        moved[x] = (head.layer_mix.abs().max().item(), report.best_step)
    assert moved[30.0][0] > 5 * moved[1.0][0], moved


def test_the_default_guard_refuses_a_significant_loss_only():
    """``significantly_below`` (the guard's default rule) against scipy's own tests: per-query
    nDCG through ``ttest_rel``; Spearman through ``scipy.stats.bootstrap``'s paired interval."""
    from scipy.stats import bootstrap, spearmanr, ttest_rel

    rng = np.random.default_rng(3)
    gold = rng.uniform(0, 5, 400)
    good = DevItems(gold + rng.normal(0, 1.0, 400), gold)
    same = DevItems(good.values.copy(), gold)
    assert significantly_below(same, good) == (False, 1.0)
    noisy = DevItems(gold + rng.normal(0, 1.0, 400), gold)  # as good, other noise
    worse = DevItems(gold + rng.normal(0, 3.0, 400), gold)
    better = DevItems(gold + rng.normal(0, 0.3, 400), gold)
    for now, expect in ((worse, True), (better, False), (noisy, False)):
        below, p = significantly_below(now, good)
        ci = bootstrap((now.values, good.values, gold), lambda a, b, g: spearmanr(a, g).statistic
                       - spearmanr(b, g).statistic, paired=True, vectorized=False, n_resamples=500,
                       confidence_level=0.9, random_state=0).confidence_interval
        assert below == expect == (ci.high < 0), (p, ci)
    # nDCG@10 per query: a one-sided paired t-test
    before = DevItems(rng.uniform(0, 1, 300))
    for shift, expect in ((-0.1, True), (0.0, False), (0.1, False)):
        now = DevItems(np.clip(before.values + shift + rng.normal(0, 0.05, 300), 0, 1))
        below, p = significantly_below(now, before)
        assert below == expect
        assert p == pytest.approx(ttest_rel(now.values, before.values, alternative="less").pvalue)


def test_the_bootstrap_guard_is_the_same_in_chunks(monkeypatch):
    """Resamples are drawn in chunks bounded in entries (memory bounded whatever the guard split's
    size); small chunks give the same decision on a clear loss and on no loss."""
    import embedpool.poolers.training as training

    rng = np.random.default_rng(5)
    gold = rng.uniform(0, 5, 300)
    good = DevItems(gold + rng.normal(0, 1.0, 300), gold)
    worse = DevItems(gold + rng.normal(0, 3.0, 300), gold)
    whole = [significantly_below(worse, good)[0], significantly_below(good, good)]
    monkeypatch.setattr(training, "BOOTSTRAP_CHUNK_ENTRIES", 300 * 7)  # 7 resamples a chunk
    assert [significantly_below(worse, good)[0], significantly_below(good, good)] == whole == [True, (False, 1.0)]
