"""Input checks shared by every collection backend (FAISS, Milvus).

Each function validates one argument and raises :class:`InvalidError` or
:class:`ConflictError` with a message saying what is wrong and what to do; on success it
returns the argument in canonical form (lists of str, contiguous float32 arrays, JSON strings).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from embedpool.errors import ConflictError, InvalidError
from .spec import CollectionSpec

NORM_TOL = 1e-2


def preview(items: Sequence[str], n: int = 5) -> str:
    s = ", ".join(repr(i) for i in items[:n])
    return s + (f" and {len(items) - n} more" if len(items) > n else "")


def check_ids(ids: Any, allow_duplicates: bool = False) -> list[str]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise InvalidError("ids must be a list of strings", param="ids")
    ids = list(ids)
    bad = [i for i in ids if not isinstance(i, str) or not i]
    if bad:
        raise InvalidError(f"ids must be non-empty strings; got {preview([repr(b) for b in bad])}", param="ids")
    if not allow_duplicates and len(set(ids)) != len(ids):
        seen: set[str] = set()
        dups = list(dict.fromkeys(i for i in ids if i in seen or seen.add(i)))
        raise InvalidError(
            f"duplicate ids in one batch: {preview(dups)}; each id may appear once per add() call", param="ids")
    return ids


def check_texts(texts: Any, n: int) -> list[str | None]:
    if texts is None:
        return [None] * n
    texts = list(texts)
    if len(texts) != n:
        raise InvalidError(f"{n} ids but {len(texts)} texts", param="texts")
    if any(t is not None and not isinstance(t, str) for t in texts):
        raise InvalidError("texts must be strings or None", param="texts")
    return texts


def check_metadata(metadata: Any, ids: list[str]) -> list[str | None]:
    """Metadata dicts as JSON strings (``None`` stays ``None``)."""
    if metadata is None:
        return [None] * len(ids)
    metadata = list(metadata)
    if len(metadata) != len(ids):
        raise InvalidError(f"{len(ids)} ids but {len(metadata)} metadata entries", param="metadata")
    out = []
    for i, m in zip(ids, metadata):
        if m is None:
            out.append(None)
            continue
        if not isinstance(m, dict):
            raise InvalidError(f"metadata of id {i!r} must be a dict or None", param="metadata")
        try:
            out.append(json.dumps(m, ensure_ascii=False, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise InvalidError(f"metadata of id {i!r} is not JSON-serializable: {e}", param="metadata") from None
    return out


def check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InvalidError(f"{name} must be a positive integer, got {value!r}", param=name)
    return int(value)


def check_model_pooler(spec: CollectionSpec, coll: str, model: str | None, pooler: str | None) -> None:
    """``add(model=..., pooler=...)`` must name the manifest's model and pooler."""
    for field, value in (("model", model), ("pooler", pooler)):
        if value is not None and value != getattr(spec, field):
            raise ConflictError(
                f"collection {coll!r} holds vectors from {field} {getattr(spec, field)!r}, not "
                f"{value!r}; use a collection made for {value!r} (or another collection name)", param=field)


def as_matrix(x: Any, dim: int, what: str, coll: str, ids: list[str] | None = None,
              param: str | None = None) -> np.ndarray:
    """A finite ``float32 [n, dim]`` C-contiguous array, or a clear error about ``param``
    (default: ``what``)."""
    param = param or what
    try:
        a = np.asarray(x)
    except ValueError:
        raise InvalidError(f"{what} must be a 2-D numeric array [n, {dim}]", param=param) from None
    if a.dtype == object or not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
        raise InvalidError(f"{what} must be a 2-D numeric array [n, {dim}] (got dtype {a.dtype})", param=param)
    if a.ndim == 1 and a.size == 0:
        a = a.reshape(0, dim)
    if a.ndim != 2:
        raise InvalidError(f"{what} must be a 2-D array [n, {dim}], got shape {a.shape}", param=param)
    if a.shape[1] != dim:
        raise ConflictError(
            f"{what} have dimension {a.shape[1]} but collection {coll!r} stores {dim}-d vectors; "
            "use the collection's model/pooler (or a collection made for this dimension)", param=param)
    a = np.ascontiguousarray(a, dtype=np.float32)
    if not np.isfinite(a).all():
        row = int(np.flatnonzero(~np.isfinite(a).all(axis=1))[0])
        where = f"the vector of id {ids[row]!r}" if ids is not None and row < len(ids) else f"row {row}"
        raise InvalidError(f"{what}: {where} contains NaN or infinity; nothing was changed", param=param)
    return a


