"""MaxSim kernel and quantization against a naive per-document reference."""

import numpy as np
import pytest

from embedpool.cpu import cpu_features
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

from embedpool.index import amxscan, kernels  # noqa: E402

# ONNX Runtime is a core dependency (pyproject.toml): every kernel runs here, and a missing
# onnxruntime fails these tests instead of shrinking the lists
FLOAT_KERNELS = ["numpy", "mlas-f32"]
# the fused AMX / AVX-512 VNNI / AVX2 kernels where they run (the CPU's unit, the compiled module)
FUSED_UNITS = amxscan.runnable_units()
INT8_KERNELS = ["mlas-int8x3", "mlas-int8"] + [k for k, u in kernels.FUSED_KERNELS.items() if u in FUSED_UNITS]

ZEN1_FLAGS = ("fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2 sha_ni").split()
CASCADE_LAKE_FLAGS = ZEN1_FLAGS + "avx512f avx512dq avx512bw avx512vl avx512cd avx512_vnni".split()
SAPPHIRE_RAPIDS_FLAGS = CASCADE_LAKE_FLAGS + "avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8".split()
ALDER_LAKE_FLAGS = ZEN1_FLAGS + ["avx_vnni"]
NO_AVX2_FLAGS = ("fpu sse sse2 ssse3 sse4_1 sse4_2 avx").split()  # Sandy/Ivy Bridge: no AVX2, no FMA


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
    flags, capability = cpu_features().flags, cpu_features().capability
    amx = kernels.int8_units(flags) == "amx" and amxscan.available()
    vnni = not amx and amxscan.available(unit="vnni")
    for precision in ("float32", "float16", "int8"):
        want = kernels.choose(precision, flags, capability, onnxruntime=True, amx_kernel=amx, vnni_kernel=vnni)[0]
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
    # the fused AMX kernel on AMX CPUs where it is built; nothing else changes
    amx = "amx-int8x3" if flags is SAPPHIRE_RAPIDS_FLAGS else int8
    assert kernels.choose("int8", flags, capability, amx_kernel=True)[0] == amx
    # the fused VNNI kernel on AVX-512 VNNI CPUs where it is built (AMX CPUs have it too), the
    # AMX one first; AVX-VNNI (256-bit) and CPUs without VNNI keep theirs
    vnni = "vnni-int8x3" if flags in (CASCADE_LAKE_FLAGS, SAPPHIRE_RAPIDS_FLAGS) else int8
    assert kernels.choose("int8", flags, capability, vnni_kernel=True)[0] == vnni
    assert kernels.choose("int8", flags, capability, amx_kernel=True, vnni_kernel=True)[0] == \
        (amx if amx == "amx-int8x3" else vnni)
    for precision in ("float16", "float32"):
        assert kernels.choose(precision, flags, capability, amx_kernel=True, vnni_kernel=True)[0] == floats
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

    assert _signed_query_is_exact() == (kernels.int8_units(cpu_features().flags) is not None)


def test_unknown_or_mismatched_kernel_is_refused(rng):
    vecs, offs = _pack(rand_docs(rng, 3, 8))
    with pytest.raises(InvalidError, match="unknown MaxSim kernel"):
        maxsim_scores([vecs[:2]], vecs, offs, kernel="fast")
    with pytest.raises(InvalidError, match="scores int8 codes"):
        maxsim_scores([vecs[:2]], vecs.astype(np.float16), offs, kernel="mlas-int8")


# ---------------------------------------------------------------------------- exact top k (int8scan)
# maxsim_topk must return exactly the top k of naive MaxSim on the stored values: the same
# documents (ties by position) and their scores. The int8 scan is forced (scan="int8") whatever
# this CPU has, so it runs here (VNNI or not: torch._int_mm is exact, checked below) and the
# portable path (scan="exact") against the same reference.

from embedpool.index import int8scan  # noqa: E402

SCANS = FUSED_UNITS + (["int8"] if int8scan.int8_matmul_is_exact() else []) + ["exact"]
ENGINES = FUSED_UNITS + (["torch"] if int8scan.int8_matmul_is_exact() else [])


