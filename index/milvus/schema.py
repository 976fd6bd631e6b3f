"""The Milvus schema and indexes of an embedpool collection (layout :data:`LAYOUT`).

* single: one row per document -- ``id`` (VARCHAR primary key = external id), ``seq`` (insertion
  order), ``vector``, ``text`` (nullable), ``metadata`` (nullable JSON).
* sparse: the same row with ``vector`` a ``SPARSE_FLOAT_VECTOR`` (the document's token ids and
  weights, indexed by :data:`.mapping.SPARSE_INDEX`, inner product) and ``nnz`` (INT32, its
  count of non-zero weights: what ``stats()`` sums for bytes per document). Milvus stores no
  empty sparse vector, so a row without a non-zero weight is stored as :func:`empty_row`: token
  id ``dim``, outside the vocabulary, which no query has (every query is checked against it), so
  it adds nothing to a score; :func:`sparse_row` reads it back as an empty row. A server needs
  Milvus 2.4 or later for sparse vectors (:mod:`.versions`).
* on a Milvus without nullable fields (servers before 2.5, :mod:`.versions`), ``text`` and
  ``metadata`` are not nullable: a missing one is stored as ``""`` / ``{}`` and one more field,
  ``nulls`` (INT8), has bit 1 set for a missing text and bit 2 for missing metadata
  (:func:`with_stand_ins`, :func:`text_and_metadata`). Which of the two a collection uses is read
  from its fields when it is opened, so a collection moves with its data to any server version.
* multi, two Milvus collections:

  - the document rows (the collection that carries the manifest): one row per document with its
    token vectors packed in the storage precision (:func:`index.maxsim.pack`: the FAISS
    segments' codes and int8 scales), base64 text in ``codes``, an ARRAY of VARCHAR elements.
    ``pk`` (``<doc id>#<part>``), ``doc_id``, ``part``, ``parts``, ``n`` (the document's vector
    count), ``seq`` (the version: equal on all parts of one write), ``codes``, ``stub`` (Milvus
    needs a vector field to load a collection: a constant 2-d vector, never searched);
    ``text`` and ``metadata`` on part 0. A document whose codes exceed one row
    (:data:`ROW_ELEMENTS` elements of :data:`ELEMENT_CHARS` characters) continues in parts 1, 2, ...
  - the token rows (``<collection>__tokens``; a name :func:`.names.embedpool_name` does not
    decode, so it is never listed): one row per token vector for the token-level ANN index
    (``search(mode="tokens")``) -- ``pk`` (``<doc id>#<pos>``), ``doc_id``, ``vector`` (float32,
    the dequantized codes, indexed with the spec's ``token_factory``).
  - a collection that keeps its companion (``spec.companion_pooler``) also has the companion
    rows (``<collection>__companion``, never listed either): one row per companion vector,
    ``pk`` (``<doc id>#<row>``), ``doc_id``, ``vector`` (``companion_dim``, inner product,
    indexed with the spec's ``companion_factory``); its document rows have one more field,
    ``companion_rows`` (the document's row count, on every part like ``parts`` and ``n``), so
    that replacing or deleting a document deletes exactly its rows. Collections without a
    companion have neither (their schema is unchanged); both are layout 2: whether they exist
    follows from the manifest's ``companion_pooler`` (such a manifest has ``format_version`` 2,
    which an embedpool that knows no companions refuses to open).

Full text (layout 2 still: a collection made without it reads the same): where the spec has an
analyzer and the server has full-text search (``MilvusFeatures.full_text``: Milvus 2.5+, Milvus
Lite), the document rows' ``text`` field is analyzed (:func:`index.lexical.milvus_analyzer`) and
a BM25 function fills the sparse vector field ``sparse`` from it -- Milvus' own BM25; the
manifest records ``milvus_full_text``. Metadata is the user's JSON plus, for its ISO date
strings, their instants under ``_embedpool_dates`` (what date-range filters compare;
:func:`index.filters.milvus_metadata`), which :func:`text_and_metadata` takes out again.

Why base64 in VARCHAR: Milvus Lite 3.2 has no BINARY_VECTOR or bytes field (its error lists BOOL,
INT*, FLOAT, DOUBLE, VARCHAR, JSON, ARRAY, GEOMETRY, TIMESTAMPTZ, FLOAT_VECTOR,
SPARSE_FLOAT_VECTOR), and a VARCHAR must be valid UTF-8 (raw bytes as latin-1 characters were
5x slower to query than base64 ASCII there). Field limits (Milvus docs, limitations page):
VARCHAR max_length 65,535 bytes, ARRAY max_capacity 4,096, 64 MB per insert/query RPC (Milvus
Lite's gRPC: 256 MB). A row holds at most 16 elements (~1 MB of text, 786,384 bytes of codes:
511 float32 384-d vectors), so a fetch page of :data:`FETCH_DOCS` first parts stays within 128 MB
and an insert batch within the RPC limit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..filters import user_metadata
from ..lexical import milvus_analyzer, parse_analyzer
from ..spec import CollectionSpec
from ..validate import MAX_ID_BYTES
from .mapping import index_of, metric
from .versions import MilvusFeatures

MAX_TEXT_BYTES = 65_535
#: Layout version of multi-vector collections, recorded in the manifest (``milvus_layout``).
#: 1 (no key): one row per token vector; 2: packed document rows + token rows.
LAYOUT = 2
ELEMENT_CHARS = 65_532  # base64 characters per ARRAY element: <= 65,535 and a multiple of 4
ROW_ELEMENTS = 16
FETCH_DOCS = 128  # first parts per fetch query: <= 128 rows of <= ~1 MB
TOKENS_SUFFIX = "__tokens"
SPARSE_FIELD = "sparse"  # BM25 vectors of the text (full text)
COMPANION_SUFFIX = "__companion"
NULLS = "nulls"  # without nullable fields: bit 1 = no text, bit 2 = no metadata
NNZ = "nnz"  # sparse: the row's count of non-zero weights
_NO_TEXT, _NO_METADATA = 1, 2


def tokens_name(mname: str) -> str:
    """The Milvus collection of a multi-vector collection's token rows."""
    return mname + TOKENS_SUFFIX


