"""The fused int8 scan of :mod:`index.int8scan` on AMX tiles: per document and query token, the
largest scaled int8 product, with no ``[m, T]`` product array in memory.

:mod:`index.int8scan`'s library path multiplies a chunk of codes by the query's int8 codes with
oneDNN (``torch._int_mm``), writes the ``[m, T]`` int32 products to memory, then scales them and
takes per-document maxima in numpy. On an AMX Xeon that path ran at ~132 G int8 multiply-adds per
second, far below the tiles' rate: it is bound by the products' round trip through memory and by
numpy's passes over them (docs/storage.md). No library has the fused operation -- int8 matrix
product, per-row scale, maximum over variable-length row segments -- oneDNN, MLAS and FAISS stop
at the product (or at a top-1), so it is written here, in ``_amxscan.c``:

- the document's int8 codes are the tiles' A operand as they lie on disk (16 rows x 64 bytes per
  tile load, no copy, no layout change), the query's codes the B operand, packed once per call
  (:func:`pack_query`); ``TDPBSSD`` (signed x signed int8, exact int32 sums) accumulates 16 rows
  x 16 query columns per tile;
- each 16-row block's int32 tiles go to a 3 KB buffer, are converted, combined over the query's
  code levels, scaled by the row's scale and folded into the running per-document maxima in
  AVX-512 registers; a document's maxima are written when its last row is done.

What it computes is exactly what :func:`index.int8scan.bound_scan`'s library path computes
(the same integers, the same float32 scaling up to the order of two roundings, which the bound's
``rho`` covers), so the bound, the exclusion and the exact step of :mod:`index.int8scan` are
unchanged: this module only replaces the products and the per-document maxima.

Used where the CPU has AMX int8 (``amx_tile`` and ``amx_int8`` in its flags), the module was
built (it is optional: ``setup.py``) and Linux grants the process the tile state
(``arch_prctl(ARCH_REQ_XCOMP_PERM)``); :func:`available` checks all three.
``bench/maxsim.py`` measures it against the library path on the same codes.
"""

from __future__ import annotations

import ctypes
import importlib.util
from functools import lru_cache

import numpy as np

from embedpool.cpu import cpu_features

ROWS = 16   # rows of a tile: document rows per block, query columns per group
KBYTES = 64  # bytes of a tile row: components per product step

_I64P = np.ctypeslib.ndpointer(np.int64, flags="C_CONTIGUOUS")


def _path() -> str | None:
    """The compiled library's file (built by ``setup.py`` as the extension
    ``embedpool.index._amxscan``, whose Python module is empty), or ``None``."""
    try:
        spec = importlib.util.find_spec(f"{__package__}._amxscan")
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.origin else None


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    """The compiled kernel with the tile state granted, or ``None``."""
    path = _path()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        if lib.ep_amx_request() != 0:
            return None
        fn = lib.ep_amx_docmax
    except (OSError, AttributeError):  # not loadable here, or not an x86-64 Linux build
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, _I64P, _I64P,
                   ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_void_p]
    return lib


def built() -> bool:
    """Whether the compiled library is installed (whatever the CPU)."""
    return _path() is not None


def available(flags=None) -> bool:
    """Whether the fused AMX scan can run here: AMX int8 in ``flags`` (the CPU's by default), the
    module built, the tile state granted."""
    f = frozenset(cpu_features().flags if flags is None else flags)
    return {"amx_tile", "amx_int8"} <= f and _library() is not None


def pack_query(codes: np.ndarray, n_codes: int) -> tuple[np.ndarray, int, int]:
    """``(packed, n_groups, n_kb)``: the query's int8 codes ``[n_codes * m, dim]`` (level-major,
    as :func:`index.int8scan.quantized_queries` gives them) in the tiles' B layout,
    ``[group][level][k block][16 rows of 4-byte groups][16 columns x 4 bytes]``, zero padded to
    16 query tokens per group and 64 components per k block."""
    m = len(codes) // n_codes
    dim = codes.shape[1]
    n_groups, n_kb = -(-m // ROWS), -(-dim // KBYTES)
    q = np.zeros((n_codes, n_groups * ROWS, n_kb * KBYTES), np.int8)
    q[:, :m, :dim] = np.asarray(codes, np.int8).reshape(n_codes, m, dim)
    # [level, group, column, k block, row, byte] -> [group, level, k block, row, column, byte]
    q = q.reshape(n_codes, n_groups, ROWS, n_kb, KBYTES // 4, 4).transpose(1, 0, 3, 4, 2, 5)
    return np.ascontiguousarray(q), n_groups, n_kb


def docmax(packed: tuple[np.ndarray, int, int], n_codes: int, weights: np.ndarray, m: int,
           vectors: np.ndarray, scales: np.ndarray | None, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """``float32 [n_docs, m]``: per document (rows ``starts[d]:ends[d]`` of ``vectors``, each
    non-empty) and query column ``i``, ``max_j s_j sum_l weights[l] <k_{l,i}, c_j>``.

    Args:
        packed: :func:`pack_query`'s result.
        n_codes: code levels per query component (1-3).
        weights: ``float32 [n_codes]``, each level's weight (the first must be 1).
        m: query columns (tokens).
        vectors: int8 codes ``[n_rows, dim]``, C-contiguous (a read-only mapping is fine).
        scales: their ``float32 [n_rows]`` scales, or ``None`` (1).
        starts, ends: ``int64 [n_docs]`` each document's rows.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("the AMX scan is not available here (amxscan.available() is False)")
    q, n_groups, n_kb = packed
    if not vectors.flags.c_contiguous or vectors.dtype != np.int8:
        raise ValueError("the AMX scan reads C-contiguous int8 codes")
    starts = np.ascontiguousarray(starts, np.int64)
    ends = np.ascontiguousarray(ends, np.int64)
    w = np.ascontiguousarray(weights, np.float32)
    if len(w) != n_codes or w[0] != 1:
        raise ValueError("one weight per code level, the first 1")
    sc = None if scales is None else np.ascontiguousarray(scales, np.float32)
    if sc is not None and len(sc) != len(vectors):
        raise ValueError("one scale per row of codes")
    out = np.empty((len(starts), n_groups * ROWS), np.float32)
    if len(starts):
        rc = lib.ep_amx_docmax(vectors.ctypes.data, len(vectors), vectors.shape[1],
                               None if sc is None else sc.ctypes.data, starts, ends, len(starts),
                               q.ctypes.data, n_groups, n_codes, n_kb, w.ctypes.data, out.ctypes.data)
        if rc != 0:
            raise MemoryError("the AMX scan could not allocate its buffers")
    return out[:, :m]
