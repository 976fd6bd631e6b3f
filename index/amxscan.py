"""The fused int8 scans of :mod:`index.int8scan`, on AMX tiles, on AVX-512 VNNI and on AVX2: per
document and query token, the largest scaled int8 product, with no ``[m, T]`` product array in
memory. (The module keeps its first name, ``amxscan``; the VNNI and AVX2 kernels came later and
share its compiled library, its interface and its tests.)

:mod:`index.int8scan`'s library path multiplies a chunk of codes by the query's int8 codes with
oneDNN (``torch._int_mm``), writes the ``[m, T]`` int32 products to memory, then scales them and
takes per-document maxima in numpy. On an AMX Xeon that path ran at ~132 G int8 multiply-adds per
second, far below the tiles' rate: it is bound by the products' round trip through memory and by
numpy's passes over them (docs/storage.md). No library has the fused operation -- int8 matrix
product, per-row scale, maximum over variable-length row segments -- oneDNN, MLAS and FAISS stop
at the product (or at a top-1), so it is written here, in ``_amxscan.c``. Three units:

``amx`` (``ep_amx_docmax``):

- the document's int8 codes are the tiles' A operand as they lie on disk (16 rows x 64 bytes per
  tile load, no copy, no layout change), the query's codes the B operand, packed once per call
  (:func:`pack_query`); ``TDPBSSD`` (signed x signed int8, exact int32 sums) accumulates 16 rows
  x 16 query columns per tile;
- each 16-row block's int32 tiles go to a 3 KB buffer, are converted, combined over the query's
  code levels, scaled by the row's scale and folded into the running per-document maxima in
  AVX-512 registers; a document's maxima are written when its last row is done.

``vnni`` (``ep_vnni_docmax``), for CPUs with AVX-512 VNNI and no AMX (or no tile state):

- ``VPDPBUSD`` multiplies unsigned by signed bytes and can broadcast only its signed operand from
  memory, so the code rows are the signed side -- each 4-byte group broadcast to 16 lanes
  straight from the mapped codes, no copy, no shuffle -- and the query the unsigned side, its
  codes shifted by 128 (``k + 128``, padding 0). ``sum (k + 128) c = <k, c> + 128 sum c``: each
  row's sum of codes (``VPDPBUSD`` with ones, exact) takes the extra term back out, so the int32
  are the ones ``TDPBSSD`` gives (the tests check both against an int64 product, ``-128`` codes
  included, and the two units' maxima against each other, bitwise);
- 8 rows x 32 query columns at a time: 16 int32 accumulators in registers, two query vectors per
  4-byte group shared by the 8 rows, so every multiply-add is useful (12,288 per row and 32-token
  query = 192 ``VPDPBUSD``) and the kernel is bound by the units: on the AMX Xeon's VNNI units
  3.7 G ``VPDPBUSD`` per second per thread over codes from memory (the block four blocks ahead
  prefetched), 5.2 G over codes in L1, 7.3 G in a register-only loop. A first try that
  broadcast the rows after making them unsigned (a shuffle per 4-byte group) ran 4x slower
  (docs/storage.md);
- the int32 go to a small buffer and are combined, scaled and folded into per-document maxima as
  on AMX.

``avx2`` (``ep_avx2_docmax``), for CPUs with AVX2 (and FMA) and neither of the two above:

- ``VPMADDUBSW`` multiplies unsigned by signed bytes and adds adjacent pairs into int16 **with
  saturation**, so the VNNI kernel's shift does not carry over: ``(k + 128) c`` pairs reach
  ``2 * 255 * 128 = 65,280`` (and ``(c + 128) k`` ``2 * 255 * 127 = 64,770``), far above
  ``32,767``. The sign moves from the code to the query instead: ``c k = |c| (sgn(c) k)``, the
  unsigned operand ``|c|`` (``VPABSB``, once per broadcast code group; ``-128`` gives ``128``)
  and the signed one ``sgn(c) k`` (``VPSIGNB`` of the query vector by the codes, once per
  product). **The bound:** ``|c| <= 128`` and ``|sgn(c) k| = |k| <= 127`` (query codes are
  clipped to ``-127..127``; :func:`pack_query` refuses ``-128``, which ``VPSIGNB`` would negate
  to itself), so every product is at most ``128 * 127 = 16,256`` in magnitude and every pair
  ``VPMADDUBSW`` adds at most ``32,512 < 32,767``: nothing saturates, and ``VPMADDWD`` with ones
  adds the pairs into exact int32 -- ``TDPBSSD``'s integers, with no correction term (the tests
  check every (code, query code) pair of the representation and the kernel at the extremes
  against an int64 product, and its maxima bitwise against the other units');
- 4 rows x 16 query columns at a time: 8 int32 accumulators in the 16 ymm registers, two query
  vectors per 4-byte group shared by the 4 rows; per 32 multiply-adds four instructions
  (``VPSIGNB``, ``VPMADDUBSW``, ``VPMADDWD``, ``VPADDD``), two of them on the multiply units, so
  it runs at about half the VNNI kernel's rate on the same core;
- the int32 are combined, scaled and folded into per-document maxima in the same float32 order
  as the other two (bitwise equal maxima).

What all three compute is exactly what :func:`index.int8scan.bound_scan`'s library path computes
(the same integers, the same float32 scaling up to the order of two roundings, which the bound's
``rho`` covers), so the bound, the exclusion and the exact step of :mod:`index.int8scan` are
unchanged: this module only replaces the products and the per-document maxima.

``amx`` is used where the CPU has AMX int8 (``amx_tile`` and ``amx_int8`` in its flags), the
module was built (it is optional: ``setup.py``) and Linux grants the process the tile state
(``arch_prctl(ARCH_REQ_XCOMP_PERM)``); ``vnni`` where the CPU has AVX-512 VNNI with BW/DQ/VL and
the module was built; ``avx2`` where the CPU has AVX2 and FMA and the module was built (every
x86-64 CPU of the last decade; :func:`index.kernels.choose_scan` takes it only where the other
two do not run). :func:`available` checks them per unit (flags injectable).
``bench/maxsim.py`` measures them against the library path and the plain read of the same codes
(``--scan-vs-read``: the fused scans alone, interleaved with the read).
"""

