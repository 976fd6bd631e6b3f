"""Names and keys in Milvus: embedpool collection names <-> Milvus collection names (Milvus
allows only ``[A-Za-z0-9_]``), multi-vector row keys (filter string literals: :func:`index.filters.quote`)."""

from __future__ import annotations

from embedpool.errors import InvalidError
from ..spec import check_name

PREFIX = "embedpool_"
_ENC = {"_": "_0", "-": "_1", ".": "_2"}
_DEC = {v[1]: k for k, v in _ENC.items()}


def milvus_name(name: str) -> str:
    """Milvus collection name of an embedpool collection (Milvus allows only ``[A-Za-z0-9_]``)."""
    check_name(name)
    out = PREFIX + "".join(_ENC.get(c, c) for c in name)
    if len(out) > 255:
        raise InvalidError(f"collection name {name!r} is too long for Milvus", param="name")
    return out


def embedpool_name(mname: str) -> str | None:
    """Inverse of :func:`milvus_name`; ``None`` for collections embedpool did not create."""
    if not mname.startswith(PREFIX):
        return None
    out, s, i = [], mname[len(PREFIX):], 0
    while i < len(s):
        if s[i] == "_":
            if i + 1 >= len(s) or s[i + 1] not in _DEC:
                return None
            out.append(_DEC[s[i + 1]])
            i += 2
        else:
            out.append(s[i])
            i += 1
    return "".join(out) or None


def pk(doc_id: str, pos: int) -> str:
    """Primary key of vector ``pos`` of a multi-vector document."""
    return f"{doc_id}#{pos}"
