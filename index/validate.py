"""Input checks shared by every collection backend (FAISS, Milvus).

Each function validates one argument and raises :class:`InvalidError` or
:class:`ConflictError` with a message saying what is wrong and what to do; on success it
returns the argument in canonical form (lists of str, contiguous float32 arrays, JSON strings).

What a document may store (:func:`check_document`, the one check of ids and metadata that the
HTTP upsert route, the indexing job's corpus reader and ``add`` itself apply) is what every
backend stores and returns exactly and every JSON answer renders (docs/api.md, "What can be
stored"): an id of 1 to :data:`MAX_ID_BYTES` bytes of valid Unicode; metadata a JSON object of
valid Unicode strings, finite numbers, integers within :data:`INT_MIN` .. :data:`INT_MAX`,
``true``/``false``/``null``, arrays and objects nested at most ``max_metadata_depth`` levels,
at most ``max_metadata_bytes`` bytes as compact JSON, without the reserved top-level key
:data:`filters.DATES_KEY`. Anything else is an :class:`InvalidError` whose ``param`` is the
path of the value at fault (``documents[3].metadata.v``) and whose message names the limit.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from embedpool.errors import ConflictError, InvalidError
from .filters import DATES_KEY
from .spec import CollectionSpec

NORM_TOL = 1e-2

#: The integers every backend stores, filters on and returns exactly: signed 64-bit but for -2^63.
#: The FAISS document store's filter rows are SQLite INTEGERs, Milvus reads JSON integers and
#: expression literals as int64; orjson would render up to 2**64 - 1, but a filter could not reach
#: those; and a Milvus 2.3 server parses the literal -9223372036854775808 as the negation of
#: 9223372036854775808, out of range, so a filter on -2^63 fails there (the range is symmetric).
INT_MIN, INT_MAX = -((1 << 63) - 1), (1 << 63) - 1
#: The deepest metadata (levels of objects and arrays, the metadata object itself level 1) every
#: answer renders: orjson renders 254 levels, and a search answer puts metadata 4 levels down.
MAX_METADATA_DEPTH = 200
#: The largest metadata, as compact UTF-8 JSON, every backend stores: a Milvus JSON field holds
#: 65,536 bytes (Milvus' documentation, "JSON Field", limits).
MAX_METADATA_BYTES = 65_536
#: The longest id every backend stores, in UTF-8 bytes (the Milvus primary key's VARCHAR).
MAX_ID_BYTES = 512
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_SHOWN = 40  # characters of a long key or value a message shows


def check_unicode(value: str, where: str = "", context: str = "") -> str:
    """``value`` if it is valid Unicode, else :class:`InvalidError` about ``where`` (``context``
    starts the message): JSON's
    ``\\ud800`` escape (a lone surrogate) decodes to a string no tokenizer, store or JSON
    encoder downstream can take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        message = (f"not valid Unicode: a lone surrogate {value[e.start]!r} at character {e.start}; send UTF-8 "
                   "text (a \\uXXXX escape outside the BMP needs both halves of its surrogate pair)")
        raise InvalidError(context + (f"{where}: {message}" if where else message), param=where or None) from None
    return value


def _shown(text: str) -> str:
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def _child(path: str, key: str) -> str:
    """The path of ``key`` in the object at ``path``: ``path.key``, or ``path["a key"]``."""
    if _NAME.match(key) and len(key) <= _SHOWN:
        return f"{path}.{key}" if path else key
    return f"{path}[{json.dumps(_shown(key))}]"


def check_document_id(doc_id: Any, path: str = "id", context: str = "") -> str:
    """A document id every backend stores: a non-empty string of valid Unicode, at most
    :data:`MAX_ID_BYTES` bytes as UTF-8 (``context`` starts the message: where the record is)."""
    if not isinstance(doc_id, str) or not doc_id:
        raise InvalidError(f"{context}{path}: an id must be a non-empty string, got {_shown(repr(doc_id))}", param=path)
    check_unicode(doc_id, path, context)
    n = len(doc_id.encode("utf-8"))
    if n > MAX_ID_BYTES:
        raise InvalidError(f"{context}{path}: {_shown(repr(doc_id))} is {n} bytes as UTF-8; an id has at most "
                           f"{MAX_ID_BYTES} bytes (what every backend stores)", param=path)
    return doc_id


