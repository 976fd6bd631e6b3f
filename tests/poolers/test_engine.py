"""Engine behaviour: plans, the one-pass invariant, attention, post-processing, bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from embedpool.errors import InvalidError, NotFoundError
from embedpool.poolers import Embedder, FrozenEncoder, Plan, build_pooler
from embedpool.poolers.attention import AttentionHead
from embedpool.poolers.encoder import WINDOWED, default_model_path, pooling_mode_from_config


# ---------------------------------------------------------------- landmark plan
def test_landmark_layout_exact_ids(encoder):
    text = "one two three four five six seven"
    toks = encoder.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(toks) == 7
    rows = encoder.windows([text], Plan("landmark", 3))[0]
    assert len(rows) == 1
    cls, sep = encoder.tokenizer.cls_token_id, encoder.tokenizer.sep_token_id
    expected = [cls] + toks[0:3] + [sep] + toks[3:6] + [sep] + toks[6:7] + [sep]
    assert rows[0].ids == expected
    assert [i for i, m in enumerate(rows[0].landmark) if m] == [4, 8, 10]
    assert rows[0].special == [1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 1]


def test_landmark_empty_text_is_cls_sep(encoder):
    rows = encoder.windows([""], Plan("landmark", 32))[0]
    assert rows[0].ids == [encoder.tokenizer.cls_token_id, encoder.tokenizer.sep_token_id]


def test_landmark_long_input_is_windowed_not_truncated(encoder, embedder):
    words = " ".join(f"w{i % 97} alpha" for i in range(1100))
    n_tokens = len(encoder.tokenizer(words, add_special_tokens=False)["input_ids"])
    assert n_tokens >= 3000
    rows = encoder.windows([words], Plan("landmark", 32))[0]
    per_window = (encoder.max_length - 1) // 33
    assert len(rows) == -(-(-(-n_tokens // 32)) // per_window) >= 2
    for r in rows:  # every window a valid [CLS] ... [SEP] sequence within the model window
        assert r.ids[0] == encoder.tokenizer.cls_token_id and r.ids[-1] == encoder.tokenizer.sep_token_id
        assert len(r.ids) <= encoder.max_length
    assert sum(sum(r.landmark) for r in rows) == -(-n_tokens // 32)  # no token left out
    # the pooled vector is the mean of the landmark states of every window; the windows are
    # forwarded in consecutive batches within the token budget (they do not fit in one)
    states = [s for _, s in encoder.encode([words], Plan("landmark", 32))]
    assert len(states) >= 2 and sum(s.hidden.shape[0] for s in states) == len(rows)
    assert [s.continued for s in states] == [True] * (len(states) - 1) + [False]
    assert all(s.attention_mask.numel() <= encoder.max_batch_tokens for s in states)
    lm = torch.cat([s.hidden[s.landmark_mask.bool()] for s in states])
    assert lm.shape[0] == -(-n_tokens // 32)
    expected = torch.nn.functional.normalize(lm.mean(0), dim=-1).numpy()
    got = embedder.embed([words], ["landmark"]).vectors["landmark"][0]
    np.testing.assert_allclose(got, expected, atol=1e-5)
    # a truncating pooler sees only the first window's worth of tokens
    assert len(encoder.windows([words])[0][0].ids) == encoder.max_length


def test_window_keeps_every_token_of_a_long_input(encoder, embedder, st_model):
    """tokens/cluster with window=true: every token of a 3,000-token input, window by window;
    the first window is the standard (truncated) sequence; a short input is unchanged."""
    words = " ".join(f"w{i % 97} alpha" for i in range(1100))
    body = encoder.tokenizer(words, add_special_tokens=False)["input_ids"]
    width = encoder.max_length - 2
    rows = encoder.windows([words], WINDOWED)[0]
    assert len(rows) == -(-len(body) // width) >= 2
    assert [t for r in rows for t in r.ids[1:-1]] == body  # no token left out, none repeated
    for r in rows:
        assert r.ids[0] == encoder.tokenizer.cls_token_id and r.ids[-1] == encoder.tokenizer.sep_token_id
        assert len(r.ids) <= encoder.max_length
    assert rows[0].ids == encoder.windows([words])[0][0].ids
    short = ["a short text", ""]
    assert encoder.windows(short, WINDOWED) == encoder.windows(short)

    specs = ["tokens", "tokens:window=true", "cluster:window=true"]
    r = embedder.embed([words, "a short text"], specs)
    win = r.vectors["tokens:window=true"][0]
    assert len(r.vectors["tokens"][0]) == encoder.max_length
    assert len(win) == len(body) + 2 * len(rows)
    # window k's vectors are sentence-transformers' transformer run on that window alone
    bert = st_model[0].auto_model
    start = 0
    for row in rows:
        ids = torch.tensor([row.ids])
        with torch.inference_mode():
            ref = bert(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
        ref = torch.nn.functional.normalize(ref.float(), dim=-1).numpy()
        np.testing.assert_allclose(win[start:start + len(row.ids)], ref, atol=1e-4)
        start += len(row.ids)
    # a short input: the same vectors (up to batch padding effects, as in test_batch_invariance)
    np.testing.assert_allclose(r.vectors["tokens:window=true"][1], r.vectors["tokens"][1], atol=1e-5)
    assert len(r.vectors["cluster:window=true"][0]) == 1 + (len(win) - 1) // 2


def test_landmark_excludes_cls(encoder, embedder):
    text = "landmark pooling ignores the first token state"
    (_, st), = list(encoder.encode([text], Plan("landmark", 4)))
    seps = st.hidden[0][st.landmark_mask[0].bool()]
    with_cls = torch.cat([st.hidden[0][:1], seps]).mean(0)
    got = embedder.embed([text], ["landmark:g=4"], normalize=False).vectors["landmark:g=4"][0]
    np.testing.assert_allclose(got, seps.mean(0).numpy(), atol=1e-6)
    assert not np.allclose(got, with_cls.numpy(), atol=1e-3)


# ---------------------------------------------------------------- one pass per plan
def test_one_forward_pass_per_plan(encoder, embedder):
    texts = ["first text", "a second, longer text about pooling", ""]
    before = dict(encoder.stats.per_plan)
    passes = encoder.stats.passes
    r = embedder.embed(texts, ["mean", "cls", "max", "cluster:pool_factor=2"])
    assert encoder.stats.passes - passes == 1
    assert encoder.stats.per_plan["standard"] - before.get("standard", 0) == 1
    assert set(r.vectors) == {"mean", "cls", "max", "cluster:pool_factor=2"}
    passes = encoder.stats.passes
    embedder.embed(texts, ["mean", "tokens", "landmark", "landmark:g=16"])
    assert encoder.stats.passes - passes == 3  # standard, landmark g=32, landmark g=16
    passes = encoder.stats.passes
    embedder.embed(texts, ["mean", "tokens:window=true", "cluster:window=true"])
    assert encoder.stats.passes - passes == 2  # standard, windowed


def test_batch_invariance(encoder, embedder, scifact_docs):
    alone = ["The quick brown fox jumps over the lazy dog."]
    mixed = [scifact_docs[0], "hi", alone[0], scifact_docs[3][:200], ""]
    specs = ["mean", "cls", "max", "landmark", "tokens"]
    a = embedder.embed(alone, specs)
    old = encoder.max_batch_tokens
    try:
        encoder.max_batch_tokens = 600  # force several batches with padding
        m = embedder.embed(mixed, specs)
    finally:
        encoder.max_batch_tokens = old
    for spec in specs:
        np.testing.assert_allclose(m.vectors[spec][2], a.vectors[spec][0], atol=1e-5, err_msg=spec)


def test_input_order_restored(embedder):
    texts = ["short", "a much longer text " * 20, "mid length text here"]
    together = embedder.embed(texts, ["mean"]).matrix("mean")
    for i, t in enumerate(texts):
        np.testing.assert_allclose(together[i], embedder.embed([t], ["mean"]).matrix("mean")[0], atol=1e-5)


# ---------------------------------------------------------------- attention
def test_untrained_attention_equals_mean_exactly(embedder, varied_texts):
    r = embedder.embed(varied_texts[:40], ["mean", "attention"], normalize=False)
    assert np.array_equal(r.matrix("mean"), r.matrix("attention"))


def test_attention_head_round_trip_and_multi_query(tmp_path, embedder, encoder):
    torch.manual_seed(0)
    head = AttentionHead(384, queries=3, value_projection=True)
    with torch.no_grad():
        head.score.weight.normal_(0, 0.5)
        head.value.weight.add_(0.01 * torch.randn(384, 384))
    head.save(tmp_path / "h", encoder=encoder.model_id)
    texts = ["attention pools tokens", "with learned weights"]
    spec = f"attention:weights={tmp_path / 'h'}"
    out = embedder.embed(texts, [spec], normalize=False).vectors[spec]
    assert [o.shape for o in out] == [(3, 384), (3, 384)]
    # the same head in memory gives the same vectors
    (_, st), = list(encoder.encode(texts))
    with torch.no_grad():
        direct = head.eval()(st.hidden, st.pool_mask)
    np.testing.assert_allclose(np.stack(out), direct.numpy(), atol=1e-6)
    # and it is not mean pooling any more
    mean = embedder.embed(texts, ["mean"], normalize=False).matrix("mean")
    assert not np.allclose(out[0][0], mean[0], atol=1e-3)
    # a second load reproduces it exactly
    again = build_pooler(spec, model_id=encoder.model_id)
    assert again.queries == 3 and again.multi_vector


def test_attention_head_for_another_encoder_refused(tmp_path, encoder):
    AttentionHead(384).save(tmp_path / "h", encoder="some/other-model")
    with pytest.raises(ValueError, match="trained on encoder 'some/other-model'"):
        build_pooler(f"attention:weights={tmp_path / 'h'}", model_id=encoder.model_id)


def test_attention_missing_weights_clear_error(tmp_path):
    with pytest.raises(NotFoundError, match="head.safetensors"):
        build_pooler(f"attention:weights={tmp_path / 'nope'}")


# ---------------------------------------------------------------- post-processing
def test_matryoshka_dimensions_truncate_then_normalize(embedder):
    r = embedder.embed(["matryoshka"], ["mean"], normalize=False).matrix("mean")[0]
    d = embedder.embed(["matryoshka"], ["mean"], dimensions=64).matrix("mean")[0]
    assert d.shape == (64,)
    np.testing.assert_allclose(d, r[:64] / np.linalg.norm(r[:64]), atol=1e-6)
    multi = embedder.embed(["matryoshka tokens"], ["tokens"], dimensions=32).vectors["tokens"][0]
    assert multi.shape[1] == 32
    np.testing.assert_allclose(np.linalg.norm(multi, axis=1), 1.0, atol=1e-5)


def test_normalize_flag(embedder):
    n = embedder.embed(["norm"], ["max"]).matrix("max")[0]
    u = embedder.embed(["norm"], ["max"], normalize=False).matrix("max")[0]
    assert abs(np.linalg.norm(n) - 1) < 1e-5 and abs(np.linalg.norm(u) - 1) > 1e-2


# ---------------------------------------------------------------- bad input
def test_unknown_pooler_names_choices(embedder):
    with pytest.raises(InvalidError, match="choose one of: auto, attention, attnstats, cls, cluster"):
        embedder.embed(["x"], ["nope"])
    with pytest.raises(InvalidError, match="valid options: pool_factor, protected"):
        embedder.embed(["x"], ["cluster:factor=2"])
    with pytest.raises(InvalidError, match="not a valid int"):
        embedder.embed(["x"], ["landmark:g=abc"])
    with pytest.raises(InvalidError, match="key=value"):
        embedder.embed(["x"], ["cluster:2"])
    with pytest.raises(ValueError, match="pool_factor must be >= 1"):
        embedder.embed(["x"], ["cluster:pool_factor=0.5"])
    with pytest.raises(ValueError, match="queries must be between 1 and 64, got 100000"):
        embedder.embed(["x"], ["attention:queries=100000"])
    assert len(embedder.embed(["x"], ["attention:queries=64"]).vectors["attention:queries=64"][0]) == 64


def test_type_errors(embedder):
    with pytest.raises(InvalidError, match="input 1 is int"):
        embedder.embed(["ok", 3], ["mean"])
    with pytest.raises(InvalidError, match="not a single string"):
        embedder.embed("a string", ["mean"])
    with pytest.raises(ValueError, match="role must be one of"):
        embedder.embed(["x"], ["mean"], role="passage")


def test_empty_list_and_empty_string(embedder, st_model):
    r = embedder.embed([], ["mean", "tokens"])
    assert r.vectors == {"mean": [], "tokens": []}
    e = embedder.embed([""], ["mean"]).matrix("mean")[0]
    assert np.isfinite(e).all()
    np.testing.assert_allclose(e, st_model.encode([""])[0], atol=1e-5)


def test_dimensions_out_of_range(embedder):
    with pytest.raises(ValueError, match="between 1 and the model's 384"):
        embedder.embed(["x"], ["mean"], dimensions=385)
    with pytest.raises(ValueError, match="between 1"):
        embedder.embed(["x"], ["mean"], dimensions=0)


def test_truncate_false_refuses_long_input(embedder):
    with pytest.raises(ValueError, match="over the model's limit of 256"):
        embedder.embed(["word " * 400], ["mean"], truncate=False)
    # the landmark plan windows instead
    assert embedder.embed(["word " * 400], ["landmark"], truncate=False).vectors["landmark"][0].shape == (384,)


# ---------------------------------------------------------------- model config
@pytest.mark.parametrize("config, mode", [
    ({"word_embedding_dimension": 384, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls"),
    ({"word_embedding_dimension": 384, "pooling_mode_max_tokens": True}, "max"),
    ({"embedding_dimension": 384, "pooling_mode": "cls", "include_prompt": True}, "cls"),
    ({"embedding_dimension": 384, "pooling_mode": ["max"]}, "max"),
    ({"embedding_dimension": 384}, "mean"),
])
def test_pooling_mode_from_v5_and_v6_configs(config, mode):
    assert pooling_mode_from_config(config) == mode


@pytest.fixture(scope="module")
def cls_model_dir(tmp_path_factory):
    """A copy of the default model whose pooling config says CLS (v6 key) and which has prompts."""
    src = Path(default_model_path())
    dst = tmp_path_factory.mktemp("model") / "minilm-cls"
    shutil.copytree(src, dst)
    (dst / "1_Pooling" / "config.json").write_text(json.dumps(
        {"embedding_dimension": 384, "pooling_mode": "cls", "include_prompt": True}))
    cfg = json.loads((dst / "config_sentence_transformers.json").read_text())
    cfg["prompts"] = {"query": "query: ", "document": ""}
    (dst / "config_sentence_transformers.json").write_text(json.dumps(cfg))
    return dst


def test_auto_pooler_and_prompts_follow_the_model(cls_model_dir):
    from sentence_transformers import SentenceTransformer

    enc = FrozenEncoder(str(cls_model_dir), precision="fp32")  # compared with sentence-transformers fp32
    emb = Embedder(enc)
    assert enc.pooling_mode == "cls" and emb.canonical("auto") == "cls"
    st = SentenceTransformer(str(cls_model_dir), device="cpu")
    texts = ["what is landmark pooling?", "pooling"]
    q = emb.embed(texts, ["auto"], role="query").matrix("auto")
    d = emb.embed(texts, ["auto"], role="document").matrix("auto")
    ref_q = st.encode(texts, prompt_name="query", normalize_embeddings=True)
    ref_d = st.encode(texts, normalize_embeddings=True)
    assert (q * ref_q).sum(1).min() >= 0.99999
    assert (d * ref_d).sum(1).min() >= 0.99999
    assert (q * d).sum(1).max() < 0.999  # the prompt changed the query embedding


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(NotFoundError, match="nothing is downloaded"):
        FrozenEncoder("no-such-org/no-such-model-xyz")


# ---------------------------------------------------------------- CLI
def _cli(*args, stdin: str | None = None):
    return subprocess.run([sys.executable, "-m", "embedpool.app.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_cli_embed_json_lines(embedder):
    p = _cli("embed", "A sample sentence.", "", "--pooler", "mean", "--dimensions", "8", "--precision", "fp32")
    assert p.returncode == 0, p.stderr
    lines = [json.loads(x) for x in p.stdout.splitlines()]
    assert [x["index"] for x in lines] == [0, 1]
    ref = embedder.embed(["A sample sentence.", ""], ["mean"], dimensions=8).matrix("mean")
    np.testing.assert_allclose(np.array([x["embedding"] for x in lines]), ref, atol=1e-5)
    p = _cli("embed", "--input", "-", "--pooler", "cluster", stdin='{"text": "json lines input"}\nplain line\n')
    assert p.returncode == 0, p.stderr
    lines = [json.loads(x) for x in p.stdout.splitlines()]
    assert len(lines) == 2 and all("embeddings" in x for x in lines)


def test_cli_embed_bad_pooler_exit_2():
    p = _cli("embed", "x", "--pooler", "median")
    assert p.returncode == 2
    assert "unknown pooler 'median'" in p.stderr and "mean" in p.stderr
