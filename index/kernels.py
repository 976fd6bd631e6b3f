"""Chunk kernels of exact MaxSim, and the choice among them for the CPU they run on.

:func:`embedpool.index.maxsim.maxsim_scores` cuts the stored token codes into cache-sized chunks
aligned to document boundaries. A kernel (:func:`prepare`) turns one chunk ``[T, dim]`` of codes
(float32, float16, or int8 with one float32 scale per row) into the similarity block of all query
tokens; ``maxsim_scores`` reduces it (max per document, sum per query). The kernels
(:data:`KERNELS`):

- ``numpy``: the portable path. The chunk is converted into a reused float32 buffer and
  multiplied by BLAS (whatever numpy links). Exact up to float32 rounding; runs everywhere.
- ``mlas-f32``: ONNX Runtime's MLAS. One session run per chunk casts the chunk to float32 (a
  chunk-sized, cache-resident buffer owned by ONNX Runtime) and multiplies it by MLAS' sgemm;
  chunks run on worker threads. Exact up to float32 rounding, like ``numpy``.
- ``mlas-int8x3``: ONNX Runtime ``MatMulInteger`` on the int8 codes themselves, with no float copy
  of them: the codes enter as uint8 (XOR 0x80, zero point 128) and the query as int8 codes, so
  MLAS runs its int8 kernel for the CPU (AMX tiles, AVX-512 VNNI ``vpdpbusd``, AVX-VNNI; on a CPU
  without VNNI its exact 16-bit ``vpmaddwd`` kernel). Each query component is three int8 codes,
  ``q = s * (c0 + c1 / 254 + c2 / 254**2)`` with ``s = max|q| / 127``: the query's error per
  component is at most ``s / (2 * 254**2)``, below float32 query math's own rounding at the
  scores' scale, so int8 storage still rounds only the documents, as with the float kernels.
- ``mlas-int8``: the same with one int8 code per query component (a third of the multiply-adds);
  each query component moves by up to ``s / 2``, so scores differ from float32 query math by the
  query's int8 rounding, at most ``sum_i s_i / 2 * max_j ||d_j||_1``. Opt-in.

- ``amx-int8x3`` / ``vnni-int8x3`` / ``avx2-int8x3``: the int8 scan fused on AMX tiles / on
  AVX-512 VNNI / on AVX2 (:mod:`index.amxscan`, a compiled module, optional) with the query as
  three int8 codes per component, as ``mlas-int8x3``: products, row scales and per-document maxima
  in one pass over the codes, no similarity block in memory. Not chunk kernels:
  :func:`index.maxsim.maxsim_scores` hands them the whole scan. ``auto`` never picks
  ``avx2-int8x3`` (three codes are three times the AVX2 scan's multiply-adds, more than
  ``mlas-f32``'s); it is there to be asked for by name and measured.

``auto`` (:func:`choose`): ``amx-int8x3`` for int8 codes on AMX CPUs where the module is built and
the tile state granted; ``vnni-int8x3`` on other AVX-512 VNNI CPUs (AMX ones included) where the
module is built (178–193 vs 476–483 ms for ``mlas-f32`` per query over 1 GB on the AMX Xeon's VNNI units);
``mlas-int8x3`` on AMX CPUs without the module; ``mlas-f32`` on every other AVX2 or AVX-512 CPU (on
AVX2 int8 products are no faster than float32 FMAs, and VNNI through MLAS does not pay for three
query codes); ``numpy`` without AVX2 or without ONNX Runtime. Measured on AVX2 (AMD EPYC Zen 1),
AVX-512 VNNI/BF16 without AMX (Xeon) and AMX (Xeon) by ``bench/maxsim.py`` (README "MaxSim
kernels").

Exact *top-k* MaxSim (what ``exhaustive`` search and large candidate reranks ask for) has a
second choice, :func:`choose_scan`: ``amx`` -- the int8 scan of :mod:`index.int8scan` fused on
AMX tiles (:mod:`index.amxscan`) -- on AMX CPUs where the compiled module is built; ``vnni`` --
the same scan fused on AVX-512 VNNI -- on other AVX-512 VNNI CPUs where it is built; ``avx2`` --
the same scan fused on AVX2's ``VPMADDUBSW`` / ``VPMADDWD`` -- on every other CPU with AVX2 and
FMA where it is built (AVX2-only CPUs, AVX-VNNI ones); ``int8`` -- the same scan with torch's
oneDNN int8 products, whose proven error bound lets it score only the documents that could be in
the top k exactly -- on CPUs with int8 dot-product units without the compiled module, where
torch's int8 matmul is exact; ``exact`` (the kernel above on every document) elsewhere.

:func:`choose` is pure (precision and CPU flags in, kernel and reason out), so tests pin every
decision by injecting flags; :func:`embedpool.cpu.cpu_features` reads the real ones
(``/proc/cpuinfo`` and, where torch is loaded or the flags cannot be read,
``torch.backends.cpu.get_cpu_capability()``).

Design note: DESIGN.md lists numpy, faiss, sqlite3 and pymilvus as the libraries of ``index/``.
ONNX Runtime is added here as an optional, lazily imported accelerator -- a deliberate change. It
is already a dependency of the project (the encoder's ONNX paths). Without it every precision
takes ``numpy``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from importlib.util import find_spec

import numpy as np

from embedpool.cpu import cpu_features
from embedpool.errors import InvalidError

from .amxscan import UNIT_FLAGS

KERNELS: dict[str, str] = {
    "numpy": "float32 conversion into a reused buffer + BLAS sgemm (portable)",
    "mlas-f32": "ONNX Runtime: cast to float32 per chunk + MLAS sgemm, chunks on worker threads",
    "mlas-int8x3": "ONNX Runtime MatMulInteger on the int8 codes, query as three int8 codes per component",
    "mlas-int8": "ONNX Runtime MatMulInteger on the int8 codes, query as one int8 code per component",
    "amx-int8x3": "the int8 scan fused on AMX tiles (index/amxscan.py), query as three int8 codes per component",
    "vnni-int8x3": "the int8 scan fused on AVX-512 VNNI (index/amxscan.py), query as three int8 codes per component",
    "avx2-int8x3": "the int8 scan fused on AVX2 (index/amxscan.py), query as three int8 codes per component",
}
INT8_KERNELS = {"mlas-int8x3": 3, "mlas-int8": 1, "amx-int8x3": 3, "vnni-int8x3": 3, "avx2-int8x3": 3}  # name -> query codes
FUSED_KERNELS = {"amx-int8x3": "amx", "vnni-int8x3": "vnni", "avx2-int8x3": "avx2"}  # name -> the unit of index/amxscan.py
_STEP = 254.0  # each further query code's step is 1/254 of the one before: |code| <= 127


# ---------------------------------------------------------------------------- the CPU and the choice
def int8_units(flags: Iterable[str]) -> str | None:
    """The int8 matrix units ONNX Runtime's MLAS uses on a CPU with ``flags``: ``amx``,
    ``avx512_vnni`` (with AVX-512 BW/DQ/VL, as MLAS requires), ``avx_vnni`` -- or ``None``."""
    f = frozenset(flags)
    if {"amx_tile", "amx_int8"} <= f:
        return "amx"
    if {"avx512_vnni", "avx512bw", "avx512dq", "avx512vl"} <= f:
        return "avx512_vnni"
    if "avx_vnni" in f:
        return "avx_vnni"
    return None


def choose(precision: str, flags: Iterable[str], capability: str = "unknown",
           onnxruntime: bool = True, amx_kernel: bool = False, vnni_kernel: bool = False) -> tuple[str, str]:
    """``(kernel, reason)`` for codes of ``precision`` on a CPU with ``flags``.

    Args:
        precision: the stored codes' precision (``float32``, ``float16``, ``int8``).
        flags: the CPU's feature flags (``/proc/cpuinfo``).
        capability: ``torch.backends.cpu.get_cpu_capability()`` where known (``AVX2``, ``AVX512``).
        onnxruntime: whether ONNX Runtime is installed.
        amx_kernel: whether the fused AMX scan is built and granted the tile state here
            (:func:`index.amxscan.available`).
        vnni_kernel: whether the fused AVX-512 VNNI scan is built here (it runs where ``flags``
            have AVX-512 VNNI).
    """
    f = frozenset(flags)
    if precision == "int8" and int8_units(f) == "amx" and amx_kernel:
        return "amx-int8x3", ("AMX int8 tiles and the fused scan built: products, scales and per-document maxima "
                              "in one pass over the codes, three int8 query codes (float32 query accuracy); "
                              "measured against mlas-int8x3 by bench/maxsim.py")
    if precision == "int8" and vnni_kernel and UNIT_FLAGS["vnni"] <= f:
        return "vnni-int8x3", ("AVX-512 VNNI and the fused scan built: products, scales and per-document maxima in "
                               "one pass over the codes, three int8 query codes (float32 query accuracy); "
                               "measured against mlas-f32 by bench/maxsim.py")
    if not onnxruntime:
        return "numpy", "ONNX Runtime is not installed: the portable numpy/BLAS path"
    if "avx2" not in f and not capability.upper().startswith(("AVX2", "AVX512")):
        return "numpy", "no AVX2: the portable numpy/BLAS path (MLAS not measured on such CPUs)"
    units = int8_units(f)
    if precision == "int8" and units == "amx":
        return "mlas-int8x3", ("AMX int8 tiles: MLAS int8 on the codes, no float copy; ~32x the float32 FMA rate "
                               "pays for three int8 query codes (float32 query accuracy; measured on an AMX Xeon, "
                               "bench/maxsim.py: 476 ms vs mlas-f32 499 ms per query over 1 GB)")
    if precision == "int8" and units:
        why = (f"{units} without AMX: int8 MACs at 2-4x the float32 FMA rate do not pay for three int8 query "
               "codes (the accurate int8 kernel); MLAS sgemm on cast chunks measured fastest at float32 "
               "accuracy on an AVX-512 VNNI Xeon (bench/maxsim.py: 572 vs 652 ms per query over 1 GB)")
    elif precision == "int8":
        why = ("no VNNI/AMX: int8 products (vpmaddwd) and float32 FMAs both do 8 multiply-adds per cycle per "
               "core (AVX2, Zen 1), so int8 saves no arithmetic; MLAS sgemm on cast chunks measured "
               "fastest at float32 accuracy (bench/maxsim.py)")
    else:
        why = "MLAS sgemm on chunks cast in cache, on worker threads: measured fastest on AVX2 (bench/maxsim.py)"
    return "mlas-f32", why


def auto_choice(precision: str) -> tuple[str, str]:
    """``(kernel, why)`` that ``auto`` runs for ``precision`` on this CPU and build (:func:`choose`
    with what is installed and usable here)."""
    cpu = cpu_features()
    amx = precision == "int8" and int8_units(cpu.flags) == "amx" and _fused_available("amx")
    vnni = precision == "int8" and not amx and _fused_available("vnni")
    return choose(precision, cpu.flags, cpu.capability, find_spec("onnxruntime") is not None, amx, vnni)


def resolve(kernel: str, precision: str) -> str:
    """The kernel ``maxsim_scores`` runs for ``kernel`` (``auto`` or a name of :data:`KERNELS`)."""
    if kernel == "auto":
        return auto_choice(precision)[0]
    if kernel not in KERNELS:
        raise InvalidError(f"unknown MaxSim kernel {kernel!r}; use auto or one of {', '.join(KERNELS)}", param="kernel")
    if kernel in INT8_KERNELS and precision != "int8":
        raise InvalidError(f"MaxSim kernel {kernel!r} scores int8 codes, not {precision}", param="kernel")
    unit = FUSED_KERNELS.get(kernel)
    if unit and not _fused_available(unit):
        raise InvalidError(f"MaxSim kernel {kernel!r} needs a CPU with {_UNIT_NAMES[unit]} and the compiled module "
                           "(embedpool.index._amxscan); use auto or another kernel", param="kernel")
    return kernel


_UNIT_NAMES = {"amx": "AMX int8", "vnni": "AVX-512 VNNI", "avx2": "AVX2 and FMA"}


def _fused_available(unit: str) -> bool:
    from . import amxscan

    return amxscan.available(unit=unit)


SCANS: dict[str, str] = {
    "amx": "the int8 scan fused on AMX tiles (products, scales and per-document maxima in one pass: "
           "index/amxscan.py), then exact scores of the documents it cannot rule out",
    "vnni": "the same scan fused on AVX-512 VNNI (VPDPBUSD; index/amxscan.py), then exact scores of the "
            "documents it cannot rule out",
    "avx2": "the same scan fused on AVX2 (VPMADDUBSW + VPMADDWD; index/amxscan.py), then exact scores of the "
            "documents it cannot rule out",
    "int8": "int8 scan with a proven error bound (oneDNN int8 through torch), then exact scores of the "
            "documents it cannot rule out (index/int8scan.py)",
    "exact": "the exact kernel on every document (portable)",
}


def choose_scan(precision: str, flags: Iterable[str], torch_int8: bool = True,
                amx_scan: bool = False, vnni_scan: bool = False, avx2_scan: bool = False) -> tuple[str, str]:
    """``(scan, reason)`` of exact top-k MaxSim (:func:`index.int8scan.maxsim_topk`) for codes of
    ``precision`` on a CPU with ``flags``.

    Args:
        precision: the stored codes' precision.
        flags: the CPU's feature flags (``/proc/cpuinfo``).
        torch_int8: whether torch is installed and its int8 matmul is exact on this CPU
            (:func:`index.int8scan.int8_matmul_is_exact`).
        amx_scan: whether the fused AMX scan is built and granted the tile state here
            (:func:`index.amxscan.available`; it is only asked on AMX CPUs).
        vnni_scan: whether the fused AVX-512 VNNI scan is built here (it runs where ``flags``
            have AVX-512 VNNI: :func:`index.amxscan.available` with ``unit="vnni"``).
        avx2_scan: whether the fused AVX2 scan is built here (it runs where ``flags`` have AVX2
            and FMA: :func:`index.amxscan.available` with ``unit="avx2"``).
    """
    units = int8_units(flags)
    f = frozenset(flags)
    if precision != "int8":
        return "exact", f"{precision} codes: no int8 products to run (the exact kernel on every document)"
    if units == "amx" and amx_scan:
        return "amx", ("AMX int8 tiles: the fused scan keeps the products in the tiles and takes the per-document "
                       "maxima as they are made, so the scan runs near the speed of reading the codes "
                       "(bench/maxsim.py)")
    if vnni_scan and UNIT_FLAGS["vnni"] <= f:
        return "vnni", ("AVX-512 VNNI: the fused scan multiplies each code row, broadcast from the mapped codes, by "
                        "32 query columns per VPDPBUSD pair and takes the per-document maxima in registers, with "
                        "no product array in memory: an exact top 10 3.2-3.7x faster than through the library "
                        "scan (bench/maxsim.py)")
    if avx2_scan and UNIT_FLAGS["avx2"] <= f:
        return "avx2", ("AVX2 without a usable AMX or AVX-512 VNNI scan: the scan fused on VPMADDUBSW + VPMADDWD "
                        "(the sign moved from the codes to the query, so no int16 sum saturates) multiplies each "
                        "code row by 16 query columns at a time and takes the per-document maxima in registers, "
                        "with no product array in memory, then scores the documents it cannot rule out exactly "
                        "(bench/maxsim.py --scan-vs-read)")
    if units is None:
        return "exact", ("no VNNI/AMX and no fused AVX2 scan (not built, or no AVX2): torch's int8 products run at "
                         "the float32 FMA rate (vpmaddwd) through memory, the scan would not pay for its second pass "
                         "(the exact kernel on every document)")
    if not torch_int8:
        return "exact", f"{units}, but torch's int8 matmul is missing or not exact here (the exact kernel)"
    why = "" if units not in ("amx", "avx512_vnni") else " (the fused scan is not built or not usable here)"
    return "int8", (f"{units}: int8 dot products at 4x the float32 FMA rate; the int8 scan bounds every score, "
                    f"then the documents it cannot rule out are scored exactly (bench/maxsim.py){why}")


def resolve_scan(scan: str, precision: str) -> str:
    """The scan :func:`index.int8scan.maxsim_topk` runs for ``scan`` (``auto`` or a name of
    :data:`SCANS`)."""
    if scan == "auto":
        from . import amxscan
        from .int8scan import int8_matmul_is_exact

        flags = cpu_features().flags
        units = int8_units(flags) if precision == "int8" else None
        amx_ok = units == "amx" and amxscan.available(flags)
        vnni_ok = units is not None and not amx_ok and amxscan.available(flags, "vnni")
        avx2_ok = precision == "int8" and not (amx_ok or vnni_ok) and amxscan.available(flags, "avx2")
        torch_ok = units is not None and not (amx_ok or vnni_ok or avx2_ok) and int8_matmul_is_exact()
        return choose_scan(precision, flags, torch_ok, amx_ok, vnni_ok, avx2_ok)[0]
    if scan not in SCANS:
        raise InvalidError(f"unknown MaxSim scan {scan!r}; use auto or one of {', '.join(SCANS)}", param="scan")
    if scan != "exact" and precision != "int8":
        raise InvalidError(f"the {scan} MaxSim scan reads int8 codes, not {precision}", param="scan")
    if scan in _UNIT_NAMES and not _fused_available(scan):
        raise InvalidError(f"the {scan} MaxSim scan needs a CPU with {_UNIT_NAMES[scan]} and the compiled module "
                           "(embedpool.index._amxscan); use auto, int8 or exact", param="scan")
    return scan


# ---------------------------------------------------------------------------- threads and buffers
_local = threading.local()
_pool_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (size, pool), grown on demand


def workers() -> int:
    """Worker threads of the threaded kernels: the CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def run_parallel(fn: Callable[[object], None], items: Sequence[object], n_workers: int) -> None:
    """``fn(item)`` for every item, on up to ``n_workers`` threads (inline for one)."""
    global _pool
    if n_workers <= 1 or len(items) <= 1:
        for it in items:
            fn(it)
        return
    with _pool_lock:
        if _pool is None or _pool[0] < n_workers:
            _pool = (n_workers, ThreadPoolExecutor(max_workers=n_workers, thread_name_prefix="maxsim"))
        pool = _pool[1]
    for _ in pool.map(fn, items):
        pass


