"""Short rows sharing forward rows (poolers/packing.py): every row gets the states it has alone.

The references: sentence-transformers encoding each sentence by itself, and the transformers
model run on each row alone with its own 2D mask. Packing must change the forward's shapes (a
test that packing happened at all) and nothing else beyond float rounding."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from embedpool.poolers import packing, runtimes
from embedpool.poolers.precision import load_forward


def _sts(data_dir, n: int) -> list[str]:
    out: list[str] = []
    with open(data_dir / "stsb" / "test.tsv") as f:
        next(f)
        for line in f:
            out += line.rstrip("\n").split("\t")[:2]
            if len(out) >= n:
                return out[:n]
    return out


class _Shapes:
    """The encoder's forward, recording each call's input shape and mask rank."""

    mask_4d = True

    def __init__(self, forward) -> None:
        self.forward, self.calls = forward, []

    def __call__(self, **kw):
        self.calls.append((tuple(kw["input_ids"].shape), kw["attention_mask"].dim()))
        return self.forward(**kw)


def _twin(encoder, forward=None, pack_tokens=packing.PACK_TOKENS):
    twin = copy.copy(encoder)
    twin.stats = type(encoder.stats)()
    twin.pack_tokens = pack_tokens
    if forward is not None:
        twin._forward_fn = forward
    return twin


@pytest.fixture(scope="module")
def sentences(data_dir):
    return _sts(data_dir, 90)


def test_packed_sentences_equal_sentence_transformers_one_at_a_time(encoder, st_model, sentences):
    from embedpool.poolers import Embedder

    shapes = _Shapes(encoder.model)
    got = Embedder(_twin(encoder, shapes)).embed(sentences, ["mean"]).matrix("mean")
    ref = np.stack([st_model.encode([s], normalize_embeddings=True)[0] for s in sentences])
    assert np.abs(got - ref).max() < 1e-5
    # packing happened: 90 sentences went through 4D-masked rows, far fewer than 90 of them
    assert all(rank == 4 for _, rank in shapes.calls)
    assert sum(rows for (rows, _), _ in shapes.calls) <= len(sentences) // 2


@pytest.mark.parametrize("all_layers", [False, True])
def test_every_token_state_and_layer_equals_the_unpacked_forward(encoder, sentences, all_layers):
    packed, plain = _twin(encoder), _twin(encoder, pack_tokens=0)
    a = list(packed.encode(sentences[:40], all_layers=all_layers))
    b = list(plain.encode(sentences[:40], all_layers=all_layers))
    assert [ids for ids, _ in a] == [ids for ids, _ in b]
    for (_, x), (_, y) in zip(a, b):
        assert torch.equal(x.attention_mask, y.attention_mask)
        real = x.attention_mask.bool()
        assert (x.hidden[real] - y.hidden[real]).abs().max() < 1e-5
        if all_layers:
            assert torch.equal(x.layers[-1], x.hidden)  # the last layer is the hidden state itself
            assert (x.layers[:, real] - y.layers[:, real]).abs().max() < 1e-5


def test_a_row_keeps_its_own_key_mask_when_packed(encoder):
    """A position a row's 2D mask hides (a ColBERT query's non-attending expansion token) stays
    hidden from the row's other tokens, and still gets its own state, as transformers computes
    them for the row alone."""
    tok = encoder.tokenizer
    texts = ["a short one", "the second text is a little longer than that",
             "third", "and a fourth sentence here"]
    rows = [tok(t)["input_ids"] for t in texts]
    masks = [[1] * len(r) for r in rows]
    masks[1][3] = 0
    masks[3][-2] = 0
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), torch.tensor(m)
    pk = packing.pack(ids, mask, [len(r) for r in rows], 0)
    assert pk is not None and pk.input_ids.shape[0] < len(rows)
    with torch.inference_mode():
        out = encoder.model(input_ids=pk.input_ids, attention_mask=pk.attention_mask,
                            position_ids=pk.position_ids).last_hidden_state
        states = pk.unpack(out)
        for i, (r, m) in enumerate(zip(rows, masks)):
            alone = encoder.model(input_ids=torch.tensor([r]), attention_mask=torch.tensor([m])).last_hidden_state[0]
            assert (states[i, :len(r)] - alone).abs().max() < 1e-5, texts[i]
            assert not states[i, len(r):].any()  # the batch's padding comes back as zeros


def test_bins_hold_every_row_once_within_capacity():
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(3, 40, 57)]
    groups = packing.bins(lengths, 64)
    assert groups is not None
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= 64 for g in groups)
    assert len(groups) <= len(lengths) // 2


def test_batches_not_worth_packing_are_left_alone():
    assert packing.bins([70, 10, 10], 64) is None  # a row over the bin
    assert packing.bins([40, 40, 40, 10], 64) is None  # 3 bins for 4 rows: not half the rows
    assert packing.bins([12], 64) is None
    # 170 rows of 13: 43 bins of 52 tokens = 2,236, over the batch's own 2,210: only within a budget
    assert packing.bins([13] * 170, 64, budget=0) is None
    assert len(packing.bins([13] * 170, 64, budget=2300)) == 43


def test_only_bert_encoders_with_absolute_positions_are_packed():
    from transformers import BertConfig, BertModel, RobertaConfig, RobertaModel

    small = dict(vocab_size=99, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    assert runtimes.packable(BertModel(BertConfig(**small)))
    assert not runtimes.packable(BertModel(BertConfig(position_embedding_type="relative_key", **small)))
    assert not runtimes.packable(BertModel(BertConfig(is_decoder=True, **small)))
    assert not runtimes.packable(RobertaModel(RobertaConfig(**small)))


class _Infers:
    """An OpenVINO infer request that counts its calls."""

    def __init__(self, request) -> None:
        self.request, self.calls = request, 0

    def infer(self, *args, **kwargs):
        self.calls += 1
        return self.request.infer(*args, **kwargs)


def test_the_openvino_path_packs_on_a_4d_graph_and_runs_unpacked_batches_on_the_plain_one(encoder, sentences, tmp_path):
    fwd = load_forward("openvino-fp32", encoder.model, encoder.tokenizer, encoder.max_length, cache_dir=tmp_path)
    assert fwd.mask_4d
    # two graphs: the plain one (2D mask, no positions) for unpacked batches, a 4D one for packed
    assert "position_ids" not in fwd.names and "position_ids" in fwd.packed.names
    fwd.request, fwd.packed.request = plain_calls, packed_calls = _Infers(fwd.request), _Infers(fwd.packed.request)
    shapes = _Shapes(fwd)
    packed = _twin(encoder, shapes)
    plain = _twin(encoder, fwd, pack_tokens=0)
    from embedpool.poolers import Embedder

    a = Embedder(packed).embed(sentences, ["mean", "cls"])
    assert packed_calls.calls > 0
    before = packed_calls.calls, plain_calls.calls
    b = Embedder(plain).embed(sentences, ["mean", "cls"])
    assert packed_calls.calls == before[0] and plain_calls.calls > before[1]
    ref = Embedder(_twin(encoder, pack_tokens=0)).embed(sentences, ["mean"]).matrix("mean")
    for p in ("mean", "cls"):
        assert np.abs(a.matrix(p) - b.matrix(p)).max() < 1e-4
    assert np.abs(a.matrix("mean") - ref).max() < 1e-4
    assert sum(rows for (rows, _), _ in shapes.calls) <= len(sentences) // 2
    # a standard 2D call runs the plain graph
    ids = encoder.tokenizer(["one text", "and a longer second text"], padding=True, return_tensors="pt")
    before = packed_calls.calls
    two_d = fwd(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"],
                token_type_ids=torch.zeros_like(ids["input_ids"])).last_hidden_state
    assert packed_calls.calls == before
    with torch.inference_mode():
        want = encoder.model(**ids).last_hidden_state
    real = ids["attention_mask"].bool()
    assert (two_d[real] - want[real]).abs().max() < 1e-4
