"""The Milvus schema and index of an embedpool collection.

* single: one row per document -- ``id`` (VARCHAR primary key = external id), ``seq`` (insertion
  order), ``vector``, ``text`` (nullable), ``metadata`` (nullable JSON).
* multi: one row per stored vector -- ``pk`` (``<doc id>#<pos>``), ``doc_id``, ``pos``, ``n``
  (the document's vector count), ``seq``, ``vector``; ``text`` and ``metadata`` on row 0.
"""

from __future__ import annotations

from typing import Any

from ..spec import CollectionSpec
from .mapping import metric, milvus_index, vector_factory

MAX_ID_BYTES = 512
MAX_TEXT_BYTES = 65_535


def schema(client: Any, spec: CollectionSpec) -> tuple[Any, Any]:
    """``(schema, index params)`` of a new Milvus collection for ``spec``."""
    from pymilvus import DataType

    multi = spec.kind == "multi"
    sch = client.create_schema(auto_id=False, enable_dynamic_field=False)
    if multi:
        sch.add_field("pk", DataType.VARCHAR, is_primary=True, max_length=MAX_ID_BYTES + 12)
        sch.add_field("doc_id", DataType.VARCHAR, max_length=MAX_ID_BYTES)
        sch.add_field("pos", DataType.INT32)
        sch.add_field("n", DataType.INT32)  # vectors of the document (same on all its rows)
    else:
        sch.add_field("id", DataType.VARCHAR, is_primary=True, max_length=MAX_ID_BYTES)
    sch.add_field("seq", DataType.INT64)
    sch.add_field("vector", DataType.FLOAT_VECTOR, dim=spec.dim)
    sch.add_field("text", DataType.VARCHAR, max_length=MAX_TEXT_BYTES, nullable=True)
    sch.add_field("metadata", DataType.JSON, nullable=True)
    index_type, params, _ = milvus_index(vector_factory(spec))
    index_params = client.prepare_index_params()
    # pymilvus 3 sends build parameters as flat key/values, Milvus Lite 3.2 reads only the legacy
    # "params" JSON key (servers read both): send both
    index_params.add_index(field_name="vector", index_type=index_type, metric_type=metric(spec),
                           params={**params, "params": params} if params else {})
    if multi:
        index_params.add_index(field_name="doc_id", index_type="INVERTED")
    return sch, index_params