from __future__ import annotations

import ctypes
import importlib.util
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from embedpool.cpu import cpu_features

#: the fused scans, best first: the unit, the CPU flags it needs, and its shape -- query columns
#: per group (AMX: a tile's 16 columns; VNNI: two 16-lane vectors; AVX2: two 8-lane vectors) and
#: components per step of the product (AMX: a tile row's 64 bytes; VNNI, AVX2: one 4-byte group)
UNITS = ("amx", "vnni", "avx2")
UNIT_FLAGS = {"amx": frozenset({"amx_tile", "amx_int8"}),
              "vnni": frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"}),
              "avx2": frozenset({"avx2", "fma"})}
_SHAPE = {"amx": (16, 64), "vnni": (32, 4), "avx2": (16, 4)}
_FUNCTIONS = {"amx": "ep_amx_docmax", "vnni": "ep_vnni_docmax", "avx2": "ep_avx2_docmax"}

_I64P = np.ctypeslib.ndpointer(np.int64, flags="C_CONTIGUOUS")
_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, _I64P, _I64P,
         ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
         ctypes.c_void_p, ctypes.c_void_p]


class Packed(NamedTuple):
    """A query's int8 codes packed for one unit's kernel (:func:`pack_query`)."""

    unit: str
    array: np.ndarray
    n_groups: int  # groups of query columns
    n_k: int  # steps of the product (64-byte blocks on AMX, 4-byte groups on VNNI)


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
    """The compiled kernels, or ``None``."""
    path = _path()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        fns = [getattr(lib, name) for name in _FUNCTIONS.values()]
    except (OSError, AttributeError):  # not loadable here, or not an x86-64 Linux build
        return None
    for fn in fns:
        fn.restype = ctypes.c_int
        fn.argtypes = _ARGS
    return lib


@lru_cache(maxsize=1)
def _tiles_granted() -> bool:
    """Whether Linux grants this process the AMX tile state (asked once)."""
    lib = _library()
    return lib is not None and lib.ep_amx_request() == 0


def built() -> bool:
    """Whether the compiled library is installed (whatever the CPU)."""
    return _path() is not None


def available(flags=None, unit: str = "amx") -> bool:
    """Whether the fused scan on ``unit`` can run here: the unit's features in ``flags`` (the
    CPU's by default), the module built and, for AMX, the tile state granted."""
    f = frozenset(cpu_features().flags if flags is None else flags)
    if not UNIT_FLAGS[unit] <= f or _library() is None:
        return False
    return unit != "amx" or _tiles_granted()