def check_norms(norms: np.ndarray, label, param: str | None = None) -> None:
    bad = np.flatnonzero(np.abs(norms - 1.0) > NORM_TOL)
    if len(bad):
        r = int(bad[0])
        raise ConflictError(
            f"{label(r)} has L2 norm {norms[r]:.4g}, but the collection stores normalized vectors; "
            "L2-normalize the vectors (or create the collection with normalized=False)", param=param)


def check_single_vectors(spec: CollectionSpec, coll: str, vectors: Any, ids: list[str],
                         what: str) -> np.ndarray:
    if isinstance(vectors, (list, tuple)) and vectors and isinstance(vectors[0], np.ndarray) \
            and vectors[0].ndim == 2:
        raise ConflictError(
            f"collection {coll!r} is single-vector: pass one [n, {spec.dim}] array, "
            "not a list of per-document token matrices", param=what)
    x = as_matrix(vectors, spec.dim, what, coll, ids)
    if len(x) != len(ids):
        raise InvalidError(f"{len(ids)} ids but {len(x)} vectors; give one vector per id", param=what)
    if spec.normalized and len(x):
        check_norms(np.linalg.norm(x, axis=1), lambda r: f"vector of id {ids[r]!r}", what)
    return x


def check_multi_vectors(spec: CollectionSpec, coll: str, vectors: Any, ids: list[str] | None,
                        what: str) -> list[np.ndarray]:
    """Per document (``ids`` given) or per query (``ids=None``) a ``float32 [n_i, dim]`` array."""
    if isinstance(vectors, np.ndarray):
        if vectors.ndim == 2:
            raise ConflictError(
                f"collection {coll!r} is multi-vector: pass a list with one "
                f"[n_i, {spec.dim}] array per {'document' if ids is not None else 'query'}", param=what)
        vectors = list(vectors)
    if not isinstance(vectors, (list, tuple)):
        raise InvalidError(f"{what} must be a list of [n_i, {spec.dim}] arrays", param=what)
    if ids is not None and len(vectors) != len(ids):
        raise InvalidError(f"{len(ids)} ids but {len(vectors)} vector sets; give one per id", param=what)
    out = []
    for j, v in enumerate(vectors):
        label = f"document {ids[j]!r}" if ids is not None else f"query {j}"
        x = as_matrix(v, spec.dim, f"{what} of {label}", coll, param=what)
        if not len(x):
            raise InvalidError(f"{what} of {label} is empty: give at least one vector", param=what)
        if ids is not None and spec.normalized:
            check_norms(np.linalg.norm(x, axis=1), lambda r: f"vector {r} of {label}", what)
        out.append(x)
    return out


def topk(scores: np.ndarray, ids: np.ndarray, k: int) -> list[tuple[float, Any]]:
    """Best k (score, id), descending; ties broken by position (stable)."""
    n = len(scores)
    if n == 0:
        return []
    if n > 4 * k:
        part = np.argpartition(-scores, k - 1)[:k]
        order = part[np.lexsort((part, -scores[part]))]
    else:
        order = np.argsort(-scores, kind="stable")[:k]
    return [(float(scores[j]), ids[j].item() if isinstance(ids[j], np.generic) else ids[j])
            for j in order]
