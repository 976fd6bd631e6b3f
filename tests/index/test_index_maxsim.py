"""MaxSim kernel and quantization against a naive per-document reference."""

import numpy as np
import pytest

from embedpool.index.maxsim import dequantize, gather_docs, maxsim_scores, quantize
from index_testutil import naive_maxsim, rand_docs, rand_unit, unit


def _pack(docs):
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([len(d) for d in docs], out=offsets[1:])
    return np.concatenate(docs), offsets


@pytest.mark.parametrize("chunk_bytes", [64 * 1024 * 1024, 2_000])
def test_maxsim_equals_naive_reference(rng, chunk_bytes):
    dim = 24
    docs = rand_docs(rng, 60, dim, lo=1, hi=30)
    queries = rand_docs(rng, 7, dim, lo=1, hi=9)
    vecs, offs = _pack(docs)
    got = maxsim_scores(queries, vecs, offs, chunk_bytes=chunk_bytes)
    want = np.array([[naive_maxsim(q, d) for d in docs] for q in queries])
    assert got.shape == (7, 60)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_maxsim_document_larger_than_chunk(rng):
    docs = [rand_unit(rng, 500, 16), rand_unit(rng, 1, 16), rand_unit(rng, 3, 16)]
    q = [rand_unit(rng, 4, 16)]
    vecs, offs = _pack(docs)
    got = maxsim_scores(q, vecs, offs, chunk_bytes=100)
    np.testing.assert_allclose(got[0], [naive_maxsim(q[0], d) for d in docs], rtol=1e-5, atol=1e-5)


def test_gather_docs_selects_rows(rng):
    docs = rand_docs(rng, 10, 8)
    vecs, offs = _pack(docs)
    sub, sub_off, _ = gather_docs(vecs, offs, None, np.array([7, 2, 9]))
    for j, d in enumerate([7, 2, 9]):
        np.testing.assert_array_equal(sub[sub_off[j]:sub_off[j + 1]], docs[d])


@pytest.mark.parametrize("precision", ["float16", "int8"])
def test_quantized_maxsim_ranking_close_to_float32(rng, precision):
    dim, n_docs, n_q = 64, 400, 40
    docs = rand_docs(rng, n_docs, dim, lo=5, hi=40)
    # queries: noisy copies of some tokens of random documents, so rankings are meaningful
    queries = []
    for _ in range(n_q):
        d = docs[int(rng.integers(n_docs))]
        take = d[rng.integers(0, len(d), size=6)]
        queries.append(unit(take + 0.6 * rng.standard_normal(take.shape).astype(np.float32) / np.sqrt(dim)))
    vecs, offs = _pack(docs)
    s32 = maxsim_scores(queries, vecs, offs)
    codes, scales = quantize(vecs, precision)
    assert codes.dtype == np.dtype(precision)
    sq = maxsim_scores(queries, codes, offs, scales)
    # score error stays small relative to the number of query tokens
    assert np.abs(sq - s32).max() < (0.01 if precision == "float16" else 0.05)
    top1_same = np.mean(sq.argmax(1) == s32.argmax(1))
    top10 = np.mean([len(set(np.argsort(-a)[:10]) & set(np.argsort(-b)[:10])) / 10
                     for a, b in zip(sq, s32)])
    assert top1_same == 1.0
    assert top10 >= (0.99 if precision == "float16" else 0.9)
    # dequantize inverts quantize within the quantization step
    err = np.abs(dequantize(codes, scales) - vecs).max()
    assert err < (1e-3 if precision == "float16" else np.abs(vecs).max() / 127)


def test_int8_uses_the_full_code_range(rng):
    x = rand_unit(rng, 50, 32)
    codes, scales = quantize(x, "int8")
    assert np.abs(codes.astype(int)).max(axis=1).min() == 127
    np.testing.assert_allclose(scales, np.abs(x).max(axis=1) / 127, rtol=1e-6)


@pytest.mark.parametrize("precision", ["float32", "int8"])
def test_maxsim_on_candidate_subset_matches_full(rng, precision):
    docs = rand_docs(rng, 50, 12, lo=1, hi=25)
    vecs, offs = _pack(docs)
    codes, scales = quantize(vecs, precision)
    q = rand_docs(rng, 3, 12, lo=1, hi=5)
    full = maxsim_scores(q, codes, offs, scales)
    idx = np.array([49, 3, 17, 0, 3, 22])
    for chunk in (64 * 1024 * 1024, 1_000):
        np.testing.assert_allclose(maxsim_scores(q, codes, offs, scales, doc_idx=idx, chunk_bytes=chunk),
                                   full[:, idx], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_query_tokens", [2, 40])  # fewer / more query tokens than dimensions
def test_int8_maxsim_equals_naive_on_dequantized(rng, n_query_tokens):
    dim = 16
    docs = rand_docs(rng, 20, dim, lo=1, hi=10)
    vecs, offs = _pack(docs)
    codes, scales = quantize(vecs, "int8")
    deq = dequantize(codes, scales)
    q = [rand_unit(rng, n_query_tokens, dim)]
    want = [naive_maxsim(q[0], deq[offs[j]:offs[j + 1]]) for j in range(20)]
    np.testing.assert_allclose(maxsim_scores(q, codes, offs, scales)[0], want, rtol=1e-5, atol=1e-5)
