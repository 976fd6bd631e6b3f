"""Metadata filters: one syntax, checked once, compiled for each place a search runs.

The syntax is the MongoDB-style one that Pinecone and Chroma use (``where``), so their users
can write it without learning anything; the same filter works on both backends and in every
search mode::

    {"tenant": "acme"}                                   # equality ($eq implied)
    {"source": {"$in": ["pubmed", "arxiv"]}}             # $in, $nin
    {"year": {"$gte": 2020, "$lt": 2024}}                # ranges on numbers: $gt $gte $lt $lte
    {"published": {"$gte": "2024-01-01"}}                # ranges on ISO 8601 dates
    {"$or": [{"tenant": "acme"}, {"public": true}]}      # $and, $or (a dict's keys are and-ed)
    {"draft": {"$ne": true}}, {"summary": {"$exists": true}}

Semantics (both backends keep them; the tests pin them against plain Python predicates):

- A filter addresses top-level metadata keys. ``$eq``/``$in`` match a scalar value, or any
  element of a list value (``{"tags": "x"}`` matches ``{"tags": ["x", "y"]}``). Strings and
  numbers never match each other (``1`` does not match ``"1"``); booleans are the numbers 1
  and 0, as in Python and in Milvus' expressions (``1`` and ``1.0`` are one number).
- ``$ne`` and ``$nin`` are the negations of ``$eq`` and ``$in``: they also match documents
  without the key (MongoDB's rule).
- Ranges compare numbers with numbers, and ISO 8601 dates (``2024-01-01``,
  ``2024-01-01T12:00:00+02:00``; a date without a zone is UTC) with stored strings that are
  such dates, by instant. They match scalar values only, never list elements.
- ``$exists`` is true when the key is present with a value other than ``null`` (a key whose
  value is ``null`` counts as absent, as in Milvus).

A filter is parsed into a small tree (:func:`parse_filter`: every mistake is an
:class:`InvalidError` that names the key and says what is allowed); the FAISS backend
compiles it into SQL over the document store's ``fields`` table (:func:`to_sql`, rows made by
:func:`field_rows` in the same transaction as the documents), Milvus into a boolean expression
over its ``metadata`` JSON field (:func:`to_milvus`).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Union

from embedpool.errors import InvalidError

EQ_OPS = ("$eq", "$ne", "$in", "$nin")
RANGE_OPS = ("$gt", "$gte", "$lt", "$lte")
OPS = (*EQ_OPS, *RANGE_OPS, "$exists")
#: most values one ``$in``/``$nin`` may list, and most conditions in one filter
MAX_VALUES = 1024
MAX_NODES = 256
MAX_KEY_CHARS = 256
#: the key under which a Milvus row keeps the instants of its date strings (never returned)
DATES_KEY = "_embedpool_dates"
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}([T ].*)?$")

Scalar = Union[str, int, float, bool]


@dataclass(frozen=True)
class Match:
    """``key`` equals one of ``values`` (``negate``: none of them; the document may lack it)."""

    key: str
    values: tuple[Scalar, ...]
    negate: bool = False


@dataclass(frozen=True)
class Range:
    """``key``'s scalar value within the bounds; ``dates``: compared as instants (epoch seconds)."""

    key: str
    lo: float | None = None
    lo_incl: bool = True
    hi: float | None = None
    hi_incl: bool = True
    dates: bool = False


@dataclass(frozen=True)
class Exists:
    key: str
    present: bool = True


@dataclass(frozen=True)
class Logic:
    op: str  # "and" | "or"
    parts: tuple["Node", ...]


Node = Union[Match, Range, Exists, Logic]


# ---------------------------------------------------------------------------------- parsing
def _bad(msg: str) -> InvalidError:
    return InvalidError(f"filter: {msg}", param="filter")


def date_instant(value: Any) -> float | None:
    """Epoch seconds of an ISO 8601 date or date-time string (UTC when it has no zone), else None."""
    if not isinstance(value, str) or not _DATE.match(value):
        return None
    text = value[:-1] + "+00:00" if value.endswith(("Z", "z")) else value
    try:
        d = _dt.datetime.fromisoformat(text)
    except ValueError:
        return None
    if d.tzinfo is None:
        d = d.replace(tzinfo=_dt.timezone.utc)
    return d.timestamp()


def _number(v: int | float) -> int | float:
    """An integer beyond SQLite's 64 bits as the float it is closest to (JSON numbers are)."""
    return float(v) if isinstance(v, int) and not -(1 << 63) <= v < (1 << 63) else v