def companion_rows_name(mname: str) -> str:
    """The Milvus collection of the companion rows a multi-vector collection keeps."""
    return mname + COMPANION_SUFFIX


def hidden_names(mname: str) -> tuple[str, ...]:
    """Every Milvus collection that may belong to collection ``mname`` besides itself (dropped
    with it)."""
    return tokens_name(mname), companion_rows_name(mname)


def doc_counts(spec: CollectionSpec) -> tuple[str, ...]:
    """The per-document row counts that every part of a multi-vector document row carries:
    ``parts`` (its document rows), ``n`` (its token rows) and, with a companion,
    ``companion_rows``."""
    return ("parts", "n", "companion_rows") if spec.companion_pooler is not None else ("parts", "n")


def vector_rows(mname: str, spec: CollectionSpec) -> list[tuple[str, CollectionSpec]]:
    """The hidden collections of rows of one vector each that collection ``mname`` of ``spec``
    has, with the spec their vectors are indexed by (:func:`vector_rows_schema`): a multi-vector
    collection's token rows, then its companion rows if it keeps them."""
    if spec.kind != "multi":
        return []
    out = [(tokens_name(mname), spec)]
    if spec.companion_pooler is not None:
        out.append((companion_rows_name(mname), spec.companion_spec()))
    return out


def layout_record() -> dict[str, int]:
    """What the manifest records of the packed layout (read back by the collection, so rows
    written with other limits stay readable)."""
    return {"version": LAYOUT, "element_chars": ELEMENT_CHARS, "row_elements": ROW_ELEMENTS}


def with_stand_ins(row: dict) -> dict:
    """``row`` for a collection without nullable fields: a missing text or metadata becomes
    ``""`` / ``{}`` and ``nulls`` says which were missing."""
    text, meta = row.get("text"), row.get("metadata")
    return {**row, "text": "" if text is None else text, "metadata": {} if meta is None else meta,
            NULLS: (_NO_TEXT if text is None else 0) | (_NO_METADATA if meta is None else 0)}


def text_and_metadata(row: dict) -> tuple[str | None, Any]:
    """``(text, metadata)`` of a row read with its ``nulls`` field (if the collection has one)."""
    nulls = row.get(NULLS) or 0
    return (None if nulls & _NO_TEXT else row.get("text"),
            None if nulls & _NO_METADATA else user_metadata(row.get("metadata")))


def empty_row(dim: int) -> dict[int, float]:
    """The stand-in of a sparse row without a non-zero weight (module docstring)."""
    return {dim: 1.0}


def stored_sparse(row: dict[int, float], dim: int) -> dict[int, float]:
    """A sparse row as a collection of vocabulary ``dim`` stores it (:func:`empty_row` for an empty one)."""
    return row or empty_row(dim)


def sparse_row(stored: dict[int, float], dim: int) -> tuple[Any, Any]:
    """``(indices int64, values float32)`` of a stored sparse row, ascending token ids, without
    :func:`empty_row`'s stand-in."""
    pairs = sorted((int(i), float(v)) for i, v in stored.items() if int(i) < dim)
    return (np.array([i for i, _ in pairs], np.int64), np.array([v for _, v in pairs], np.float32))


