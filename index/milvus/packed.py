"""Packed document rows of a multi-vector Milvus collection (layout 2, :mod:`.schema`): a
document's token vectors as the bytes :func:`index.maxsim.pack` makes (the storage precision's
codes, then int8 scales -- the codec the FAISS segments use), base64-encoded into ARRAY elements,
split into parts only when one row's ARRAY cannot hold them.

base64 through ``pybase64`` (SIMD): decoding 100 SciFact documents' codes (3.3 MB of text) took
1.5 ms against 11 ms with the standard library's ``base64`` on this machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pybase64

from embedpool.errors import InternalError
from ..maxsim import dequantize, pack, unpack
from .names import pk


@dataclass(frozen=True)
class Packing:
    """How a collection packs documents: its spec's dim and precision, the manifest's layout."""

    dim: int
    precision: str
    element_chars: int
    row_elements: int

    def rows(self, doc_id: str, vectors: np.ndarray, seq: int, text: str | None,
             metadata: Any, counts: dict[str, int] | None = None) -> tuple[list[dict], np.ndarray]:
        """The document's rows (part 0 first; every part also carries ``counts``, such as its
        companion row count) and its stored vectors dequantized (float32: what MaxSim scores,
        for the token rows)."""
        raw = pack(vectors, self.precision)
        enc = pybase64.b64encode(raw).decode("ascii")
        el, per_row = self.element_chars, self.element_chars * self.row_elements
        chunks = [[enc[k:k + el] for k in range(r, min(r + per_row, len(enc)), el)]
                  for r in range(0, len(enc), per_row)]
        n = len(vectors)
        rows = [{"pk": pk(doc_id, p), "doc_id": doc_id, "part": p, "parts": len(chunks), "n": n,
                 "seq": seq, "codes": c, "stub": [1.0, 0.0], "text": text if p == 0 else None,
                 "metadata": metadata if p == 0 else None, **(counts or {})} for p, c in enumerate(chunks)]
        return rows, dequantize(*unpack(raw, n, self.dim, self.precision))

    def row_bytes(self) -> int:
        """The most text one row holds (page sizes of fetches and scans)."""
        return self.element_chars * self.row_elements + 256

    def assemble(self, heads: list[dict], tails: list[dict]) -> tuple[Any, ...]:
        """``(codes [T, dim], scales [T] | None, offsets [n + 1], doc ids [n])`` of the
        documents whose part 0 is in ``heads`` (their other parts in ``tails``), documents in
        id order. A document whose parts disagree (a crash during its upsert) is
        :class:`InternalError`: add it again."""
        rest: dict[str, list[dict]] = {}
        for r in tails:
            rest.setdefault(r["doc_id"], []).append(r)
        heads = sorted(heads, key=lambda r: r["doc_id"])
        codes, scales, lens = [], [], []
        for h in heads:
            parts = [h, *sorted(rest.get(h["doc_id"], []), key=lambda r: r["part"])]
            if [r["part"] for r in parts] != list(range(h["parts"])) or any(r["seq"] != h["seq"] for r in parts):
                raise InternalError(
                    f"document {h['doc_id']!r} has parts of different writes (an interrupted "
                    "upsert); add the document again to repair it")
            c, s = unpack(pybase64.b64decode("".join(e for r in parts for e in r["codes"])),
                          h["n"], self.dim, self.precision)
            codes.append(c)
            scales.append(s)
            lens.append(h["n"])
        offsets = np.zeros(len(heads) + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        if not heads:
            return (np.zeros((0, self.dim), np.dtype(self.precision)), None, offsets,
                    np.array([], dtype=object))
        return (np.concatenate(codes), None if scales[0] is None else np.concatenate(scales), offsets,
                np.array([h["doc_id"] for h in heads], dtype=object))
