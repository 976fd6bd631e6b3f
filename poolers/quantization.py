"""Output precision: the last post-processing step, after Matryoshka truncation and normalization.

``float32`` (as computed), ``float16``, and sentence-transformers' quantizations ``int8``,
``uint8``, ``binary`` and ``ubinary``, computed by sentence-transformers' own
``quantize_embeddings`` (the semantics users know from ``encode(precision=...)``; not written
again here):

* ``binary`` / ``ubinary``: one bit per dimension (``x > 0``), packed 8 per byte, big-endian
  bit order (``np.packbits``); ``binary`` stores each byte minus 128 as ``int8``.
* ``int8`` / ``uint8``: per dimension ``d``, ``floor((x - lo_d) / ((hi_d - lo_d) / 255))``
  clipped to ``[0, 255]`` (``int8``: minus 128), for ranges ``[[lo_d ...], [hi_d ...]]``.

Calibrating the int8 ranges
---------------------------
sentence-transformers takes the ranges from the batch being quantized when it is given none.
A server must not do that: a text's int8 vector would then depend on the other texts of its
request (and on how the server batched them), so two requests could give the same text two
codes, and codes from different requests would not be comparable. Here the ranges are always
fixed before the vectors are seen: :func:`unit_ranges` (``[-1, 1]`` in every dimension, the
bounds of any coordinate of a vector of norm at most 1, which every normalized output is) unless
the caller passes its own, e.g. calibrated once on its corpus (sentence-transformers:
``calibration_embeddings``). Vectors that are not normalized have no such bound: they need
explicit ranges (:func:`quantize_output` raises otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from embedpool.precisions import OUTPUT_PRECISIONS

#: numpy dtype of each precision's codes (what base64 carries)
DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "int8": np.dtype("i1"),
          "uint8": np.dtype("u1"), "binary": np.dtype("i1"), "ubinary": np.dtype("u1")}


def unit_ranges(dim: int) -> np.ndarray:
    """The default int8/uint8 ranges: ``[-1, 1]`` in each of ``dim`` dimensions, ``[2, dim]``."""
    return np.stack([np.full(dim, -1.0, np.float32), np.full(dim, 1.0, np.float32)])


def quantize_output(vectors: Sequence[np.ndarray], precision: str,
                    ranges: np.ndarray | None = None) -> list[np.ndarray]:
    """Convert float32 embeddings to ``precision``.

    Args:
        vectors: one ``[D]`` array per text (single-vector) or one ``[n_i, D]`` per text
            (multi-vector), float32.
        precision: one of :data:`OUTPUT_PRECISIONS`.
        ranges: ``[2, D]`` per-dimension minimum and maximum for ``int8`` / ``uint8``
            (required for those; see the module docstring for why there is no default here).

    Returns:
        The same structure with the precision's dtype (see :data:`DTYPES`).
    """
    if precision not in OUTPUT_PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(OUTPUT_PRECISIONS)}, got {precision!r}")
    vectors = [np.asarray(v, dtype=np.float32) for v in vectors]
    if precision == "float32" or not vectors:
        return vectors
    if precision == "float16":
        return [v.astype(np.float16) for v in vectors]
    if precision.endswith("int8"):
        if ranges is None:
            raise ValueError(f"{precision} needs ranges (per-dimension minimum and maximum)")
        ranges = np.asarray(ranges, dtype=np.float32)
    from sentence_transformers.util.quantization import quantize_embeddings

    if vectors[0].ndim == 1:  # single-vector: one call on the [N, D] matrix
        codes = quantize_embeddings(np.stack(vectors), precision=precision, ranges=ranges)
        return list(codes)
    return list(quantize_embeddings(vectors, precision=precision, ranges=ranges))
