"""FAISS factory string -> the equivalent Milvus index, with the FAISS backend's search defaults,
so a spec means the same index on both backends; a sparse collection's factory -> Milvus' sparse
inverted index (:func:`sparse_index`)."""

from __future__ import annotations

import re
from typing import Any

from embedpool.errors import InvalidError
from ..faiss.single import HNSW_EF_SEARCH, default_nprobe
from ..sparse import parse_sparse_factory
from ..spec import CollectionSpec

HNSW_EF_CONSTRUCTION = 40  # FAISS' default, so both backends build the same graph quality


def milvus_index(factory: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """``(index_type, build params, search params)`` of the Milvus index equivalent to a FAISS
    factory string, with the FAISS backend's defaults (HNSW efSearch 64, IVF nprobe)."""
    desc = ",".join(p for p in factory.replace(" ", "").split(",") if p not in ("", "IDMap", "IDMap2"))
    if desc in ("Flat", ""):
        return "FLAT", {}, {}
    m = re.fullmatch(r"HNSW(\d*)(?:_Flat|,Flat)?", desc)
    if m:
        return ("HNSW", {"M": int(m.group(1) or 32), "efConstruction": HNSW_EF_CONSTRUCTION},
                {"ef": HNSW_EF_SEARCH})
    m = re.fullmatch(r"HNSW(\d*)_SQ8", desc)
    if m:
        return ("HNSW_SQ", {"M": int(m.group(1) or 32), "efConstruction": HNSW_EF_CONSTRUCTION,
                            "sq_type": "SQ8"}, {"ef": HNSW_EF_SEARCH})
    m = re.fullmatch(r"IVF(\d+),(Flat|SQ8|PQ(\d+)(?:x(\d+))?(?:np)?)", desc)
    if m:
        nlist = int(m.group(1))
        search = {"nprobe": default_nprobe(nlist)}
        if m.group(2) == "Flat":
            return "IVF_FLAT", {"nlist": nlist}, search
        if m.group(2) == "SQ8":
            return "IVF_SQ8", {"nlist": nlist}, search
        return "IVF_PQ", {"nlist": nlist, "m": int(m.group(3)), "nbits": int(m.group(4) or 8)}, search
    raise InvalidError(
        f"factory {factory!r} has no Milvus equivalent; with backend='milvus' use 'Flat' "
        "('IDMap2,Flat'), 'HNSW<M>', 'HNSW<M>_SQ8', 'IVF<n>,Flat', 'IVF<n>,SQ8' or 'IVF<n>,PQ<m>'", param="factory")


#: the index of a sparse collection's rows: every row that shares a token with the query is scored
#: (no posting list pruned: Milvus' defaults, ``drop_ratio_build``/``drop_ratio_search`` 0), so
#: its top k are the exact dot product's among the documents that share a token with the query
SPARSE_INDEX = "SPARSE_INVERTED_INDEX"


def sparse_index(factory: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """``(index_type, build params, search params)`` of a sparse collection's ``factory`` on
    Milvus: ``auto`` and ``exact`` are :data:`SPARSE_INDEX`; Seismic runs on the FAISS backend
    only (:class:`InvalidError` naming ``factory``)."""
    if parse_sparse_factory(factory).kind == "seismic":
        raise InvalidError(
            f"factory {factory!r}: Seismic runs on the FAISS backend only; with backend='milvus' a sparse "
            f"collection is searched by Milvus' {SPARSE_INDEX} (exact dot products): use 'auto' or 'exact'",
            param="factory")
    return SPARSE_INDEX, {}, {}


def index_of(spec: CollectionSpec) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """:func:`milvus_index` of the indexed vectors of ``spec`` (documents, or a multi-vector
    collection's tokens), or a sparse collection's :func:`sparse_index`."""
    return sparse_index(spec.factory) if spec.kind == "sparse" else milvus_index(vector_factory(spec))


def vector_factory(spec: CollectionSpec) -> str:
    """The factory of the indexed vectors: documents (single) or their tokens (multi)."""
    return spec.token_factory if spec.kind == "multi" else spec.factory


def check_factories(spec: CollectionSpec) -> None:
    """Every FAISS factory of ``spec`` that a Milvus collection maps has a Milvus equivalent
    (:class:`InvalidError` naming the field): the indexed vectors' and the companion rows'; a
    sparse collection's factory has a Milvus sparse index (:func:`sparse_index`). Whether the
    server has sparse vectors at all is the schema's check (:meth:`.versions.MilvusFeatures.check_sparse`)."""
    if spec.kind == "sparse":
        sparse_index(spec.factory)
        return
    fields = [("factory" if spec.kind == "single" else "token_factory", vector_factory(spec))]
    if spec.companion_pooler is not None:
        fields.append(("companion_factory", spec.companion_factory))
    for field, factory in fields:
        try:
            milvus_index(factory)
        except InvalidError as e:
            raise InvalidError(f"spec.{field}: {e}", param=f"spec.{field}") from None


def metric(spec: CollectionSpec) -> str:
    return "IP" if spec.metric == "ip" else "L2"


def search_params(base: dict[str, Any], k: int) -> dict[str, Any]:
    params = dict(base)
    if "ef" in params:
        params["ef"] = max(params["ef"], k)  # Milvus requires ef >= limit (FAISS raises it too)
    return params
