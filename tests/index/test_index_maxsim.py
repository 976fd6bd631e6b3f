"""MaxSim kernel and quantization against a naive per-document reference."""

import numpy as np
import pytest

from embedpool.errors import InvalidError
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


# ---------------------------------------------------------------------------- the kernels
# Every kernel against the naive reference (float64, on the stored values: dequantized int8 codes
# or float16 values), for int8 and float16 codes, full scans and candidate subsets, documents
# larger than a chunk, and chunks on worker threads.

from embedpool.index import kernels  # noqa: E402

# ONNX Runtime is a core dependency (pyproject.toml): every kernel runs here, and a missing
# onnxruntime fails these tests instead of shrinking the lists
FLOAT_KERNELS = ["numpy", "mlas-f32"]
INT8_KERNELS = ["mlas-int8x3", "mlas-int8"]

ZEN1_FLAGS = ("fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2 sha_ni").split()
CASCADE_LAKE_FLAGS = ZEN1_FLAGS + "avx512f avx512dq avx512bw avx512vl avx512cd avx512_vnni".split()
SAPPHIRE_RAPIDS_FLAGS = CASCADE_LAKE_FLAGS + "avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8".split()
ALDER_LAKE_FLAGS = ZEN1_FLAGS + ["avx_vnni"]


def _stored(codes, scales):
    """The values a kernel must score: what the codes stand for, in float64."""
    return dequantize(codes, scales).astype(np.float64) if scales is not None else codes.astype(np.float64)


def _naive(queries, stored, offs, doc_idx=None):
    """MaxSim per (query, document) pair, one float64 product at a time: the obvious way."""
    docs = [stored[offs[j]:offs[j + 1]] for j in (range(len(offs) - 1) if doc_idx is None else doc_idx)]
    return np.array([[(np.asarray(q, np.float64) @ d.T).max(axis=1).sum() for d in docs] for q in queries])


def _query_rounding_bound(queries, stored, offs, doc_idx=None):
    """How far int8 query codes may move a score: per query token the int8 step is
    ``s = max|q| / 127``, each component moves by at most ``s / 2``, so each dot product with a
    document token moves by at most ``s / 2 * ||d||_1`` and the MaxSim by the sum over query tokens
    of that for the document's largest ``||d||_1``."""
    l1 = np.abs(stored).sum(axis=1)
    idx = range(len(offs) - 1) if doc_idx is None else doc_idx
    d_l1 = np.array([l1[offs[j]:offs[j + 1]].max() for j in idx])
    return np.array([(np.abs(q).max(axis=1) / 127 / 2).sum() * d_l1 for q in queries])


def _check(kernel, queries, codes, offs, scales, doc_idx=None, chunk_bytes=1 << 20):
    got = maxsim_scores(queries, codes, offs, scales, doc_idx=doc_idx, chunk_bytes=chunk_bytes, kernel=kernel)
    stored = _stored(codes, scales)
    want = _naive(queries, stored, offs, doc_idx)
    assert got.shape == want.shape and got.dtype == np.float32
    if kernel == "mlas-int8":  # the query in int8 codes: within the query's int8 rounding
        tol = _query_rounding_bound(queries, stored, offs, doc_idx) + 1e-5
        assert (np.abs(got - want) <= tol).all(), np.abs(got - want).max()
        # and the bound is not vacuous: it is a small fraction of the scores' spread
        assert tol.max() < 0.05 * (want.max() - want.min())
    else:  # float32 query math (three int8 query codes are within float32 rounding of it)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    return got


KERNEL_PRECISIONS = [(k, p) for k in FLOAT_KERNELS for p in ("int8", "float16")] + [(k, "int8") for k in INT8_KERNELS]