def _index(client: Any, field: str, spec: CollectionSpec, features: MilvusFeatures) -> Any:
    index_type, params, _ = index_of(spec)
    features.check_index_type(index_type, "token_factory" if spec.kind == "multi" else "factory")
    index_params = client.prepare_index_params()
    # pymilvus 3 sends build parameters as flat key/values, Milvus Lite 3.2 reads only the legacy
    # "params" JSON key (servers read both): send both
    index_params.add_index(field_name=field, index_type=index_type, metric_type=metric(spec),
                           params={**params, "params": params} if params else {})
    return index_params


def full_text(spec: CollectionSpec, features: MilvusFeatures) -> bool:
    """A collection of ``spec`` made on a Milvus with ``features`` has Milvus' BM25 (its text
    analyzed, a BM25 function, the ``sparse`` field)."""
    return spec.lexical and features.full_text


def schema(client: Any, spec: CollectionSpec, features: MilvusFeatures) -> tuple[Any, Any]:
    """``(schema, index params)`` of the (document-row) Milvus collection for ``spec`` on a
    Milvus with ``features`` (with :func:`full_text`: the analyzed text, its BM25 sparse vectors
    and their index)."""
    from pymilvus import DataType, Function, FunctionType

    sch = client.create_schema(auto_id=False, enable_dynamic_field=False)
    if spec.kind == "multi":
        sch.add_field("pk", DataType.VARCHAR, is_primary=True, max_length=MAX_ID_BYTES + 12)
        sch.add_field("doc_id", DataType.VARCHAR, max_length=MAX_ID_BYTES)
        for f in ("part", *doc_counts(spec)):
            sch.add_field(f, DataType.INT32)
        sch.add_field("seq", DataType.INT64)
        sch.add_field("codes", DataType.ARRAY, element_type=DataType.VARCHAR,
                      max_capacity=ROW_ELEMENTS, max_length=ELEMENT_CHARS)
        sch.add_field("stub", DataType.FLOAT_VECTOR, dim=2)
    elif spec.kind == "sparse":
        features.check_sparse()  # before anything is made: a 2.3 server has no sparse vectors
        sch.add_field("id", DataType.VARCHAR, is_primary=True, max_length=MAX_ID_BYTES)
        sch.add_field("seq", DataType.INT64)
        sch.add_field("vector", DataType.SPARSE_FLOAT_VECTOR)
        sch.add_field(NNZ, DataType.INT32)
    else:
        sch.add_field("id", DataType.VARCHAR, is_primary=True, max_length=MAX_ID_BYTES)
        sch.add_field("seq", DataType.INT64)
        sch.add_field("vector", DataType.FLOAT_VECTOR, dim=spec.dim)
    analyzed = ({"enable_analyzer": True, "analyzer_params": milvus_analyzer(parse_analyzer(spec.analyzer))}
                if full_text(spec, features) else {})
    if features.nullable:
        sch.add_field("text", DataType.VARCHAR, max_length=MAX_TEXT_BYTES, nullable=True, **analyzed)
        sch.add_field("metadata", DataType.JSON, nullable=True)
    else:  # never `nullable=True` there: 2.3 and 2.4 accept it and drop it silently
        sch.add_field("text", DataType.VARCHAR, max_length=MAX_TEXT_BYTES, **analyzed)
        sch.add_field("metadata", DataType.JSON)
        sch.add_field(NULLS, DataType.INT8)
    if analyzed:
        sch.add_field(SPARSE_FIELD, DataType.SPARSE_FLOAT_VECTOR)
        sch.add_function(Function(name="bm25", function_type=FunctionType.BM25, input_field_names=["text"],
                                  output_field_names=[SPARSE_FIELD]))
    if spec.kind != "multi":
        index_params = _index(client, "vector", spec, features)
    else:
        index_params = client.prepare_index_params()
        index_params.add_index(field_name="stub", index_type="FLAT", metric_type="IP")
        index_params.add_index(field_name="doc_id", index_type=features.scalar_index)
    if analyzed:
        index_params.add_index(field_name=SPARSE_FIELD, index_type="SPARSE_INVERTED_INDEX", metric_type="BM25")
    return sch, index_params


def vector_rows_schema(client: Any, spec: CollectionSpec, features: MilvusFeatures) -> tuple[Any, Any]:
    """``(schema, index params)`` of rows of one vector each (:func:`vector_rows`: token rows,
    companion rows), ``spec.dim`` wide, indexed by :func:`.mapping.vector_factory` of ``spec``."""
    from pymilvus import DataType

    sch = client.create_schema(auto_id=False, enable_dynamic_field=False)
    sch.add_field("pk", DataType.VARCHAR, is_primary=True, max_length=MAX_ID_BYTES + 12)
    sch.add_field("doc_id", DataType.VARCHAR, max_length=MAX_ID_BYTES)
    sch.add_field("vector", DataType.FLOAT_VECTOR, dim=spec.dim)
    return sch, _index(client, "vector", spec, features)