def _naive_topk(queries, stored, offs, k, doc_idx=None, live=None, gap=1e-4):
    """The top k of _naive's float64 scores (ties by position), those scores, and which of them
    are ``clear``: further than ``gap`` from every other document's score (closer ones may swap
    by float32 rounding alone)."""
    full = _naive(queries, stored, offs, doc_idx)
    pos = np.arange(full.shape[1]) if live is None else np.flatnonzero(live)
    out = []
    for row in full:
        o = pos[np.argsort(-row[pos], kind="stable")]
        ws = row[o]
        clear = (np.abs(np.diff(ws, prepend=np.inf)) > gap) & (np.abs(np.diff(ws, append=-np.inf)) > gap)
        out.append((ws[:k], o[:k], clear[:k]))
    return out


def _check_topk(queries, codes, offs, scales, k, scan, doc_idx=None, live=None, chunk_bytes=1 << 20, gap=1e-4):
    """maxsim_topk against the naive reference: equal scores (float32 rounding) and the same
    documents wherever the reference's scores are further apart than ``gap`` (closer ones
    may swap by float32 rounding alone: the exact kernel's rounding depends on a row's place in
    its block); and the exact kernel's own scores of the top k."""
    stats = {}
    got = int8scan.maxsim_topk(queries, codes, offs, scales, k, doc_idx=doc_idx, live=live, scan=scan,
                               chunk_bytes=chunk_bytes, stats=stats)
    assert stats["scan"] == scan
    want = _naive_topk(queries, _stored(codes, scales), offs, k, doc_idx, live, gap)
    full = maxsim_scores(queries, codes, offs, scales, doc_idx=doc_idx, kernel="numpy")
    for (gs, gp), (ws, wp, clear), row in zip(got, want, full):
        assert gs.dtype == np.float32 and len(gp) == len(wp)
        np.testing.assert_allclose(gs, ws, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(gp[clear], wp[clear])
        pos = np.arange(len(row)) if live is None else np.flatnonzero(live)
        exact_order = pos[np.argsort(-row[pos], kind="stable")[:k]]
        np.testing.assert_allclose(row[gp], row[exact_order], rtol=1e-6, atol=1e-6)
    return got, stats


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("second_scan", [False, True])
@pytest.mark.parametrize("seed", [False, True])
def test_topk_equals_naive_on_random_vectors(rng, monkeypatch, scan, second_scan, seed):
    monkeypatch.setattr(int8scan, "MIN_SCAN_TOKENS", 0 if second_scan else 10 ** 9)
    monkeypatch.setattr(int8scan, "SEED_FACTOR", 0 if seed else 10 ** 9)  # k exact scores first, or not
    dim = 48
    docs = rand_docs(rng, 150, dim, lo=1, hi=40) + [rand_unit(rng, 300, dim)]  # the last > a chunk
    docs = [d * rng.uniform(0.5, 3.0) for d in docs]  # token norms other than 1: N_D matters
    vecs, offs = _pack(docs)
    codes, scales = quantize(vecs, "int8")
    queries = rand_docs(rng, 4, dim, lo=1, hi=33)
    for k in (1, 7, 151, 400):  # k above the number of documents: all of them, ordered
        _check_topk(queries, codes, offs, scales, k, scan, chunk_bytes=3_000)
    idx = np.array([150, 3, 17, 0, 42, 79, 120, 5])  # a candidate subset, any order
    _check_topk(queries, codes, offs, scales, 3, scan, doc_idx=idx, chunk_bytes=3_000)
    live = rng.random(151) < 0.7
    _check_topk(queries, codes, offs, scales, 10, scan, live=live, chunk_bytes=3_000)
    _check_topk(queries, codes, offs, scales, 2, scan, doc_idx=idx, live=rng.random(len(idx)) < 0.5)


def _adversarial(rng, dim=64, norm=3.0):
    """A one-token query and one-token documents on which the int8 scan's error reaches its
    bound: with ``r`` the query's int8 rounding residual and ``w`` the unit direction of ``q``
    orthogonal to it, documents ``norm * (x w +- 0.9 r/||r||)`` score ``p = exact -+ 0.9 ||r||
    norm`` in the scan (the bound is ``||r|| norm``). The ``-`` documents ("X") are placed 1.4
    ||r|| norm above the ``+`` ones ("Y") in the scan, so the Y documents are exactly 0.4
    ||r|| norm better: near-ties inside the bound, in the reverse order. Plus exact duplicates
    (ties) and documents far below."""
    q = rand_unit(rng, 1, dim).astype(np.float64)
    codes_q, a, r_norm, _ = int8scan.quantized_queries(q.astype(np.float32))
    r = q[0] - float(a[0]) * codes_q[0]
    r_hat = r / np.linalg.norm(r)
    w = q[0] - (q[0] @ r_hat) * r_hat
    w /= np.linalg.norm(w)
    cw, cr, rn = q[0] @ w, q[0] @ r_hat, float(r_norm[0])
    x_y = 0.2
    x_x = x_y + 1.4 * rn / cw + 1.8 * (cr - rn) / cw  # the scan puts X 1.4 ||r|| above Y
    docs = [x_x + rng.uniform(-0.05, 0.05) * rn / cw for _ in range(12)]  # X
    signs = [-0.9] * 12
    docs += [x_y + rng.uniform(-0.05, 0.05) * rn / cw for _ in range(12)]  # Y
    signs += [0.9] * 12
    vecs = np.array([norm * (x * w + sg * r_hat) for x, sg in zip(docs, signs)])
    order = rng.permutation(24)  # X and Y interleaved in position
    vecs, is_y = vecs[order], order >= 12
    vecs = np.concatenate([vecs, vecs[[3, 15, 3]], -vecs[:10]])  # ties; far below
    is_y = np.concatenate([is_y, is_y[[3, 15, 3]], np.zeros(10, bool)])
    codes, scales = quantize(vecs.astype(np.float32), "int8")
    offs = np.arange(len(codes) + 1, dtype=np.int64)
    return [q.astype(np.float32)], codes, offs, scales, is_y


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("second_scan", [False, True])
@pytest.mark.parametrize("seed", [False, True])
def test_topk_exact_on_near_ties_around_the_bound(rng, monkeypatch, scan, second_scan, seed):
    monkeypatch.setattr(int8scan, "MIN_SCAN_TOKENS", 0 if second_scan else 10 ** 9)
    monkeypatch.setattr(int8scan, "SEED_FACTOR", 0 if seed else 10 ** 9)
    queries, codes, offs, scales, is_y = _adversarial(rng)
    norms = int8scan.doc_norms(codes, offs, scales)
    p, b = int8scan.bound_scan(queries, codes, offs, scales, norms)
    exact = _naive(queries, _stored(codes, scales), offs)[0]
    # the case is adversarial: the bound holds and is nearly reached (errors > 80% of it); the
    # scan ranks all X above all Y, exactly every Y is above every X, by less than the bound
    err = exact - p[0]
    assert (np.abs(err) <= b[0]).all() and (np.abs(err[:24]) > 0.8 * b[0, :24]).all()
    xy = slice(0, 27)  # the X and Y documents and their duplicates
    assert p[0, xy][~is_y[xy]].min() > p[0, xy][is_y[xy]].max() + b[0, 0]
    assert exact[xy][is_y[xy]].min() > exact[xy][~is_y[xy]].max()
    assert exact[:24].max() - exact[:24].min() < 2 * b[0, 0]
    for k in (1, 5, 12, 20):
        got, stats = _check_topk(queries, codes, offs, scales, k, scan, gap=1e-6)
        assert is_y[got[0][1][:min(k, 12)]].all()  # the Y documents first, as exact MaxSim says
        if scan != "exact":
            assert stats["rescored"][0] < len(norms)  # the bound ruled some documents out
    # ties: the duplicates of the documents at positions 3 and 15 are returned next to them, with
    # their score (within float32 rounding: the exact kernel rounds by a row's place in a block)
    (gs, gp), = int8scan.maxsim_topk(queries, codes, offs, scales, 24 + 3, scan=scan)
    pos = list(gp)
    for orig, dup in ((3, 24), (15, 25), (3, 26)):
        assert abs(pos.index(orig) - pos.index(dup)) <= 2
        np.testing.assert_allclose(gs[pos.index(orig)], gs[pos.index(dup)], rtol=1e-6)


@pytest.mark.parametrize("scan", [s for s in SCANS if s != "exact"])
def test_k_exact_scores_rule_out_more_near_ties(rng, monkeypatch, scan):
    """Documents around a common direction, every score within a few bounds of the others: the
    k best by scan score scored exactly first leave less than 0.6x the documents the lower bounds
    alone leave (the threshold rises by about one bound), and the top k is still exact MaxSim's."""
    monkeypatch.setattr(int8scan, "MIN_SCAN_TOKENS", 10 ** 9)  # the first scan's survivors are scored
    dim = 64
    mu = rand_unit(rng, 1, dim)[0]
    docs = [unit(rand_unit(rng, int(rng.integers(5, 20)), dim) * 0.3 + mu) for _ in range(600)]
    vecs, offs = _pack(docs)
    codes, scales = quantize(vecs.astype(np.float32), "int8")
    queries = rand_docs(rng, 3, dim, lo=8, hi=16)
    for k in (1, 5, 10):
        kept = {}
        for seed in (False, True):
            monkeypatch.setattr(int8scan, "SEED_FACTOR", 0 if seed else 10 ** 9)
            _, stats = _check_topk(queries, codes, offs, scales, k, scan, gap=1e-6)
            kept[seed] = np.array(stats["rescored"])
        assert (kept[False] > 4 * k).all()  # near-ties: the lower bounds leave many
        assert (kept[True] < 0.6 * kept[False]).all() and (kept[True] >= k).all()


@pytest.mark.skipif(not ENGINES, reason="neither torch's int8 matmul nor a fused scan runs here")
@pytest.mark.parametrize("engine", ENGINES)
def test_bound_holds_and_is_tight_enough(rng, engine):
    """|exact - scan| <= B for every (query, document), B shrinks 254x with each further code of
    the residual, and B is not vacuous (a small share of the scores' spread)."""
    dim = 64
    docs = [d * rng.uniform(0.2, 4.0) for d in rand_docs(rng, 200, dim, lo=1, hi=20)]
    vecs, offs = _pack(docs)
    codes, scales = quantize(vecs, "int8")
    queries = rand_docs(rng, 5, dim, lo=1, hi=16)
    norms = int8scan.doc_norms(codes, offs, scales)
    exact = _naive(queries, _stored(codes, scales), offs)
    p1, b1 = int8scan.bound_scan(queries, codes, offs, scales, norms, chunk_bytes=2_000, engine=engine)
    p2, b2 = int8scan.bound_scan(queries, codes, offs, scales, norms, chunk_bytes=2_000, n_codes=2, engine=engine)
    p3, b3 = int8scan.bound_scan(queries, codes, offs, scales, norms, chunk_bytes=2_000, n_codes=3, engine=engine)
    assert (np.abs(exact - p1) <= b1).all() and (np.abs(exact - p2) <= b2).all()
    assert (np.abs(exact - p3) <= b3).all()
    assert (b2 < b1 / 100).all() and (b3 < b2 / 2).all()  # b3: float32 rounding (rho) dominates
    assert (b1.max(axis=1) < 0.2 * (exact.max(axis=1) - exact.min(axis=1))).all()
    # N_D is each document's largest stored token norm
    stored = _stored(codes, scales)
    want = [np.linalg.norm(stored[offs[j]:offs[j + 1]], axis=1).max() for j in range(200)]
    np.testing.assert_allclose(norms, want, rtol=2e-6)
    assert (norms >= want).all()


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("seed", [False, True])
def test_topk_equals_naive_on_real_token_vectors(real_tokens, monkeypatch, scan, seed):
    monkeypatch.setattr(int8scan, "MIN_SCAN_TOKENS", 0)
    monkeypatch.setattr(int8scan, "SEED_FACTOR", 0 if seed else 10 ** 9)
    docs, queries = real_tokens
    vecs, offs = _pack(docs)
    codes, scales = quantize(vecs, "int8")
    for k in (1, 5):
        _check_topk(queries, codes, offs, scales, k, scan, chunk_bytes=20_000)
    _check_topk(queries, codes, offs, scales, 3, scan, doc_idx=np.array([23, 5, 0, 12, 17, 9, 2]),
                chunk_bytes=20_000)


def test_topk_on_float_codes_takes_the_exact_path(rng):
    vecs, offs = _pack(rand_docs(rng, 30, 16))
    q = [rand_unit(rng, 3, 16)]
    stats = {}
    (s, p), = int8scan.maxsim_topk(q, vecs.astype(np.float16), offs, None, 4, stats=stats)
    assert stats["scan"] == "exact"
    with pytest.raises(InvalidError, match="int8 codes"):
        int8scan.maxsim_topk(q, vecs, offs, None, 4, scan="int8")
    with pytest.raises(InvalidError, match="unknown MaxSim scan"):
        int8scan.maxsim_topk(q, vecs, offs, None, 4, scan="fast")


@pytest.mark.parametrize("flags, int8", [
    (ZEN1_FLAGS, "exact"),  # no int8 units: products at the FMA rate
    (CASCADE_LAKE_FLAGS, "int8"),  # AVX-512 VNNI (this machine's kind)
    (SAPPHIRE_RAPIDS_FLAGS, "int8"),  # AMX, without the fused scan (not built)
    (ALDER_LAKE_FLAGS, "int8"),  # AVX-VNNI
    (NO_AVX2_FLAGS, "exact"),
    ((), "exact"),
])
def test_scan_choice_per_cpu(flags, int8):
    assert kernels.choose_scan("int8", flags)[0] == int8
    assert kernels.choose_scan("int8", flags, torch_int8=False)[0] == "exact"
    # the fused AMX scan where the CPU has AMX and the module is built, whatever torch has
    amx = "amx" if flags is SAPPHIRE_RAPIDS_FLAGS else int8
    assert kernels.choose_scan("int8", flags, amx_scan=True)[0] == amx
    assert kernels.choose_scan("int8", flags, torch_int8=False, amx_scan=True)[0] == \
        ("amx" if amx == "amx" else "exact")
    # the scan fused on AVX-512 VNNI where it is built: AVX-512 VNNI CPUs, and AMX CPUs whose
    # tiles are not granted; AVX-VNNI (256-bit) keeps the library scan
    vnni = "vnni" if flags in (CASCADE_LAKE_FLAGS, SAPPHIRE_RAPIDS_FLAGS) else int8
    assert kernels.choose_scan("int8", flags, vnni_scan=True)[0] == vnni
    assert kernels.choose_scan("int8", flags, torch_int8=False, vnni_scan=True)[0] == \
        (vnni if vnni == "vnni" else "exact")
    assert kernels.choose_scan("int8", flags, amx_scan=True, vnni_scan=True)[0] == (amx if amx == "amx" else vnni)
    # the scan fused on AVX2 where it is built and neither of those runs: every CPU with AVX2 and
    # FMA (AVX2-only ones, AVX-VNNI ones, AVX-512 ones whose VNNI scan is not usable), whatever
    # torch has; never where the flags lack AVX2
    avx2 = "avx2" if "avx2" in flags else int8
    assert kernels.choose_scan("int8", flags, avx2_scan=True)[0] == avx2
    assert kernels.choose_scan("int8", flags, torch_int8=False, avx2_scan=True)[0] == \
        ("avx2" if avx2 == "avx2" else "exact")
    assert kernels.choose_scan("int8", flags, vnni_scan=True, avx2_scan=True)[0] == (vnni if vnni == "vnni" else avx2)
    assert kernels.choose_scan("int8", flags, amx_scan=True, vnni_scan=True, avx2_scan=True)[0] == \
        (amx if amx == "amx" else vnni if vnni == "vnni" else avx2)
    for precision in ("float16", "float32"):
        assert kernels.choose_scan(precision, flags)[0] == "exact"
        assert kernels.choose_scan(precision, flags, amx_scan=True, vnni_scan=True, avx2_scan=True)[0] == "exact"


def test_auto_scan_is_the_choice_for_this_cpu(rng):
    flags = cpu_features().flags
    amx = kernels.int8_units(flags) == "amx" and amxscan.available()
    vnni = not amx and amxscan.available(unit="vnni")
    avx2 = not (amx or vnni) and amxscan.available(unit="avx2")
    want = kernels.choose_scan("int8", flags, int8scan.int8_matmul_is_exact() and not (amx or vnni or avx2),
                               amx, vnni, avx2)[0]
    assert kernels.resolve_scan("auto", "int8") == want
    docs = rand_docs(rng, 400, 32, lo=40, hi=60)  # above MIN_SCAN_TOKENS
    vecs, offs = _pack(docs)
    codes, scales = quantize(vecs, "int8")
    stats = {}
    int8scan.maxsim_topk([rand_unit(rng, 4, 32)], codes, offs, scales, 3, stats=stats)
    assert stats["scan"] == want


# ---------------------------------------------------------------------------- the fused scans
@pytest.mark.skipif(not FUSED_UNITS, reason="no AMX int8, AVX-512 VNNI or AVX2 here, or the module is not built")
@pytest.mark.parametrize("unit", FUSED_UNITS)
@pytest.mark.parametrize("dim", [384, 100, 64, 8, 130])
@pytest.mark.parametrize("n_codes", [1, 2, 3])
def test_fused_docmax_equals_the_integer_reference(rng, unit, dim, n_codes):
    """amxscan.docmax on each unit (AMX tiles; AVX-512 VNNI, whose unsigned-query trick and row
    sums must cancel exactly, -128 codes included) against an int64 matrix product of the same codes (written here: the
    definition, not the kernel's loop): per document and query column, the largest scaled sum of
    the levels' products. Documents of 1-70 rows (16-row blocks cross documents), the rows up to
    the array's last one (its zero-padded copy), subsets with gaps and out of order, dims that
    are not a multiple of 64 (the next row's bytes meet zero query codes)."""
    lens = rng.integers(1, 70, 120)
    offs = np.concatenate([[0], np.cumsum(lens)])
    codes = rng.integers(-128, 128, (int(offs[-1]), dim), dtype=np.int8)  # -128: TDPBSSD is signed
    scales = rng.uniform(1e-3, 2e-2, len(codes)).astype(np.float32)
    q = rng.normal(size=(37, dim)).astype(np.float32)
    qc, _, _, _ = int8scan.quantized_queries(q, n_codes)
    w = (np.float32(1) / np.float32(254) ** np.arange(n_codes)).astype(np.float32)
    prod = (qc.astype(np.int64) @ codes.astype(np.int64).T).reshape(n_codes, 37, len(codes))
    val = sum(prod[lv].astype(np.float64) * float(w[lv]) for lv in range(n_codes)) * scales[None, :]
    packed = amxscan.pack_query(qc, n_codes, unit)
    for idx in (np.arange(120), np.array([119, 3, 4, 5, 60, 0, 118, 7])):
        got = amxscan.docmax(packed, n_codes, w, 37, codes, scales, offs[idx], offs[idx + 1])
        want = np.stack([val[:, offs[j]:offs[j + 1]].max(axis=1) for j in idx])
        assert got.shape == (len(idx), 37)
        np.testing.assert_allclose(got, want, rtol=3e-7 * n_codes, atol=0)


@pytest.mark.skipif(len(FUSED_UNITS) < 2, reason="needs two fused units (an AVX-512 VNNI CPU has AVX2 too)")
def test_the_fused_units_give_the_same_maxima(rng):
    """VNNI's shifted query and row-sum correction and AVX2's sign moved to the query give
    TDPBSSD's integers exactly, and all combine, scale and take maxima in the same float32 order:
    the maxima are bitwise equal."""
    lens = rng.integers(1, 90, 150)
    offs = np.concatenate([[0], np.cumsum(lens)])
    codes = rng.integers(-128, 128, (int(offs[-1]), 384), dtype=np.int8)
    scales = rng.uniform(1e-3, 2e-2, len(codes)).astype(np.float32)
    for n_codes in (1, 2, 3):
        qc, _, _, _ = int8scan.quantized_queries(rng.normal(size=(45, 384)).astype(np.float32), n_codes)
        w = (np.float32(1) / np.float32(254) ** np.arange(n_codes)).astype(np.float32)
        got = [amxscan.docmax(amxscan.pack_query(qc, n_codes, u), n_codes, w, 45, codes, scales, offs[:-1], offs[1:])
               for u in FUSED_UNITS]
        for other in got[1:]:
            np.testing.assert_array_equal(got[0], other)


def _maddubs(u: np.ndarray, s: np.ndarray) -> np.ndarray:
    """VPMADDUBSW on one int16 lane per row: ``u`` uint8 and ``s`` int8 pairs ``[..., 2]``, the two
    products added and saturated to int16 (Intel's definition)."""
    return np.clip(u.astype(np.int64)[..., 0] * s[..., 0] + u.astype(np.int64)[..., 1] * s[..., 1], -32768, 32767)


def test_avx2_representation_never_saturates():
    """The AVX2 scan's proof, on every value: for every code ``c`` (-128..127) and query code
    ``k`` (-127..127), ``VPABSB`` gives ``|c|`` as an unsigned byte (-128 -> 128) and ``VPSIGNB``
    ``sgn(c) k`` as a signed byte (emulated with int8 wrap-around), their product is ``c k`` and
    at most 128 * 127 = 16,256 in magnitude, so a pair is at most 32,512 < 32,767: VPMADDUBSW
    never saturates and equals the exact pair sum at the worst pairs. The shift VNNI uses would
    saturate there (it is why AVX2 needs another representation), and a -128 query code would
    wrap, which is why pack_query refuses it."""
    c = np.arange(-128, 128, dtype=np.int64)[:, None]
    k = np.arange(-127, 128, dtype=np.int64)[None, :]
    u = np.abs(c).astype(np.uint8)  # VPABSB: 128 for -128
    s = (np.sign(c) * k).astype(np.int8)  # VPSIGNB: k negated where c < 0, 0 where c == 0
    assert (u.astype(np.int64) * s == c * k).all()
    assert np.abs(u.astype(np.int64) * s).max() == 128 * 127 == 16_256
    # the worst pairs: both products at the extreme, of either sign
    for cv, kv in ((-128, 127), (-128, -127), (127, 127), (127, -127)):
        pair_u = np.full((1, 2), abs(cv), np.uint8)
        pair_s = np.full((1, 2), np.sign(cv) * kv, np.int8)
        assert _maddubs(pair_u, pair_s)[0] == 2 * cv * kv and abs(2 * cv * kv) <= 32_512
    # the VNNI representation (query + 128 unsigned, codes signed) saturates on these pairs
    assert _maddubs(np.full((1, 2), 127 + 128, np.uint8), np.full((1, 2), -128, np.int8))[0] == -32768 != 2 * 255 * -128
    # -128 in the query: VPSIGNB would negate it to -128 (int8 wrap), not 128
    assert (np.array([-128], np.int8) * np.int8(-1))[0] == -128
    with pytest.raises(ValueError, match="-127..127"):
        amxscan.pack_query(np.full((2, 8), -128, np.int8), 1, "avx2")


@pytest.mark.skipif("avx2" not in FUSED_UNITS, reason="no AVX2 here, or the module is not built")
@pytest.mark.parametrize("dim", [384, 36])
def test_avx2_scan_is_exact_at_the_saturation_edge(rng, dim):
    """The AVX2 kernel on the codes and query codes that would saturate an int16 pair sum under
    any representation without the bound (every code -128 or 127, every query code +-127, in runs
    of one sign and mixed), against an int64 product: exact integers, so the maxima of scale 1
    are the integers themselves."""
    n = 64
    codes = np.where(rng.random((n, dim)) < 0.5, -128, 127).astype(np.int8)
    codes[:8] = -128
    codes[8:16] = 127
    q = np.where(rng.random((20, dim)) < 0.5, -127, 127).astype(np.int8)
    q[0], q[1] = -127, 127
    offs = np.arange(n + 1, dtype=np.int64)  # one row per document: the maxima are the products
    want = (q.astype(np.int64) @ codes.astype(np.int64).T).T
    assert np.abs(want).max() == 128 * 127 * dim  # the extremes are reached
    for n_codes in (1, 2):
        qc = np.concatenate([q] * n_codes)
        w = np.ones(n_codes, np.float32)
        got = amxscan.docmax(amxscan.pack_query(qc, n_codes, "avx2"), n_codes, w, 20, codes, None,
                             offs[:-1], offs[1:])
        np.testing.assert_array_equal(got.astype(np.int64), want * n_codes)


@pytest.mark.skipif(not (FUSED_UNITS and int8scan.int8_matmul_is_exact()),
                    reason="needs a fused scan and torch's exact int8 matmul")
@pytest.mark.parametrize("unit", FUSED_UNITS)
def test_fused_scan_gives_the_library_scans_values(rng, unit):
    """The two engines of bound_scan compute the same scores (the same integers; float32 roundings
    in another order) and the same bounds."""
    docs = [d * rng.uniform(0.5, 3.0) for d in rand_docs(rng, 300, 96, lo=1, hi=50)]
    vecs, offs = _pack(docs)
    codes, scales = quantize(vecs, "int8")
    queries = rand_docs(rng, 3, 96, lo=1, hi=40)
    norms = int8scan.doc_norms(codes, offs, scales)
    idx = rng.permutation(300)[:77]
    for n_codes in (1, 2, 3):
        for doc_idx in (None, idx):
            nd = norms if doc_idx is None else norms[doc_idx]
            pa, ba = int8scan.bound_scan(queries, codes, offs, scales, nd, doc_idx=doc_idx, n_codes=n_codes,
                                         engine=unit)
            pt, bt = int8scan.bound_scan(queries, codes, offs, scales, nd, doc_idx=doc_idx, n_codes=n_codes,
                                         chunk_bytes=5_000)
            np.testing.assert_allclose(pa, pt, rtol=2e-6, atol=1e-6)
            np.testing.assert_array_equal(ba, bt)


def test_fused_units_follow_the_flags():
    """Each fused scan runs only where its unit is in the flags (injected): AVX-512 VNNI with
    BW/DQ/VL for ``vnni``, AMX int8 for ``amx``; a scan asked for by name where it cannot run is
    refused with a message naming the unit."""
    built = amxscan.built()
    assert not amxscan.available(ZEN1_FLAGS, "vnni") and not amxscan.available(ALDER_LAKE_FLAGS, "vnni")
    assert not amxscan.available(ZEN1_FLAGS + ["avx512f", "avx512_vnni"], "vnni")
    assert not amxscan.available(CASCADE_LAKE_FLAGS, "amx")
    assert not amxscan.available(NO_AVX2_FLAGS, "avx2")
    for missing in ("avx2", "fma"):
        assert not amxscan.available([f for f in ZEN1_FLAGS if f != missing], "avx2")
    if built and "avx512_vnni" in cpu_features().flags:
        assert amxscan.available(CASCADE_LAKE_FLAGS, "vnni") and amxscan.available(SAPPHIRE_RAPIDS_FLAGS, "vnni")
    if built and {"avx2", "fma"} <= cpu_features().flags:
        assert all(amxscan.available(f, "avx2") for f in (ZEN1_FLAGS, ALDER_LAKE_FLAGS, CASCADE_LAKE_FLAGS))
        assert amxscan.runnable_units(ZEN1_FLAGS) == ["avx2"]
    for unit in amxscan.UNITS:
        if not amxscan.available(unit=unit):
            with pytest.raises(InvalidError, match="compiled module"):
                kernels.resolve_scan(unit, "int8")
        with pytest.raises(InvalidError, match="int8 codes"):
            kernels.resolve_scan(unit, "float16")