def scratch(name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    """A reused per-thread buffer of at least ``shape`` (its contents are undefined)."""
    size = int(np.prod(shape))
    buf = getattr(_local, name, None)
    if buf is None or buf.dtype != dtype or buf.size < size:
        buf = np.empty(max(size, 1), dtype=dtype)
        setattr(_local, name, buf)
    return buf[:size].reshape(shape)


# ---------------------------------------------------------------------------- ONNX Runtime sessions
@lru_cache(maxsize=None)
def _session(kind: str, dtype: str):
    """An ONNX Runtime session (run on the calling thread only) for ``kind`` on ``dtype`` codes:
    ``f32`` (Cast + MatMul: ``[T, D] x [D, M] -> float32 [T, M]``), ``u8u8`` / ``u8s8``
    (MatMulInteger of uint8 ``[T, D]`` with zero point 128 and the query ``[D, M]`` with zero
    point 128 / 0: ``int32 [T, M]``). The elementwise work around them stays in numpy: ONNX
    Runtime's BitwiseXor/Cast/Mul/Transpose in the same graph were slower (measured)."""
    import onnxruntime as ort
    from onnx import TensorProto as TP
    from onnx import helper

    vi = helper.make_tensor_value_info
    if kind == "f32":
        elem = {"float32": TP.FLOAT, "float16": TP.FLOAT16, "int8": TP.INT8}[dtype]
        nodes = [helper.make_node("MatMul", ["Af" if elem != TP.FLOAT else "A", "B"], ["Y"])]
        if elem != TP.FLOAT:
            nodes.insert(0, helper.make_node("Cast", ["A"], ["Af"], to=TP.FLOAT))
        ins, out, inits = [vi("A", elem, ["T", "D"]), vi("B", TP.FLOAT, ["D", "M"])], TP.FLOAT, []
    else:
        belem = TP.UINT8 if kind == "u8u8" else TP.INT8
        nodes = [helper.make_node("MatMulInteger", ["A", "B", "azp", "bzp"], ["Y"])]
        ins, out = [vi("A", TP.UINT8, ["T", "D"]), vi("B", belem, ["D", "M"])], TP.INT32
        inits = [helper.make_tensor("azp", TP.UINT8, [], [128]),
                 helper.make_tensor("bzp", belem, [], [128 if kind == "u8u8" else 0])]
    graph = helper.make_graph(nodes, "maxsim_chunk", ins, [vi("Y", out, ["T", "M"])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1  # parallelism is over chunks (run_parallel), not inside a product
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@lru_cache(maxsize=1)
def _signed_query_is_exact() -> bool:
    """Whether MLAS' u8s8 kernel is exact here: it saturates int16 pair sums on CPUs without
    VNNI/AMX, so the flags' word is checked on a worst case (u8 255 x s8 127)."""
    a = np.full((4, 64), 255, np.uint8)
    b = np.full((64, 4), 127, np.int8)
    y = _session("u8s8", "int8").run(None, {"A": a, "B": b})[0]
    return bool((y == 127 * 127 * 64).all())


def _int8_query_kind() -> str:
    return "u8s8" if int8_units(cpu_features().flags) and _signed_query_is_exact() else "u8u8"


# ---------------------------------------------------------------------------- kernels
@dataclass
class Prepared:
    """A kernel bound to one batch of stacked query tokens ``[m, dim]``.

    ``score(block, scales)`` returns the similarities of one chunk, ``[m, T]`` if
    ``tokens_axis == 1`` else ``[T, m]``, per-row int8 scales applied; ``col_scale`` (``[m]``,
    positive, or ``None``) multiplies each query token's per-document maxima after the max."""

    name: str
    score: Callable[[np.ndarray, np.ndarray | None], np.ndarray]
    tokens_axis: int
    col_scale: np.ndarray | None
    bytes_per_token: int
    n_workers: int


def quantize_query(q: np.ndarray, n_codes: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``(codes [dim, n_codes * m] int8, scales [m])`` of query tokens ``q [m, dim]``: per token
    symmetric int8 codes ``c0``, then ``n_codes - 1`` codes of the rounding residual, each with a
    step 1/254 of the one before: ``q ~ s * sum_k c_k / 254**k``, ``|c_k| <= 127``."""
    q = np.asarray(q, dtype=np.float64)
    amax = np.abs(q).max(axis=1) if q.size else np.zeros(len(q))
    s = np.where(amax > 0, amax / 127.0, 1.0)
    x, parts = q / s[:, None], []
    for _ in range(n_codes):
        c = np.rint(x)
        parts.append(c)
        x = (x - c) * _STEP
    return np.ascontiguousarray(np.concatenate(parts, axis=0).T.astype(np.int8)), s.astype(np.float32)


def prepare(kernel: str, q: np.ndarray, dtype: np.dtype) -> Prepared:
    """Bind ``kernel`` (a name of :data:`KERNELS`) to the stacked float32 query tokens ``q [m, dim]``
    for codes of ``dtype``."""
    m, dim = q.shape
    dtype = np.dtype(dtype)
    if kernel == "numpy":
        return Prepared(kernel, _numpy_kernel(q, dtype), 1, None, 4 * (m + dim), 1)
    if kernel == "mlas-f32":
        sess, qt = _session("f32", dtype.name), np.ascontiguousarray(q.T)

        def score_f32(block, sc):
            y = sess.run(None, {"A": block, "B": qt})[0]  # [T, m]
            if sc is not None:
                y *= sc[:, None]
            return y

        per_token = dim * dtype.itemsize + 4 * dim + 4 * m  # the codes, their float32 cast, the products
        return Prepared(kernel, score_f32, 0, None, per_token, workers())
    n_codes = INT8_KERNELS[kernel]
    kind = _int8_query_kind()
    codes, qs = quantize_query(q, n_codes)
    b = codes.view(np.uint8) ^ np.uint8(0x80) if kind == "u8u8" else codes
    sess = _session(kind, "int8")

    def score_int8(block, sc):
        u = scratch("u8", block.shape, np.uint8)
        np.bitwise_xor(block.view(np.uint8), np.uint8(0x80), out=u)
        y = sess.run(None, {"A": u, "B": b})[0]  # int32 [T, n_codes * m], exact
        sim = scratch("sim", (len(block), m), np.float32)
        if n_codes == 1:
            np.multiply(y, 1.0 if sc is None else sc[:, None], out=sim, dtype=np.float32, casting="unsafe")
            return sim
        sim[...] = y[:, (n_codes - 1) * m:]
        for k in range(n_codes - 2, -1, -1):  # finest code first: sim = c0 + (c1 + c2 / 254) / 254
            np.multiply(sim, np.float32(1.0 / _STEP), out=sim)
            np.add(sim, y[:, k * m:(k + 1) * m], out=sim, dtype=np.float32, casting="unsafe")
        if sc is not None:
            sim *= sc[:, None]
        return sim

    # the codes, their uint8 form, the int32 products, the float32 similarities
    return Prepared(kernel, score_int8, 0, qs, 2 * dim + 4 * (n_codes + 1) * m, workers())


def _numpy_kernel(q: np.ndarray, dtype: np.dtype) -> Callable[[np.ndarray, np.ndarray | None], np.ndarray]:
    m, dim = q.shape

    def score(block, sc):
        if block.dtype != np.float32:
            f = scratch("f32", block.shape, np.float32)
            f[...] = block
        else:
            f = block
        if sc is not None and m >= dim:  # cheaper to scale the [T, dim] tokens than [m, T]
            f = np.multiply(f, sc[:, None], out=f if f is not block else None)
        sim = q @ f.T  # [m, T]: reducing along the contiguous axis is much faster
        if sc is not None and m < dim:
            sim *= sc[None, :]
        return sim

    return score