def check_metadata_value(metadata: Any, path: str = "metadata", *, max_metadata_depth: int = MAX_METADATA_DEPTH,
                         max_metadata_bytes: int | None = MAX_METADATA_BYTES, context: str = "") -> str | None:
    """One document's metadata as the compact JSON text every backend stores (``None`` stays
    ``None``), or :class:`InvalidError` naming the path of the value at fault and the limit it
    breaks (``context`` starts the message: where the document is). ``max_metadata_bytes``
    ``None``: no size limit (a backend checks its own)."""
    if metadata is None:
        return None

    def bad(where: str, problem: str) -> InvalidError:
        return InvalidError(f"{context}{where}: {problem}", param=where)

    if not isinstance(metadata, dict):
        raise bad(path, f"metadata must be a JSON object or null, got {type(metadata).__name__}")
    depth_limit = min(max_metadata_depth, MAX_METADATA_DEPTH)
    todo: list[tuple[Any, str, int]] = [(metadata, path, 1)]  # a stack, not recursion: any depth is checked
    while todo:
        value, where, depth = todo.pop()
        if isinstance(value, (dict, list, tuple)):
            if depth > depth_limit:
                raise bad(where, f"nested {depth} levels deep (objects and arrays, the metadata object is level 1); "
                                 f"the limit is max_metadata_depth = {depth_limit}")
            if isinstance(value, dict):
                children = []
                for key, v in value.items():
                    if not isinstance(key, str):
                        raise bad(where, f"key {_shown(repr(key))} is {type(key).__name__}; JSON keys are strings")
                    child = _child(where, key)
                    check_unicode(key, child, context)
                    if depth == 1 and key == DATES_KEY:
                        raise bad(child, f"the top-level key {DATES_KEY!r} is reserved (the Milvus backend keeps "
                                         "the instants of date strings under it); use another key")
                    children.append((v, child, depth + 1))
            else:
                children = [(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
            todo.extend(reversed(children))  # the first value at fault in document order is the one named
        elif isinstance(value, str):
            check_unicode(value, where, context)
        elif value is None or isinstance(value, bool):
            continue
        elif isinstance(value, int):
            if not INT_MIN <= value <= INT_MAX:
                raise bad(where, f"the integer {_shown(str(value))} is outside the 64-bit range every backend "
                                 f"stores exactly, -(2^63-1) .. 2^63-1 ({INT_MIN} .. {INT_MAX}); send it as a "
                                 "string (or a float, if approximate is fine)")
        elif isinstance(value, float):
            if not math.isfinite(value):
                shown = "NaN" if value != value else "Infinity" if value > 0 else "-Infinity"
                raise bad(where, f"{shown} is not a finite number: JSON has no NaN or infinity (a literal "
                                 "such as 1e400 overflows to infinity); send a finite number, a string or null")
        else:
            raise bad(where, f"{type(value).__name__} is not a JSON value (object, array, string, number, "
                             "true, false or null)")
    text = json.dumps(metadata, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    if max_metadata_bytes is not None:
        n = len(text.encode("utf-8"))
        if n > max_metadata_bytes:
            raise bad(path, f"{n:,} bytes as compact JSON; the limit is max_metadata_bytes = {max_metadata_bytes:,}")
    return text


def check_document(doc_id: Any, metadata: Any, path: str = "", *, max_metadata_depth: int = MAX_METADATA_DEPTH,
                   max_metadata_bytes: int | None = MAX_METADATA_BYTES, context: str = "") -> str | None:
    """The one check of what a document stores besides its text and vectors, where documents
    enter (an upsert's ``documents[3]``, a corpus record): its id
    (:func:`check_document_id`) and its metadata (:func:`check_metadata_value`, whose JSON text
    it returns), the fields named under ``path``."""
    prefix = f"{path}." if path else ""
    check_document_id(doc_id, prefix + "id", context)
    return check_metadata_value(metadata, prefix + "metadata", max_metadata_depth=max_metadata_depth,
                                max_metadata_bytes=max_metadata_bytes, context=context)


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
    # what every backend stores and every answer renders (:func:`check_metadata_value`); the
    # size is the caller's limit (a backend with one checks its own)
    return [check_metadata_value(m, context=f"id {i!r}: ", max_metadata_bytes=None) for i, m in zip(ids, metadata)]


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


def refuse_sparse_rows(spec: CollectionSpec, coll: str, vectors: Any, what: str) -> None:
    """A dense collection given sparse ``{indices, values}`` rows: :class:`ConflictError` naming ``what``."""
    from .sparse import looks_sparse

    if looks_sparse(vectors):
        shape = f"[n, {spec.dim}] array" if spec.kind == "single" else f"list of [n_i, {spec.dim}] arrays"
        raise ConflictError(
            f"{what}: collection {coll!r} stores dense {spec.dim}-d vectors ({spec.kind}): give a {shape}, not "
            "sparse {indices, values} rows (a sparse pooler's collection is created with kind 'sparse')", param=what)


def check_single_vectors(spec: CollectionSpec, coll: str, vectors: Any, ids: list[str],
                         what: str) -> np.ndarray:
    refuse_sparse_rows(spec, coll, vectors, what)
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
    refuse_sparse_rows(spec, coll, vectors, what)
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