@pytest.mark.parametrize("kernel, precision", KERNEL_PRECISIONS)
@pytest.mark.parametrize("chunk_bytes", [64 * 1024 * 1024, 3_000])
def test_kernel_equals_naive_on_random_vectors(rng, kernel, precision, chunk_bytes):
    dim = 48
    docs = rand_docs(rng, 80, dim, lo=1, hi=40) + [rand_unit(rng, 300, dim)]  # the last > a chunk
    vecs, offs = _pack(docs)
    codes, scales = quantize(vecs, precision)
    queries = rand_docs(rng, 5, dim, lo=1, hi=33)
    full = _check(kernel, queries, codes, offs, scales, chunk_bytes=chunk_bytes)
    idx = np.array([80, 3, 17, 0, 3, 42, 79])  # candidates: any order, repeats, the big document
    sub = _check(kernel, queries, codes, offs, scales, doc_idx=idx, chunk_bytes=chunk_bytes)
    np.testing.assert_allclose(sub, full[:, idx], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel", FLOAT_KERNELS + INT8_KERNELS)
def test_kernel_handles_query_token_counts_and_zero_tokens(rng, kernel):
    dim = 24
    docs = rand_docs(rng, 30, dim, lo=1, hi=12)
    docs[4] = np.zeros((3, dim), np.float32)  # a document of zero vectors (scale 1, codes 0)
    vecs, offs = _pack(docs)
    codes, scales = quantize(vecs, "int8")
    for m in (1, 2, 31, 64):  # fewer and more query tokens than dimensions
        q = rand_unit(rng, m, dim)
        q[0] = 0.0  # a zero query token
        _check(kernel, [q, rand_unit(rng, 3, dim)], codes, offs, scales, chunk_bytes=2_000)


@pytest.fixture(scope="module")
def real_tokens(embedder, scifact_docs):
    """MiniLM token vectors of 24 SciFact abstracts (documents) and of 8 questions (queries)."""
    docs = embedder.embed(scifact_docs[:24], ["tokens"], role="document").vectors["tokens"]
    questions = ["What causes antibiotic resistance in bacteria?", "Does vitamin D reduce fracture risk?",
                 "How do T cells recognize antigens?", "Is obesity linked to type 2 diabetes?",
                 "What is the role of microRNA in cancer?", "Effects of smoking on lung function",
                 "Which genes control circadian rhythm?", "Do statins lower cardiovascular mortality?"]
    queries = embedder.embed(questions, ["tokens"], role="query").vectors["tokens"]
    return [np.asarray(d, np.float32) for d in docs], [np.asarray(q, np.float32) for q in queries]


@pytest.mark.parametrize("kernel, precision", KERNEL_PRECISIONS)
def test_kernel_equals_naive_on_real_token_vectors(real_tokens, kernel, precision):
    docs, queries = real_tokens
    vecs, offs = _pack(docs)
    codes, scales = quantize(vecs, precision)
    assert max(len(d) for d in docs) * vecs.shape[1] > 20_000  # some documents exceed a chunk's bound
    full = _check(kernel, queries, codes, offs, scales, chunk_bytes=20_000)
    idx = np.array([23, 5, 0, 12, 5, 17])
    _check(kernel, queries, codes, offs, scales, doc_idx=idx, chunk_bytes=20_000)
    # rankings of the stored codes stay those of float32 MaxSim on the unquantized vectors
    s32 = maxsim_scores(queries, vecs, offs, kernel="numpy")
    assert (full.argmax(1) == s32.argmax(1)).all()


def test_auto_kernel_is_the_choice_for_this_cpu(rng):
    flags, capability = kernels.cpu_features()
    assert flags == kernels.read_flags()
    for precision in ("float32", "float16", "int8"):
        want = kernels.choose(precision, flags, capability, onnxruntime=True)[0]
        assert kernels.resolve("auto", precision) == want
    docs = rand_docs(rng, 10, 16)
    vecs, offs = _pack(docs)
    codes, scales = quantize(vecs, "int8")
    q = [rand_unit(rng, 4, 16)]
    want = maxsim_scores(q, codes, offs, scales, kernel=kernels.resolve("auto", "int8"))
    np.testing.assert_array_equal(maxsim_scores(q, codes, offs, scales), want)


@pytest.mark.parametrize("flags, capability, int8, floats", [
    (ZEN1_FLAGS, "AVX2", "mlas-f32", "mlas-f32"),  # this machine: no int8 unit beats its FMAs
    (CASCADE_LAKE_FLAGS, "AVX512", "mlas-f32", "mlas-f32"),  # VNNI alone does not pay for 3 codes
    (SAPPHIRE_RAPIDS_FLAGS, "AVX512", "mlas-int8x3", "mlas-f32"),
    (ALDER_LAKE_FLAGS, "AVX2", "mlas-f32", "mlas-f32"),
    ("fpu sse sse2 ssse3 sse4_1 sse4_2 avx".split(), "DEFAULT", "numpy", "numpy"),  # no AVX2
    ((), "AVX2", "mlas-f32", "mlas-f32"),  # flags unreadable: torch's capability decides
    ((), "DEFAULT", "numpy", "numpy"),
    ("fp asimd asimddp".split(), "unknown", "numpy", "numpy"),  # an ARM CPU's Features
])
def test_kernel_choice_per_cpu(flags, capability, int8, floats):
    assert kernels.choose("int8", flags, capability)[0] == int8
    for precision in ("float16", "float32"):
        assert kernels.choose(precision, flags, capability)[0] == floats
    for precision in ("int8", "float16", "float32"):  # without ONNX Runtime: the portable path
        kernel, reason = kernels.choose(precision, flags, capability, onnxruntime=False)
        assert kernel == "numpy" and "not installed" in reason


def test_int8_units_follow_mlas_requirements():
    assert kernels.int8_units(ZEN1_FLAGS) is None
    assert kernels.int8_units(CASCADE_LAKE_FLAGS) == "avx512_vnni"
    assert kernels.int8_units(SAPPHIRE_RAPIDS_FLAGS) == "amx"
    assert kernels.int8_units(ALDER_LAKE_FLAGS) == "avx_vnni"
    # VNNI without AVX-512 BW/DQ/VL is not MLAS' VNNI kernel
    assert kernels.int8_units(ZEN1_FLAGS + ["avx512f", "avx512_vnni"]) is None


def test_signed_int8_products_are_exact_only_where_the_flags_say_so():
    """MLAS' u8s8 kernel saturates int16 pair sums without VNNI/AMX: the flags' reading must agree
    with what the library does on this CPU (the int8 kernels fall back to exact u8u8 otherwise)."""
    from embedpool.index.kernels import _signed_query_is_exact

    assert _signed_query_is_exact() == (kernels.int8_units(kernels.read_flags()) is not None)


def test_read_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_int8\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert kernels.read_flags(info) == frozenset({"fpu", "avx2", "avx512f", "amx_int8"})
    assert kernels.read_flags(tmp_path / "missing") == frozenset()


def test_unknown_or_mismatched_kernel_is_refused(rng):
    vecs, offs = _pack(rand_docs(rng, 3, 8))
    with pytest.raises(InvalidError, match="unknown MaxSim kernel"):
        maxsim_scores([vecs[:2]], vecs, offs, kernel="fast")
    with pytest.raises(InvalidError, match="scores int8 codes"):
        maxsim_scores([vecs[:2]], vecs.astype(np.float16), offs, kernel="mlas-int8")
