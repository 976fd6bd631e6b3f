"""Exact top-k MaxSim through the CPU's int8 units: an int8 scan with a proven error bound, then
exact scores for every document the bound cannot rule out.

:func:`maxsim_topk` returns, per query, the ``k`` best documents and their scores exactly as
:func:`index.maxsim.maxsim_scores` (exact MaxSim, float32 query math) followed by
:func:`index.validate.topk` would (ties broken by position), on int8 codes with one float32
scale per token. Where the CPU has int8 dot-product units (AVX-512 VNNI, AVX-VNNI, AMX;
:func:`index.kernels.choose_scan`) it gets there in two steps:

1. **The int8 scan.** Every query token is rounded to int8 codes and every document token is
   scored by an exact int8 x int8 -> int32 matrix product (oneDNN through ``torch._int_mm``: the
   ``vpdpbusd`` / AMX kernels, 4x the multiply-adds per cycle of float32 FMAs on AVX-512), then
   scaled, reduced to per-document maxima and summed. Each approximate score comes with a bound
   on how far it can be from the exact one (below).
2. **The exact step.** ``tau`` is the k-th largest lower bound; every document whose upper bound
   reaches ``tau`` is scored by the exact kernel (:func:`maxsim_scores` on those documents only),
   and the top k of those are returned. Where many documents reach it (near-ties), the k best of
   them by scan score are scored exactly first and ``tau`` rises to the k-th of those exact
   scores (below): about one bound higher, which leaves roughly half as many documents or fewer.

On AMX CPUs (``scan="amx"``) step 1 runs fused on the tiles (:mod:`index.amxscan`: the products
never leave the tiles, each document's maxima are taken as they are made), on AVX-512 VNNI CPUs
(``scan="vnni"``) fused on ``VPDPBUSD`` the same way, on other AVX2 CPUs (``scan="avx2"``) fused
on ``VPMADDUBSW`` + ``VPMADDWD``, all three with the same integers and the same bound.
Elsewhere (no AVX2 nor int8 units, float codes, the module not built and no torch or a library
whose int8 products are not exact on this CPU) it scores every document with the exact kernel:
the portable path. The choice is per CPU and injectable (``scan=``).

**The bound.** Notation: query tokens ``q_i`` (float32, ``i = 1..m``), stored document tokens
``d_j = s_j c_j`` (``c_j`` int8 codes, ``s_j > 0`` their float32 scale), dimension ``n``,
``u = 2**-24`` (float32 unit roundoff), ``g_k = k u / (1 - k u)``.

- Query codes: ``a_i = max|q_i| / 127`` (rounded to float32), ``k_i = rint(q_i / a_i)`` (int8),
  residual ``r_i = q_i - a_i k_i`` (computed in float64 from the float32 values).
- Scan value of a token pair: ``p_ij = a_i s_j <k_i, c_j>``; the integer ``<k_i, c_j>`` is exact
  (int32, ``|.| <= 127 * 127 * n < 2**31``), so
  ``<q_i, d_j> - p_ij = s_j <r_i, c_j> = <r_i, d_j>`` and, by Cauchy-Schwarz,
  ``|<q_i, d_j> - p_ij| <= ||r_i|| ||d_j||``.
- Per document ``D``: ``|max_j x_j - max_j y_j| <= max_j |x_j - y_j|``, so with
  ``N_D = max_{j in D} ||d_j||`` (the document's largest token norm) the exact score
  ``S(D) = sum_i max_j <q_i, d_j>`` and the scan's ``P(D) = sum_i max_j p_ij`` satisfy
  ``|S(D) - P(D)| <= N_D * R`` with ``R = sum_i ||r_i||``.
- Float32 rounding of both computations. The exact kernel's dot products (any summation order,
  FMA or not) are within ``g_n sum_k |q_ik d_jk| <= g_n ||q_i|| ||d_j||`` of the real ones; the
  scale multiply adds ``u``, the sum over query tokens ``g_m sum_i |max_j .|``; so it returns
  ``S(D)`` within ``g_{n+m+1} Q N_D``, ``Q = sum_i (||q_i|| + ||r_i||)``. The scan rounds only
  the int32 -> float32 conversion (exact below ``2**24``, else ``u``), the two scale
  multiplies and the sum: within ``g_{m+3} Q N_D``. Both are covered by ``rho Q N_D`` with
  ``rho = 2 g_{n+m+8}`` (about 1e-4 for n = 384, m = 32, against R of about 1e-2 per query
  token: the rounding terms widen the band by ~1%).
- So with ``B(D) = N_D (R + rho Q)`` (``N_D`` computed in float64 and raised by a relative
  1e-6): ``e(D)``, the exact kernel's value, lies in ``[P(D) - B(D), P(D) + B(D)]`` for the
  computed ``P(D)``.
- **Exclusion.** Let ``tau`` be the k-th largest ``P(D) - B(D)``. A document with
  ``P(D) + B(D) < tau`` has ``e(D) < tau <= e(D')`` for k documents ``D'``: k documents score
  strictly higher, so it is in no top k, whatever the tie-break. The k documents that set
  ``tau`` are never excluded. The top k of the documents kept, scored exactly and ordered by
  (score, position), is therefore the top k of all documents.
- **A higher threshold from k exact scores.** For any k live documents ``T`` scored by the exact
  kernel, ``tau_T = min_{D' in T} e(D')`` serves the same way: ``P(D) + B(D) < tau_T`` gives
  ``e(D) < tau_T <= e(D')`` for the k documents of ``T``. So ``tau = max(k-th largest P - B,
  tau_T)``; with ``T`` the k best by ``P``, ``tau_T`` is near the k-th best ``P``, where the lower
  bounds' ``tau`` is near the k-th best ``P - B``. The documents of ``T`` are never excluded
  (``P + B >= e >= tau_T``, and each has ``P`` at least the k-th largest ``P - B``) and their
  exact scores are the ones returned.

The band ``2 B(D)`` is about ``2 R`` (token vectors of norm ~1): for a 32-token MiniLM query
~0.3 score units, against ~1 unit between the 1st and the 100th of SciFact's documents, so a few
percent of the documents are scored exactly (``bench/maxsim.py`` prints the share).

``N_D`` needs every token's norm: :func:`doc_norms` computes them once per segment (stores cache
them); for candidate subsets they are computed from the gathered rows.

Design note: DESIGN.md lists numpy, faiss, sqlite3 and pymilvus as the libraries of ``index/``.
torch is used here as an optional, lazily imported accelerator (its oneDNN int8 matmul), like
ONNX Runtime in :mod:`index.kernels`; without it the portable path runs.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from . import amxscan, kernels
from .maxsim import DEFAULT_CHUNK_BYTES, DocRows, _chunks, _stack_queries, maxsim_scores

_U = 2.0 ** -24
_STEP = 254.0  # the residual's codes step 1/254 of the first ones (|code| <= 127)
#: a document set with fewer token rows than this is scored exactly without the scan (its
#: fixed costs -- query codes, bounds, a second pass -- are larger than what it saves)
MIN_SCAN_TOKENS = 16_384
#: int8 codes per query component of the first scan and of the second (of the first one's
#: survivors), per scan. The library path pays for every product in memory traffic, so it scans
#: with one code first. The fused AMX scan is bound by reading the codes, not by the tiles: two
#: codes cost it about what one does (88 vs 86 ms per query over 1 GB) and leave ~10 of 18,190
#: near-tied synthetic documents instead of a third of them, so no second scan runs
#: (bench/maxsim.py --codes-sweep: 90-92 ms for an exact top 10, against 126-134 with one code).
#: The fused VNNI scan is bound by its multiply-adds (two codes cost 1.8-1.9x one), so it scans
#: with one code first. On those synthetic near-ties one code leaves a third of the documents
#: by the lower bounds alone, 840 of 18,190 with k exact scores first (``SEED_FACTOR``; exact
#: top 10 in 101-113 ms, 2.9-3.5x the read, 1.4-1.6x faster than two codes first), and real documents are not
#: near-ties: on every SciFact abstract's MiniLM codes one code first leaves a median of 16 of
#: 5,183 documents and an exact top 10 takes 44 ms against 79 with two codes first
#: (bench/maxsim_real.py on a VNNI EPYC without AMX: 2.3x against 4.2x the plain read)
#: The fused AVX2 scan is bound by its multiply-adds like VNNI's, at about half their rate: one
#: code first, as VNNI.
SCAN_CODES = {"int8": (1, 2), "amx": (2, 3), "vnni": (1, 2), "avx2": (1, 2)}
#: when the first scan leaves more than this many times k documents, the k best of them by scan
#: score are scored exactly first and their k-th exact score raises the threshold (the exact
#: step of the module docstring); fewer survivors are scored exactly at once (one call less)
SEED_FACTOR = 4


def _gamma(k: int) -> float:
    return k * _U / (1 - k * _U)


# ---------------------------------------------------------------------------- the int8 product
@lru_cache(maxsize=1)
def int8_matmul_is_exact() -> bool:
    """Whether ``torch._int_mm`` computes exact int32 products here (oneDNN may saturate int16
    pair sums on CPUs without VNNI): checked on worst cases of both signs."""
    try:
        import torch

        for a, b in ((-128, 127), (127, -127), (127, 127), (-128, -127)):
            x = torch.full((4, 64), a, dtype=torch.int8)
            y = torch.full((64, 4), b, dtype=torch.int8)
            if not bool((torch._int_mm(x, y) == a * b * 64).all()):
                return False
        return True
    except Exception:  # torch missing, or no CPU kernel for _int_mm
        return False


@lru_cache(maxsize=1)
def _omp_library():
    """The OpenMP runtime torch runs its CPU kernels on (``None`` if not found)."""
    try:
        import ctypes
        import glob
        import os

        import torch

        libs = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "lib*omp*.so*")))
        return ctypes.CDLL(libs[0]) if libs else None
    except Exception:  # pragma: no cover - an unusual torch build
        return None


_thread = threading.local()
# the codes are read-only mappings: torch warns once that it could not write them (it does not)
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)


def _one_omp_thread() -> None:
    """In the scan's own worker threads (``run_parallel``'s, named ``maxsim``), make torch run one
    OpenMP thread: the scan's parallelism is over chunks, and an OpenMP team per worker would put
    two threads per core (measured no faster, more CPU). OpenMP's thread count is a per-thread
    setting: torch's own first-use initialisation runs first (it would reset it), then the
    calling thread's count is set to 1 -- the caller's threads and torch's setting elsewhere
    (the encoder's) are untouched."""
    if getattr(_thread, "done", False) or not threading.current_thread().name.startswith("maxsim"):
        return
    _thread.done = True
    lib = _omp_library()
    if lib is not None:
        import torch

        torch.get_num_threads()  # torch's per-thread initialisation, before the count is set
        lib.omp_set_num_threads(1)


def _int_mm(a: np.ndarray, b_t: np.ndarray) -> np.ndarray:
    """``int32 a @ b_t.T`` of int8 ``a [m, n]`` and int8 ``b_t [T, n]`` (rows of codes)."""
    import torch

    _one_omp_thread()
    return torch._int_mm(torch.from_numpy(a), torch.from_numpy(b_t).t()).numpy()


# ---------------------------------------------------------------------------- norms
def doc_norms(vectors: np.ndarray, offsets: np.ndarray, scales: np.ndarray | None = None,
              doc_idx: np.ndarray | None = None, chunk_rows: int = 16_384) -> np.ndarray:
    """``float64 [n_docs]`` (or ``[len(doc_idx)]``): each document's largest token L2 norm (of the
    stored values ``s_j c_j``), raised by a relative 1e-6 so that it bounds the real norm
    (``N_D`` above). Reads the codes ``chunk_rows`` token rows at a time."""
    rows = DocRows(offsets, doc_idx)
    out, local = np.zeros(len(rows), np.float64), rows.local
    for a, b in _chunks(local, chunk_rows):
        block, sc = rows.block(vectors, scales, a, b)
        f = np.asarray(block, dtype=np.float32)
        sq = np.einsum("ij,ij->i", f, f).astype(np.float64)  # int8 codes: exact (integers < 2**24)
        if sc is not None:
            sq *= np.square(np.asarray(sc, np.float64))
        out[a:b] = np.maximum.reduceat(sq, local[a:b] - local[a])
    slack = 1e-6 if scales is not None and vectors.shape[1] <= 1024 else 2 * _gamma(vectors.shape[1] + 2)
    return np.sqrt(out) * (1 + max(slack, 1e-6))


# ---------------------------------------------------------------------------- the scan
def quantized_queries(q_all: np.ndarray, n_codes: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(codes int8 [n_codes * m, n], a float32 [m], ||r_i|| float64 [m], ||q_i|| float64 [m])`` of
    the stacked query tokens: ``q_i ~ a_i (k_i + k'_i / 254)`` (``k'``: the codes of the rounding
    residual, with ``n_codes=2``), ``r_i`` what is left (the bound's ``k_i``, ``a_i``, ``r_i``)."""
    q = np.asarray(q_all, np.float32)
    amax = np.abs(q).max(axis=1) if q.size else np.zeros(len(q), np.float32)
    a = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    x = q.astype(np.float64) / a.astype(np.float64)[:, None]
    parts, approx, step = [], np.zeros_like(x), 1.0
    for _ in range(n_codes):
        c = np.clip(np.rint((x - approx) / step), -127, 127)
        parts.append(c.astype(np.int8))
        approx += c * step
        step /= _STEP
    r = (x - approx) * a.astype(np.float64)[:, None]
    r_norm = np.linalg.norm(r, axis=1) * (1 + 1e-12)
    return np.ascontiguousarray(np.concatenate(parts)), a, r_norm, np.linalg.norm(q.astype(np.float64), axis=1)


def bound_scan(queries: Sequence[np.ndarray], vectors: np.ndarray, offsets: np.ndarray,
               scales: np.ndarray, norms: np.ndarray, *, doc_idx: np.ndarray | None = None,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES, n_codes: int = 1,
               engine: str = "torch") -> tuple[np.ndarray, np.ndarray]:
    """The int8 scan: ``(P [q, n_docs] float32, B [q, n_docs] float64)`` -- every document's
    scan score and the bound on its distance from the exact score (module docstring).

    Args:
        queries, vectors, offsets, scales, doc_idx, chunk_bytes: as :func:`maxsim_scores`
            (``vectors`` int8 codes, ``scales`` their float32 scales).
        norms: ``[n_docs]`` (or ``[len(doc_idx)]``) each document's largest token norm
            (:func:`doc_norms`).
        n_codes: int8 codes per query component: 1, 2 (the rounding residual's codes too:
            twice the products, a bound 254x tighter) or 3.
        engine: ``torch`` (oneDNN int8 products per chunk, per-document maxima in numpy),
            ``amx``, ``vnni`` or ``avx2`` (:mod:`index.amxscan`: fused, on AMX tiles, AVX-512
            VNNI or AVX2; the same values).
    """
    q_all, q_starts = _stack_queries(queries)
    m, dim = q_all.shape
    quant = quantized_queries(q_all, n_codes)
    _, _, r_norm, q_norm = quant
    rho = 2 * _gamma(dim + m + 8)
    per_query = np.add.reduceat(r_norm + rho * (q_norm + r_norm), q_starts)  # R + rho Q per query
    bound = per_query[:, None] * np.asarray(norms, np.float64)[None, :]
    return scan_scores(q_all, q_starts, quant, vectors, offsets, scales, doc_idx=doc_idx,
                       chunk_bytes=chunk_bytes, engine=engine), bound


def scan_scores(q_all: np.ndarray, q_starts: np.ndarray, quant: tuple, vectors: np.ndarray,
                offsets: np.ndarray, scales: np.ndarray, *, doc_idx: np.ndarray | None = None,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES, engine: str = "torch") -> np.ndarray:
    """The scan's scores ``P [q, n_docs] float32`` of the stacked query tokens ``q_all``
    (``q_starts``: each query's first row) quantized as ``quant`` (:func:`quantized_queries`);
    the rest as :func:`bound_scan`."""
    rows = DocRows(offsets, doc_idx)
    n_docs = len(rows)
    m, dim = q_all.shape
    codes, a = quant[0], quant[1]
    n_codes = len(codes) // max(m, 1)
    out = np.empty((len(q_starts), n_docs), np.float32)
    if n_docs == 0 or m == 0:
        return out
    local = rows.local
    n_workers = kernels.workers()
    per_worker = -(-int(local[-1]) // n_workers)
    weights = (np.float32(1) / np.float32(_STEP) ** np.arange(n_codes)).astype(np.float32)

    def reduce(doc_max: np.ndarray, x: int, y: int) -> None:  # [m, y - x] maxima -> the scores
        doc_max *= a[:, None]
        out[:, x:y] = np.add.reduceat(doc_max, q_starts, axis=0)

    if engine in amxscan.UNITS:
        packed = amxscan.pack_query(codes, n_codes, engine)
        ends = rows.starts + rows.lens

        def scan_docs(span: tuple[int, int]) -> None:
            x, y = span
            reduce(amxscan.docmax(packed, n_codes, weights, m, vectors, scales,
                                  rows.starts[x:y], ends[x:y]).T.copy(), x, y)

        # the fused scan holds no chunk in memory: spans only share the work out (4 per worker)
        kernels.run_parallel(scan_docs, _chunks(local, max(1, per_worker // 4)), n_workers)
        return out

    per_token = dim + 8 * n_codes * m  # the codes, the int32 products, their float32 scaling
    spans = _chunks(local, max(1, min(chunk_bytes // per_token, per_worker)))

    def score_span(span: tuple[int, int]) -> None:
        x, y = span
        block, sc = rows.block(vectors, scales, x, y, "gather")
        prod = _int_mm(codes, np.ascontiguousarray(block))  # int32 [n_codes * m, T], exact
        sim = kernels.scratch("scan_sim", (m, len(block)), np.float32)
        # k + k' / 254 (+ k'' / 254**2), in float32 (rounding within the bound's rho)
        sc = np.asarray(sc, np.float32)[None, :]
        if n_codes == 1:
            np.multiply(prod, sc, out=sim, dtype=np.float32, casting="unsafe")
        else:
            np.multiply(prod[m:2 * m], weights[1], out=sim, dtype=np.float32, casting="unsafe")
            for level in range(2, n_codes):
                sim += prod[level * m:(level + 1) * m].astype(np.float32) * weights[level]
            np.add(sim, prod[:m], out=sim, dtype=np.float32, casting="unsafe")
            sim *= sc
        reduce(np.maximum.reduceat(sim, local[x:y] - local[x], axis=1), x, y)  # [m, y - x]

    kernels.run_parallel(score_span, spans, n_workers)
    return out


def fused_maxsim(queries: Sequence[np.ndarray], vectors: np.ndarray, offsets: np.ndarray,
                 scales: np.ndarray | None, *, doc_idx: np.ndarray | None = None, unit: str = "amx") -> np.ndarray:
    """MaxSim of every query against every document (or ``doc_idx``) by the fused scan on
    ``unit`` (``amx``, ``vnni`` or ``avx2``) with three int8 codes per query component: the
    ``amx-int8x3`` / ``vnni-int8x3`` / ``avx2-int8x3`` kernels of :func:`index.maxsim.maxsim_scores`, exact up to
    float32 rounding like ``mlas-int8x3`` (the query's error per component is at most
    ``a / (2 * 254**2)``)."""
    q_all, q_starts = _stack_queries(queries)
    return scan_scores(q_all, q_starts, quantized_queries(q_all, 3), vectors, offsets, scales,
                       doc_idx=doc_idx, engine=unit)


# ---------------------------------------------------------------------------- exact top k
def _topk_order(scores: np.ndarray, k: int) -> np.ndarray:
    """Positions of the best ``k`` scores, descending, ties by position (as ``validate.topk``)."""
    if len(scores) > 4 * k:
        part = np.argpartition(-scores, k - 1)[:k]
        return part[np.lexsort((part, -scores[part]))]
    return np.argsort(-scores, kind="stable")[:k]


def maxsim_topk(queries: Sequence[np.ndarray], vectors: np.ndarray, offsets: np.ndarray,
                scales: np.ndarray | None, k: int, *, doc_idx: np.ndarray | None = None,
                live: np.ndarray | None = None, norms: np.ndarray | None = None,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES, scan: str = "auto",
                kernel: str = "auto", stats: dict | None = None,
                codes: tuple[int, int] | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Exact MaxSim top ``k`` of every query: per query ``(scores float32 [k'], positions
    int64 [k'])``, best first, ties by position; positions index the documents (or ``doc_idx``);
    ``k' = min(k, documents scored)``.

    Args:
        queries, vectors, offsets, scales, doc_idx, chunk_bytes: as :func:`maxsim_scores`.
        k: how many documents per query (``>= 1``).
        live: optional bool mask over the documents (or ``doc_idx``): only these may be returned.
        norms: each document's largest token norm (:func:`doc_norms`, over all documents even
            with ``doc_idx``); computed from the rows scanned when not given.
        scan: ``auto`` (:func:`kernels.choose_scan` for this CPU), ``int8`` (the bound scan,
            then exact scores of the documents it cannot rule out), ``amx`` / ``vnni`` /
            ``avx2`` (the same with the scan fused on AMX tiles, AVX-512 VNNI or AVX2:
            :mod:`index.amxscan`) or ``exact`` (the exact kernel on every document: the
            portable path).
        kernel: the exact kernel (:func:`maxsim_scores`' ``kernel``).
        stats: if given, filled with ``scan`` (the path taken) and ``rescored`` (documents
            scored exactly, per query).
        codes: int8 codes per query component of the first scan and of the second one (of
            the first one's survivors); default :data:`SCAN_CODES` of the scan.
    """
    offsets = np.asarray(offsets, np.int64)
    n_docs = len(offsets) - 1 if doc_idx is None else len(doc_idx)
    n_tokens = int(offsets[-1]) if doc_idx is None else \
        int((offsets[np.asarray(doc_idx) + 1] - offsets[np.asarray(doc_idx)]).sum())
    precision = np.dtype(vectors.dtype).name
    # a small set is scored exactly without asking for the scan (nor importing torch for it)
    path = "exact" if scan == "auto" and n_tokens < MIN_SCAN_TOKENS else kernels.resolve_scan(scan, precision)
    live_pos = None if live is None else np.flatnonzero(np.asarray(live, bool))
    if stats is not None:
        stats["scan"] = path
    if not len(queries):
        return []
    if path == "exact":
        sel = doc_idx if live_pos is None else (live_pos if doc_idx is None else np.asarray(doc_idx)[live_pos])
        s = maxsim_scores(queries, vectors, offsets, scales, doc_idx=sel, chunk_bytes=chunk_bytes, kernel=kernel)
        pos = np.arange(n_docs) if live_pos is None else live_pos
        if stats is not None:
            stats["rescored"] = [int(len(pos))] * len(queries)
        return [(row[o], pos[o]) for row in s for o in [_topk_order(row, k)]]
    all_pos = np.arange(n_docs, dtype=np.int64)
    if norms is None:
        norms = doc_norms(vectors, offsets, scales, doc_idx)
    elif doc_idx is not None:
        norms = np.asarray(norms)[np.asarray(doc_idx, np.int64)]
    norms = np.asarray(norms, np.float64)
    ok = np.ones(n_docs, bool) if live_pos is None else np.zeros(n_docs, bool)
    if live_pos is not None:
        ok[live_pos] = True
    rows = all_pos if doc_idx is None else np.asarray(doc_idx, np.int64)  # document rows per position
    tok_lens = offsets[rows + 1] - offsets[rows]

    def survivors(p: np.ndarray, b: np.ndarray, pos: np.ndarray, floor: float = -np.inf) -> np.ndarray:
        """The positions ``pos`` (scores ``p``, bounds ``b``) that the bound cannot rule out;
        ``floor``: the k-th best exact score of k live documents, if known."""
        lo = np.where(ok[pos], p - b, -np.inf)
        if int(ok[pos].sum()) <= k:
            return pos[ok[pos]]
        tau = max(np.partition(lo, len(lo) - k)[len(lo) - k], floor)  # k-th largest lower bound, or floor
        return pos[ok[pos] & (p + b >= tau)]

    def exact(q: np.ndarray, pos: np.ndarray) -> np.ndarray:
        return maxsim_scores([q], vectors, offsets, scales, doc_idx=rows[pos], chunk_bytes=chunk_bytes,
                             kernel=kernel)[0]

    engine = path if path in amxscan.UNITS else "torch"
    first, second = codes or SCAN_CODES[path]
    p1, b1 = bound_scan(queries, vectors, offsets, scales, norms, doc_idx=doc_idx, chunk_bytes=chunk_bytes,
                        n_codes=first, engine=engine)
    out, rescored, refined = [], [], []
    for qi, q in enumerate(queries):
        cand = survivors(p1[qi], b1[qi], all_pos)
        seed, seed_s, floor = cand[:0], np.zeros(0, np.float32), -np.inf
        if len(cand) > SEED_FACTOR * k:
            # the k best survivors by scan score, scored exactly: their k-th exact score is a
            # threshold too (module docstring), about one bound above the k-th lower bound
            seed = np.sort(cand[_topk_order(p1[qi][cand], k)])
            seed_s = exact(q, seed)
            floor = float(seed_s.min())
            cand = survivors(p1[qi][cand], b1[qi][cand], cand, floor)
        refined.append(int(len(cand)))
        if len(cand) > k and int(tok_lens[cand].sum()) >= MIN_SCAN_TOKENS:
            # a second scan of the survivors with more of the residual's codes: a bound 254x
            # tighter per code
            p2, b2 = bound_scan([q], vectors, offsets, scales, norms[cand], doc_idx=rows[cand],
                                chunk_bytes=chunk_bytes, n_codes=second, engine=engine)
            cand = survivors(p2[0], b2[0], cand, floor)
        rest = np.setdiff1d(cand, seed, assume_unique=True)  # the seed's scores are known
        pos = np.concatenate([seed, rest])
        s = np.concatenate([seed_s, exact(q, rest)]) if len(rest) else seed_s
        by_pos = np.argsort(pos, kind="stable")
        pos, s = pos[by_pos], s[by_pos]
        o = _topk_order(s, k)  # pos is ascending: ties stay by position
        out.append((s[o], pos[o]))
        rescored.append(int(len(pos)))
    if stats is not None:
        stats["rescored"], stats["second_scan"] = rescored, refined
    return out
