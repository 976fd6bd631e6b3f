"""Output precision and encoding of embeddings on the wire (``/embed``, ``/v1/embeddings``).

The quantization itself is the model side's post-processing (:func:`poolers.quantize_output`,
sentence-transformers' ``quantize_embeddings``); this module checks the request's choice before
anything is encoded and turns the codes into JSON numbers or base64.

* ``encoding_format: float``: each vector as a JSON array of numbers (floats for ``float32`` /
  ``float16``, integers for the others); a multi-vector input as an array of such arrays.
* ``encoding_format: base64``: each input as one base64 string of its codes' bytes, row-major,
  little-endian (``float32``: 4 bytes per value, ``float16``: 2, the others 1; binary
  precisions pack 8 dimensions per byte). A multi-vector input's string holds its ``n`` vectors
  one after the other: decode with ``np.frombuffer(...).reshape(-1, width)``.
* int8 / uint8 ranges: ``[-1, 1]`` in every dimension unless the request sends ``ranges``; they
  never come from the request's own vectors (see :mod:`poolers.quantization` for why).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from embedpool.errors import InvalidError
from embedpool.poolers import quantize_output, sparse_entries, unit_ranges
from embedpool.poolers.quantization import DTYPES


def output_ranges(precision: str, ranges: list[list[float]] | None, *, normalize: bool,
                  dim: int) -> np.ndarray | None:
    """The int8/uint8 ranges for a request (``None`` for the other precisions), or 422."""
    if not precision.endswith("int8"):
        if ranges is not None:
            raise InvalidError(f"ranges: only int8 and uint8 use ranges, not {precision}; drop the field",
                               param="ranges")
        return None
    if ranges is None:
        if not normalize:
            raise InvalidError(f"ranges: {precision} of vectors that are not normalized needs explicit ranges "
                               f"(the default [-1, 1] only bounds normalized vectors): send normalize=true, or "
                               f"ranges=[[min per dimension...], [max per dimension...]] with {dim} values each",
                               param="ranges")
        return unit_ranges(dim)
    lengths = [len(r) for r in ranges]
    if lengths != [dim, dim]:  # checked before numpy sees it: a ragged list is no array
        raise InvalidError(f"ranges: expected 2 lists of {dim} numbers (the minimum, then the maximum, of each "
                           f"output dimension), got {len(lengths)} lists of {', '.join(map(str, lengths))} numbers",
                           param="ranges")
    arr = np.asarray(ranges, dtype=np.float64)
    if not np.isfinite(arr).all() or (arr[1] < arr[0]).any():
        raise InvalidError("ranges: every value must be finite, and each maximum at least its minimum",
                           param="ranges")
    return arr.astype(np.float32)


def sparse_vectors(vectors: list[np.ndarray], precision: str, encoding_format: str) -> list[dict[str, list]]:
    """A sparse pooler's vectors as ``{indices, values}`` of their non-zero weights (float32 numbers only:
    the request's other precisions and base64 are a 422); the conversion is :func:`poolers.sparse_entries`,
    which ``embedpool embed`` prints too."""
    if precision != "float32" or encoding_format == "base64":
        raise InvalidError("a sparse pooler (splade) answers indices and values as float32 numbers: leave `precision` "
                           "and `encoding_format` at their defaults", param="precision")
    return sparse_entries(vectors)


def encode_vectors(vectors: list[np.ndarray], precision: str, encoding_format: str,
                   ranges: np.ndarray | None) -> list[Any]:
    """Codes of ``vectors`` in ``precision``, as arrays (JSON numbers) or base64 strings."""
    codes = quantize_output(vectors, precision, ranges)
    if encoding_format != "base64":
        return codes
    dtype = DTYPES[precision]
    return [base64.b64encode(np.ascontiguousarray(c, dtype=dtype).tobytes()).decode("ascii") for c in codes]
