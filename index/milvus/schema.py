"""The Milvus schema and indexes of an embedpool collection (layout :data:`LAYOUT`).

* single: one row per document -- ``id`` (VARCHAR primary key = external id), ``seq`` (insertion
  order), ``vector``, ``text`` (nullable), ``metadata`` (nullable JSON).
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

from ..spec import CollectionSpec
from .mapping import metric, milvus_index, vector_factory

MAX_ID_BYTES = 512
MAX_TEXT_BYTES = 65_535
#: Layout version of multi-vector collections, recorded in the manifest (``milvus_layout``).
#: 1 (no key): one row per token vector; 2: packed document rows + token rows.
LAYOUT = 2
ELEMENT_CHARS = 65_532  # base64 characters per ARRAY element: <= 65,535 and a multiple of 4
ROW_ELEMENTS = 16
FETCH_DOCS = 128  # first parts per fetch query: <= 128 rows of <= ~1 MB
TOKENS_SUFFIX = "__tokens"


def tokens_name(mname: str) -> str:
    """The Milvus collection of a multi-vector collection's token rows."""
    return mname + TOKENS_SUFFIX


def layout_record() -> dict[str, int]:
    """What the manifest records of the packed layout (read back by the collection, so rows
    written with other limits stay readable)."""
    return {"version": LAYOUT, "element_chars": ELEMENT_CHARS, "row_elements": ROW_ELEMENTS}


def _index(client: Any, field: str, spec: CollectionSpec) -> Any:
    index_type, params, _ = milvus_index(vector_factory(spec))
    index_params = client.prepare_index_params()
    # pymilvus 3 sends build parameters as flat key/values, Milvus Lite 3.2 reads only the legacy
    # "params" JSON key (servers read both): send both
    index_params.add_index(field_name=field, index_type=index_type, metric_type=metric(spec),
                           params={**params, "params": params} if params else {})
    return index_params


def schema(client: Any, spec: CollectionSpec) -> tuple[Any, Any]:
    """``(schema, index params)`` of the (document-row) Milvus collection for ``spec``."""
    from pymilvus import DataType

    sch = client.create_schema(auto_id=False, enable_dynamic_field=False)
    if spec.kind == "multi":
        sch.add_field("pk", DataType.VARCHAR, is_primary=True, max_length=MAX_ID_BYTES + 12)
        sch.add_field("doc_id", DataType.VARCHAR, max_length=MAX_ID_BYTES)
        for f in ("part", "parts", "n"):
            sch.add_field(f, DataType.INT32)
        sch.add_field("seq", DataType.INT64)
        sch.add_field("codes", DataType.ARRAY, element_type=DataType.VARCHAR,
                      max_capacity=ROW_ELEMENTS, max_length=ELEMENT_CHARS)
        sch.add_field("stub", DataType.FLOAT_VECTOR, dim=2)
    else:
        sch.add_field("id", DataType.VARCHAR, is_primary=True, max_length=MAX_ID_BYTES)
        sch.add_field("seq", DataType.INT64)
        sch.add_field("vector", DataType.FLOAT_VECTOR, dim=spec.dim)
    sch.add_field("text", DataType.VARCHAR, max_length=MAX_TEXT_BYTES, nullable=True)
    sch.add_field("metadata", DataType.JSON, nullable=True)
    if spec.kind != "multi":
        return sch, _index(client, "vector", spec)
    index_params = client.prepare_index_params()
    index_params.add_index(field_name="stub", index_type="FLAT", metric_type="IP")
    index_params.add_index(field_name="doc_id", index_type="INVERTED")
    return sch, index_params


def token_schema(client: Any, spec: CollectionSpec) -> tuple[Any, Any]:
    """``(schema, index params)`` of a multi-vector collection's token rows."""
    from pymilvus import DataType

    sch = client.create_schema(auto_id=False, enable_dynamic_field=False)
    sch.add_field("pk", DataType.VARCHAR, is_primary=True, max_length=MAX_ID_BYTES + 12)
    sch.add_field("doc_id", DataType.VARCHAR, max_length=MAX_ID_BYTES)
    sch.add_field("vector", DataType.FLOAT_VECTOR, dim=spec.dim)
    return sch, _index(client, "vector", spec)