def runnable_units(flags=None) -> list[str]:
    """The fused scans that can run here (:func:`available` per unit)."""
    return [u for u in UNITS if available(flags, u)]


def pack_query(codes: np.ndarray, n_codes: int, unit: str = "amx") -> Packed:
    """The query's int8 codes ``[n_codes * m, dim]`` (level-major, as
    :func:`index.int8scan.quantized_queries` gives them) in ``unit``'s layout, zero padded to
    whole groups of query columns and whole steps of components:

    - ``amx``: the tiles' B operand, ``[group][level][k block][16 rows of 4-byte groups]
      [16 columns x 4 bytes]``, int8;
    - ``vnni``: ``[group][level][4-byte group][32 columns][4 bytes]``, each code + 128 as uint8
      (``VPDPBUSD``'s unsigned operand; padding stays 0, so it adds nothing);
    - ``avx2``: ``[group][level][4-byte group][16 columns][4 bytes]``, int8 in ``-127..127``
      (``VPSIGNB`` cannot negate ``-128``: refused).
    """
    cols, step = _SHAPE[unit]
    m = len(codes) // n_codes
    dim = codes.shape[1]
    n_groups, n_k = -(-m // cols), -(-dim // step)
    dtype = np.uint8 if unit == "vnni" else np.int8
    q = np.zeros((n_codes, n_groups * cols, n_k * step), dtype)
    c = np.asarray(codes, np.int8).reshape(n_codes, m, dim)
    if unit == "avx2" and (c == -128).any():
        raise ValueError("the AVX2 scan takes query codes in -127..127 (int8scan.quantized_queries' range)")
    q[:, :m, :dim] = (c.astype(np.int16) + 128).astype(np.uint8) if unit == "vnni" else c
    if unit == "amx":
        # [level, group, column, k block, row, byte] -> [group, level, k block, row, column, byte]
        q = q.reshape(n_codes, n_groups, cols, n_k, step // 4, 4).transpose(1, 0, 3, 4, 2, 5)
    else:
        # [level, group, column, 4-byte group, byte] -> [group, level, 4-byte group, column, byte]
        q = q.reshape(n_codes, n_groups, cols, n_k, 4).transpose(1, 0, 3, 2, 4)
    return Packed(unit, np.ascontiguousarray(q), n_groups, n_k)


def docmax(packed: Packed, n_codes: int, weights: np.ndarray, m: int,
           vectors: np.ndarray, scales: np.ndarray | None, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """``float32 [n_docs, m]``: per document (rows ``starts[d]:ends[d]`` of ``vectors``, each
    non-empty) and query column ``i``, ``max_j s_j sum_l weights[l] <k_{l,i}, c_j>``.

    Args:
        packed: :func:`pack_query`'s result (its unit runs the scan).
        n_codes: code levels per query component (1-3).
        weights: ``float32 [n_codes]``, each level's weight (the first must be 1).
        m: query columns (tokens).
        vectors: int8 codes ``[n_rows, dim]``, C-contiguous (a read-only mapping is fine).
        scales: their ``float32 [n_rows]`` scales, or ``None`` (1).
        starts, ends: ``int64 [n_docs]`` each document's rows.
    """
    if not available(unit=packed.unit):
        raise RuntimeError(f"the fused {packed.unit} scan is not available here")
    fn = getattr(_library(), _FUNCTIONS[packed.unit])
    if not vectors.flags.c_contiguous or vectors.dtype != np.int8:
        raise ValueError("the fused scan reads C-contiguous int8 codes")
    starts = np.ascontiguousarray(starts, np.int64)
    ends = np.ascontiguousarray(ends, np.int64)
    w = np.ascontiguousarray(weights, np.float32)
    if len(w) != n_codes or w[0] != 1:
        raise ValueError("one weight per code level, the first 1")
    sc = None if scales is None else np.ascontiguousarray(scales, np.float32)
    if sc is not None and len(sc) != len(vectors):
        raise ValueError("one scale per row of codes")
    out = np.empty((len(starts), packed.n_groups * _SHAPE[packed.unit][0]), np.float32)
    if len(starts):
        rc = fn(vectors.ctypes.data, len(vectors), vectors.shape[1], None if sc is None else sc.ctypes.data,
                starts, ends, len(starts), packed.array.ctypes.data, packed.n_groups, n_codes, packed.n_k,
                w.ctypes.data, out.ctypes.data)
        if rc != 0:
            raise MemoryError("the fused scan could not allocate its buffers")
    return out[:, :m]
