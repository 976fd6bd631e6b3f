"""Every encoder family at parity with its reference library: tiny random-weight models of each
architecture and module stack (tests/family_models.py), saved through
sentence-transformers, loaded by embedpool from the folder as a user's would be. ``auto`` must
equal ``SentenceTransformer.encode_query`` / ``encode_document`` (prompts, Pooling modes and
their concatenation, Dense / LayerNorm / Normalize heads, Matryoshka ``truncate_dim``,
decoder-only last-token pooling), queries and documents, short and past the window, at the
dimension embedpool reports. The ColBERT (PyLate) family is in test_families_colbert.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedpool.errors import InvalidError
from embedpool.poolers import EmbedOptions, Embedder, FrozenEncoder, Plan
from embedpool.poolers.encoder import WINDOWED

from family_models import DOCUMENTS, FAMILIES, QUERIES, WINDOW, build, reference

TEXTS = {"query": QUERIES, "document": DOCUMENTS}


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row cosines; two zero rows (a text some random model maps to 0) count as equal."""
    na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
    both_zero = (na < 1e-12) & (nb < 1e-12)
    return np.where(both_zero, 1.0, (a * b).sum(-1) / np.maximum(na * nb, 1e-30))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Every family built once: name -> (folder, sentence-transformers reference, fp32 embedder)."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name, fam in FAMILIES.items():
        path = build(fam, root)
        enc = FrozenEncoder(str(path), precision="fp32", truncate_dim=fam.truncate_dim)
        out[name] = (path, reference(path, fam), Embedder(enc))
    return out


def test_texts_reach_past_the_window(models):
    """The parity below covers truncation: some documents are longer than every model's window."""
    for name, (_, ref, _) in models.items():
        lengths = [len(ids) for ids in ref.tokenizer(DOCUMENTS)["input_ids"]]
        assert max(lengths) > 2 * WINDOW, name
        assert ref.max_seq_length == WINDOW