def _scalar(key: str, op: str, v: Any) -> Scalar:
    if isinstance(v, bool) or isinstance(v, str):
        return v
    if isinstance(v, (int, float)):
        if isinstance(v, float) and not math.isfinite(v):
            raise _bad(f"{key!r}: {op} needs a finite number, got {v!r}")
        return _number(v)
    raise _bad(f"{key!r}: {op} takes a string, number or boolean, got {json.dumps(v)[:80]}"
               + ("; use $exists for null" if v is None else "; use $in for a list" if isinstance(v, list) else ""))


def _bound(key: str, op: str, v: Any) -> tuple[float, bool]:
    """(value, is_date) of a range bound."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise _bad(f"{key!r}: {op} takes a number or an ISO 8601 date string, got {json.dumps(v)[:80]}")
    if isinstance(v, str):
        t = date_instant(v)
        if t is None:
            raise _bad(f"{key!r}: {op} {v!r} is not a number or an ISO 8601 date (such as 2024-01-31 or "
                       "2024-01-31T12:00:00Z); ranges compare numbers or dates")
        return t, True
    if not math.isfinite(v):
        raise _bad(f"{key!r}: {op} needs a finite number, got {v!r}")
    return _number(v), False


def _key(key: Any) -> str:
    if not isinstance(key, str) or not key:
        raise _bad(f"keys must be non-empty strings, got {key!r}")
    if key.startswith("$"):
        raise _bad(f"unknown operator {key!r} at the top of a condition; use $and or $or "
                   f"(field operators {', '.join(OPS)} go inside {{\"key\": {{...}}}})")
    if len(key) > MAX_KEY_CHARS:
        raise _bad(f"key {key[:40]!r}... is longer than {MAX_KEY_CHARS} characters")
    if key == DATES_KEY:
        raise _bad(f"key {DATES_KEY!r} is reserved")
    return key


def _field(key: str, cond: Any) -> list[Node]:
    """The conditions on one key (a dict of operators is and-ed)."""
    if not isinstance(cond, dict):
        return [Match(key, (_scalar(key, "$eq", cond),))]
    if not cond:
        raise _bad(f"{key!r}: empty condition; give a value or operators such as {{\"$eq\": ...}}")
    out: list[Node] = []
    bounds: dict[str, tuple[float, bool]] = {}
    for op, v in cond.items():
        if op in ("$eq", "$ne"):
            out.append(Match(key, (_scalar(key, op, v),), negate=op == "$ne"))
        elif op in ("$in", "$nin"):
            if not isinstance(v, list) or not v:
                raise _bad(f"{key!r}: {op} takes a non-empty list of values, got {json.dumps(v)[:80]}")
            if len(v) > MAX_VALUES:
                raise _bad(f"{key!r}: {op} lists {len(v)} values; at most {MAX_VALUES}")
            out.append(Match(key, tuple(dict.fromkeys(_scalar(key, op, x) for x in v)), negate=op == "$nin"))
        elif op in RANGE_OPS:
            bounds[op] = _bound(key, op, v)
        elif op == "$exists":
            if not isinstance(v, bool):
                raise _bad(f"{key!r}: $exists takes true or false, got {json.dumps(v)[:80]}")
            out.append(Exists(key, v))
        else:
            raise _bad(f"{key!r}: unknown operator {op!r}; use one of {', '.join(OPS)}")
    if bounds:
        if len({d for _, d in bounds.values()}) > 1:
            raise _bad(f"{key!r}: a range mixes numbers and dates")
        if "$gt" in bounds and "$gte" in bounds or "$lt" in bounds and "$lte" in bounds:
            raise _bad(f"{key!r}: give one lower bound ($gt or $gte) and one upper bound ($lt or $lte)")
        lo = bounds.get("$gt") or bounds.get("$gte")
        hi = bounds.get("$lt") or bounds.get("$lte")
        out.append(Range(key, lo and lo[0], "$gt" not in bounds, hi and hi[0], "$lt" not in bounds,
                         dates=next(iter(bounds.values()))[1]))
    return out


def _node(f: Any, depth: int) -> Node:
    if depth > 32:
        raise _bad("nested more than 32 levels deep")
    if not isinstance(f, dict):
        raise _bad(f"a filter is a JSON object such as {{\"tenant\": \"acme\"}}, got {json.dumps(f)[:80]}")
    if not f:
        raise _bad("empty object; leave the filter out to search everything")
    parts: list[Node] = []
    for k, v in f.items():
        if k in ("$and", "$or"):
            if not isinstance(v, list) or not v:
                raise _bad(f"{k} takes a non-empty list of filters, got {json.dumps(v)[:80]}")
            sub = tuple(_node(x, depth + 1) for x in v)
            parts.append(sub[0] if len(sub) == 1 else Logic(k[1:], sub))
        else:
            parts.extend(_field(_key(k), v))
    return parts[0] if len(parts) == 1 else Logic("and", tuple(parts))


def _count(n: Node) -> int:
    return 1 + sum(_count(p) for p in n.parts) if isinstance(n, Logic) else 1


def parse_filter(f: Any) -> Node | None:
    """The checked filter tree of ``f`` (``None`` for no filter); a JSON string is parsed first."""
    if f is None:
        return None
    if isinstance(f, (Match, Range, Exists, Logic)):
        return f
    if isinstance(f, str):
        try:
            f = json.loads(f)
        except json.JSONDecodeError as e:
            raise _bad(f"not valid JSON: {e}") from None
    node = _node(f, 0)
    if _count(node) > MAX_NODES:
        raise _bad(f"more than {MAX_NODES} conditions")
    return node


# ---------------------------------------------------------------------------------- indexing
def field_rows(metadata: dict | None) -> Iterator[tuple[str, str, Any, str | None, int]]:
    """The rows of the ``fields`` table for one document's metadata: ``(key, type, num, str,
    elem)``; type ``s`` string (``num``: its instant if it is an ISO date), ``n`` number (a
    boolean is 1 or 0), ``o`` an object or a list without scalars (presence only); ``elem`` 1 for
    an element of a list value. A ``null`` value has no row (it counts as absent)."""
    if not metadata:
        return
    for key, v in metadata.items():
        if isinstance(v, list):
            scalars = [x for x in v if x is not None and not isinstance(x, (list, dict))]
            for x in dict.fromkeys(scalars):
                yield (key, *_typed(x), 1)
            if not scalars:
                yield key, "o", None, None, 0
        elif isinstance(v, dict):
            yield key, "o", None, None, 0
        elif v is not None:
            yield (key, *_typed(v), 0)


def _typed(v: Scalar) -> tuple[str, Any, str | None]:
    if isinstance(v, bool):
        return "n", int(v), None
    if isinstance(v, str):
        return "s", date_instant(v), v
    return "n", _number(v), None


def _type_of(v: Scalar) -> str:
    return "s" if isinstance(v, str) else "n"


# ---------------------------------------------------------------------------------- SQL
def to_sql(node: Node, among: str | None = None) -> tuple[str, list[Any]]:
    """A SELECT of the ``int_id`` of every matching document (``fields`` and ``docs`` tables);
    ``among``: a JSON array of internal ids, the only ones to consider (each part of the query
    is restricted to them, so its cost follows their number, not the collection's)."""
    params: list[Any] = []
    return _sql(node, params, among), params


def _sql(n: Node, params: list[Any], among: str | None = None) -> str:
    def only(q: str) -> str:  # restrict a SELECT ... WHERE to the ids of ``among``
        if among is None:
            return q
        params.append(among)
        # "+key": SQLite must not drive the query from the value index (every document's value
        # of the key) but from the ids' index -- the cost then follows the ids
        return q.replace("WHERE key = ?", "WHERE +key = ?") + " AND int_id IN (SELECT value FROM json_each(?))"

    def docs() -> str:
        return only("SELECT int_id FROM docs WHERE 1")

    if isinstance(n, Logic):
        op = " INTERSECT " if n.op == "and" else " UNION "
        return op.join(f"SELECT int_id FROM ({_sql(p, params, among)})" for p in n.parts)
    if isinstance(n, Exists):
        if not n.present:
            head = docs()
            params.append(n.key)
            return f"{head} EXCEPT " + only("SELECT int_id FROM fields WHERE key = ?")
        params.append(n.key)
        return only("SELECT int_id FROM fields WHERE key = ?")
    if isinstance(n, Range):
        params.extend([n.key, "s" if n.dates else "n"])
        cond = "key = ? AND type = ? AND elem = 0"
        if n.lo is not None:
            cond += f" AND num {'>=' if n.lo_incl else '>'} ?"
            params.append(n.lo)
        if n.hi is not None:
            cond += f" AND num {'<=' if n.hi_incl else '<'} ?"
            params.append(n.hi)
        return only(f"SELECT int_id FROM fields WHERE {cond}")
    head = docs() + " EXCEPT " if n.negate else ""
    by_type: dict[str, list[Scalar]] = {}
    for v in n.values:
        by_type.setdefault(_type_of(v), []).append(int(v) if isinstance(v, bool) else v)
    ors = []
    params.append(n.key)
    for t, vals in by_type.items():
        col = "str" if t == "s" else "num"
        ors.append(f"(type = ? AND {col} IN ({','.join('?' * len(vals))}))")
        params.extend([t, *vals])
    return head + only(f"SELECT int_id FROM fields WHERE key = ? AND ({' OR '.join(ors)})")


# ---------------------------------------------------------------------------------- Milvus
def milvus_metadata(metadata: dict | None) -> dict | None:
    """The JSON a Milvus row stores for ``metadata``: the same, plus the instants of its date
    strings under :data:`DATES_KEY` (what date ranges compare)."""
    if not metadata:
        return metadata
    dates = {k: t for k, v in metadata.items() if (t := date_instant(v)) is not None}
    return {**metadata, DATES_KEY: dates} if dates else metadata


def user_metadata(stored: dict | None) -> dict | None:
    """The metadata a Milvus row returns: what the user stored (:func:`milvus_metadata` undone)."""
    if isinstance(stored, dict) and DATES_KEY in stored:
        return {k: v for k, v in stored.items() if k != DATES_KEY}
    return stored


def quote(s: str) -> str:
    """A Milvus expression's string literal of ``s``. Milvus' parser knows the escapes ``\\\\``,
    ``\\"``, ``\\n``, ``\\r`` and ``\\t`` but not JSON's ``\\uXXXX``, and takes every other
    character (NUL and the other control characters too) as it is."""
    for a, b in (("\\", "\\\\"), ('"', '\\"'), ("\n", "\\n"), ("\r", "\\r"), ("\t", "\\t")):
        s = s.replace(a, b)
    return f'"{s}"'


def _lit(v: Scalar) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return quote(v)
    return repr(float(v)) if isinstance(v, float) else str(v)


def _with_bool_twins(values: tuple[Scalar, ...] | list[Scalar]) -> list[Scalar]:
    """``values`` plus the boolean each 1 or 0 is, and the number each boolean is: booleans are
    the numbers 1 and 0 here, and the Milvus 2.3 server compares a JSON ``true`` unequal to ``1``
    (Milvus Lite does not)."""
    out = list(values)
    for v in values:
        if isinstance(v, bool):
            out.append(int(v))
        elif isinstance(v, (int, float)) and v in (0, 1):
            out.append(bool(v))
    return out


def to_milvus(node: Node, field: str = "metadata") -> str:
    """The Milvus boolean expression of ``node`` over the JSON field ``field``."""
    def path(key: str, dates: bool = False) -> str:
        k = quote(key)
        return f'{field}["{DATES_KEY}"][{k}]' if dates else f"{field}[{k}]"

    def go(n: Node) -> str:
        if isinstance(n, Logic):
            return "(" + f" {n.op} ".join(go(p) for p in n.parts) + ")"
        if isinstance(n, Exists):
            e = f"exists {path(n.key)}"
            return f"({e})" if n.present else f"(not ({e}))"
        if isinstance(n, Range):
            p = path(n.key, n.dates)
            conds = []
            if n.lo is not None:
                conds.append(f"{p} {'>=' if n.lo_incl else '>'} {_lit(n.lo)}")
            if n.hi is not None:
                conds.append(f"{p} {'<=' if n.hi_incl else '<'} {_lit(n.hi)}")
            return "(" + " and ".join(conds) + ")"
        # Milvus takes no ``in`` on a JSON path: an OR of equalities, and json_contains_any for
        # list values (not json_contains, even for one value: Milvus Lite does not parse a negative
        # number there); a NOT over a missing key is not true there, hence the exists term
        p = path(n.key)
        eqs = " or ".join(f"{p} == {_lit(v)}" for v in _with_bool_twins(n.values))
        vals = ", ".join(_lit(v) for v in n.values)
        e = f"({eqs} or json_contains_any({p}, [{vals}]))"
        return f"((not {e}) or (not (exists {p})))" if n.negate else e

    return go(node)