@pytest.mark.parametrize("role", ["query", "document"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_auto_equals_sentence_transformers(models, name, role):
    _, ref, emb = models[name]
    texts = TEXTS[role]
    encode = ref.encode_query if role == "query" else ref.encode_document
    expected = encode(texts, convert_to_numpy=True, batch_size=3)
    got = emb.embed(texts, ["auto"], role=role, normalize=False).matrix("auto")
    assert got.shape == expected.shape, (name, got.shape, expected.shape)
    cos = cosines(got, expected)
    assert cos.min() >= 0.99999, (name, role, cos)
    # the dimension embedpool reports (/info, collections) is the one the vectors have
    assert emb.dim == emb.output_dim("auto") == expected.shape[1] == ref.get_embedding_dimension()
    if not FAMILIES[name].normalize:  # no Normalize module: not only the direction, the values
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_auto_names_the_models_own_pooling(models):
    expected = {"bert-dense": "mean", "bert-concat": "pooling:mode=mean+max", "bert-cls-prompt": "pooling:mode=cls",
                "distilbert": "pooling:mode=mean_sqrt_len_tokens", "mpnet": "mean", "roberta": "mean",
                "modernbert": "cls", "qwen3": "pooling:mode=lasttoken", "llama": "pooling:mode=weightedmean"}
    assert {n: m[2].canonical("auto") for n, m in models.items()} == expected


def test_single_vector_poolers_go_through_the_head(models):
    """`mean` on a model with a Dense head: the model's Dense of the mean (its space, its size);
    `mean:model_head=false` the raw mean; the reported dimension follows."""
    _, ref, emb = models["bert-dense"]
    st_tokens = ref.encode_document(DOCUMENTS, output_value="token_embeddings", convert_to_tensor=False)
    raw = emb.embed(DOCUMENTS, ["mean:model_head=false"], normalize=False).matrix("mean:model_head=false")
    means = np.stack([t.float().mean(0).numpy() for t in st_tokens])
    assert raw.shape == (len(DOCUMENTS), 32) and emb.output_dim("mean:model_head=false") == 32
    assert cosines(raw, means).min() >= 0.99999
    dense = ref[2]  # Transformer, Pooling, Dense, Normalize
    with torch.no_grad():
        projected = dense({"sentence_embedding": torch.from_numpy(means)})["sentence_embedding"].numpy()
    for spec in ("mean", "max", "cls", "mean:per_window=true"):
        assert emb.output_dim(spec) == 16, spec
    headed = emb.embed(DOCUMENTS, ["mean"], normalize=False).matrix("mean")
    assert headed.shape == (len(DOCUMENTS), 16) and cosines(headed, projected).min() >= 0.99999
    per_window = emb.embed(DOCUMENTS, ["mean:per_window=true"]).vectors["mean:per_window=true"]
    assert all(v.shape[1] == 16 for v in per_window) and max(len(v) for v in per_window) > 1
    # token vectors stay in the transformer's space: a sentence head is not trained on tokens
    assert emb.output_dim("tokens") == 32
    assert emb.embed(["a b"], ["tokens"]).vectors["tokens"][0].shape[1] == 32


def test_a_single_mode_of_a_concatenating_model_skips_its_head(models):
    """The head of a mean+max model takes 64-d vectors: `mean` (32-d) cannot go through it, and
    reports the 32 it gives; the model's own concatenation does."""
    _, _, emb = models["bert-concat"]
    assert emb.output_dim("mean") == 32 and emb.output_dim("auto") == 24
    assert emb.embed(["a b c"], ["mean"]).matrix("mean").shape == (1, 32)


def test_matryoshka_dimensions_apply_after_the_head(models):
    _, ref, emb = models["bert-dense"]
    full = ref.encode_document(DOCUMENTS, convert_to_numpy=True)
    got = emb.embed(DOCUMENTS, ["auto"], dimensions=8).matrix("auto")
    assert got.shape == (len(DOCUMENTS), 8)
    assert cosines(got, full[:, :8]).min() >= 0.99999
    with pytest.raises(InvalidError, match="between 1 and the model's 16"):
        emb.embed(["x"], ["auto"], dimensions=17)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_pooler_works_or_refuses_with_a_reason(models, name):
    """Each pooler on each architecture: a vector per text of the size reported, windows and
    landmarks built from the model's own special tokens; or a refusal that says why."""
    _, ref, emb = models[name]
    enc = emb.encoder
    causal = enc.causal
    specs = ["mean", "max", "cls", "landmark:g=8", "tokens", "tokens:window=true", "cluster:window=true",
             "mean:per_window=true", "layermean", "pooling:mode=lasttoken", "fde:dim_proj=8"]
    for spec in specs:
        if causal and spec.split(":")[0] in ("cls", "landmark"):
            with pytest.raises(InvalidError, match="decoder-only"):
                emb.embed(DOCUMENTS, [spec])
            continue
        out = emb.embed(DOCUMENTS, [spec], role="document")
        vecs = out.vectors[spec]
        assert len(vecs) == len(DOCUMENTS), spec
        for v in vecs:
            assert v.shape[-1] == emb.output_dim(spec), (name, spec, v.shape)
            assert np.isfinite(v).all(), (name, spec)
    # windows and landmarks: between the model's own special tokens, never assumed [CLS]/[SEP]
    template = enc.template
    long_doc = DOCUMENTS[3]
    windows = enc.windows([long_doc], WINDOWED)[0]
    assert len(windows) > 1
    for w in windows:
        assert tuple(w.ids[:len(template.prefix)]) == template.prefix
        assert tuple(w.ids[len(w.ids) - len(template.suffix):]) == template.suffix
        assert len(w.ids) <= enc.max_length
    plain = ref.tokenizer(long_doc, add_special_tokens=False)["input_ids"]
    assert [t for w in windows for t, s in zip(w.ids, w.special) if not s] == plain
    if not causal:  # LMK: the model's separator after every chunk of g tokens
        for w in enc.windows([long_doc], Plan("landmark", 8))[0]:
            assert tuple(w.ids[:len(template.prefix)]) == template.prefix
            marks = [t for t, m in zip(w.ids, w.landmark) if m]
            assert marks and set(marks) == {template.separator} and w.ids[-1] == template.separator


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_auto_precision_path_within_the_bar(models, name):
    """``--precision auto`` builds its fast path on every architecture (or falls back to fp32 and
    says why): ``auto`` through it stays within cos 0.999 of sentence-transformers fp32."""
    path, ref, _ = models[name]
    enc = FrozenEncoder(str(path), precision="auto", truncate_dim=FAMILIES[name].truncate_dim)
    assert enc.precision_reason
    if enc.requested_precision == "auto" and enc.precision == "fp32":
        assert "failed to build" in enc.precision_reason or "fp32" in enc.precision_reason
    emb = Embedder(enc)
    for role, texts in TEXTS.items():
        encode = ref.encode_query if role == "query" else ref.encode_document
        expected = encode(texts, convert_to_numpy=True)
        got = emb.embed(texts, ["auto"], role=role, normalize=False).matrix("auto")
        assert got.shape == expected.shape
        assert cosines(got, expected).min() >= 0.999, (name, role, enc.precision)


@pytest.mark.parametrize("role", ["query", "document"])
def test_the_servers_work_bound_holds_on_every_family(models, role):
    """A server checks a short request's limits on ``work_bound`` instead of tokenizing it: the
    bound must hold for every family's own tokenization -- prompts (bert-cls-prompt, qwen3), a
    decoder's end-of-text token (qwen3, llama), byte-level BPE -- on texts past the window,
    empty and short, in both roles."""
    texts = [*DOCUMENTS, *QUERIES]
    for name, (_, _, emb) in models.items():
        bound = emb.work_bound(len(texts), ["auto"], EmbedOptions(role=role))
        work = emb.measure(texts, ["auto"], role=role)
        assert bound is not None, name
        assert max(work.tokens) > 0 and sum(work.tokens) <= bound[0] and work.vectors <= bound[1], (name, bound)
