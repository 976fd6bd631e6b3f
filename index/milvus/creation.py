"""Creating an embedpool collection in Milvus all-or-nothing, and finding (and repairing) one
that a creation left half-made.

Milvus has no transaction across collections, indexes and properties, so a collection is made
in an order whose last step is the commit point:

1. the document-row collection, with only an *owner* property (:data:`OWNER_KEY`: who started
   the creation and when) -- from here on the name is taken, and by embedpool;
2. its hidden collections of vector rows (token rows, companion rows) and their indexes;
3. the document rows' indexes;
4. the manifest property (:data:`MANIFEST_KEY`): only now is it a collection. Listing, opening
   and searching know nothing of a Milvus collection without a manifest.

A step that fails undoes the steps before it (dropping what was made) and raises the Milvus
error. If even that fails (Milvus went away, the process was killed), what is left has an owner
and no manifest: the next creation of the same name waits for a creation that may still be
running in another process (:data:`CREATION_WAIT` seconds from its start), then drops the
remains and creates the collection again, with a warning.

Collections made before this order (the manifest set at step 1) can lack a piece when their
creation failed -- a Milvus 2.3 server refused the INVERTED index on ``doc_id``, after the
hidden collections existed -- or hold text fields that cannot store a missing text (a nullable
field a 2.3/2.4 server dropped silently). Opening one finds the gap (:func:`damage`); an empty
one is dropped and made again from its manifest's spec with a warning, a missing scalar index is
built, and one that holds documents and misses more is refused with what to do.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any

from ..base import MANIFEST_PROPERTY
from ..durable import now_iso
from embedpool.errors import ConflictError, InternalError, NotFoundError
from ..spec import CollectionSpec, new_manifest, parse_manifest
from .connection import ClientPool, Connection, is_lite
from .names import embedpool_name, milvus_name
from .schema import NULLS, full_text, hidden_names, layout_record, schema, vector_rows, vector_rows_schema

log = logging.getLogger("embedpool.index")

MANIFEST_KEY = MANIFEST_PROPERTY
OWNER_KEY = "embedpool.owner"  #: set at the first step of a creation (who, when)
CREATION_WAIT = 60.0  #: seconds another process's creation may take before its remains are dropped
_POLL = 0.5


def describe(conn: Connection, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(manifest, description)`` of collection ``name``, without loading it. A Milvus
    collection without a manifest is not a collection (:class:`ConflictError`; one whose
    creation is under way or stopped half-way says so)."""
    mname = milvus_name(name)
    with conn.errors(f"opening collection {name!r}"):
        client = conn.client()
        if not client.has_collection(mname):
            have = sorted(n for n in map(embedpool_name, client.list_collections()) if n)
            raise NotFoundError(
                f"no collection {name!r} in Milvus"
                + (f" (the collections: {', '.join(have)})" if have else " (there are no collections yet)"),
                param="name")
        desc = client.describe_collection(mname)
    props = desc.get("properties") or {}
    if MANIFEST_KEY not in props:
        if OWNER_KEY in props:
            raise NotFoundError(
                f"no collection {name!r} in Milvus at {conn.uri}: its creation is under way or stopped "
                f"half-way ({_owner_text(props[OWNER_KEY])}); creating it again (embedpool index, POST "
                "/collections) repairs it", param="name")
        raise ConflictError(
            f"Milvus collection {mname!r} at {conn.uri} has no embedpool manifest; it was not "
            "created by embedpool")
    return parse_manifest(props[MANIFEST_KEY], f"manifest of Milvus collection {mname!r}"), desc


def _owner_text(raw: str) -> str:
    try:
        o = json.loads(raw)
        return f"started {o['at']} by process {o['pid']} on {o['host']}"
    except (ValueError, KeyError, TypeError):
        return "started by embedpool"


def _state(client: Any, mname: str) -> tuple[str, float]:
    """``(absent | ready | creating | foreign, seconds since the creation started)``."""
    if not client.has_collection(mname):
        return "absent", 0.0
    props = client.describe_collection(mname).get("properties") or {}
    if MANIFEST_KEY in props:
        return "ready", 0.0
    if OWNER_KEY not in props:
        return "foreign", 0.0
    try:
        started = float(json.loads(props[OWNER_KEY])["t"])
    except (ValueError, KeyError, TypeError):
        started = 0.0
    return "creating", time.time() - started


def drop_all(client: Any, mname: str) -> None:
    """Drop collection ``mname`` and its hidden collections (those that exist)."""
    for n in (mname, *hidden_names(mname)):
        if client.has_collection(n):
            client.drop_collection(n)


def create_if_absent(conn: Connection, name: str, spec: CollectionSpec) -> None:
    """Create collection ``name`` of ``spec`` unless it exists (see the module docstring)."""
    mname = milvus_name(name)
    with ClientPool.write_lock(conn, mname):
        while True:
            with conn.errors(f"creating collection {name!r}"):
                state, age = _state(conn.client(), mname)
                if state in ("ready", "foreign"):  # a foreign one is refused by the open that follows
                    return
                if state == "creating" and age >= CREATION_WAIT:
                    log.warning("collection %r: a creation that stopped half-way %.0f s ago left Milvus "
                                "collection %r without a manifest; dropping what it made and creating it again",
                                name, age, mname)
                    drop_all(conn.client(), mname)
                    state = "absent"
            if state == "absent":
                return _create(conn, name, mname, spec)
            time.sleep(_POLL)  # another process is creating it: wait for its manifest


def _create(conn: Connection, name: str, mname: str, spec: CollectionSpec) -> None:
    made: list[str] = []
    try:
        with conn.errors(f"creating collection {name!r}"):
            client, features = conn.client(), conn.features
            # every schema first: what the server cannot do is refused before anything is made
            sch, index_params = schema(client, spec, features)
            rows = [(rname, *vector_rows_schema(client, rspec, features)) for rname, rspec in vector_rows(mname, spec)]
            for rname in hidden_names(mname):  # left by a drop that stopped half-way
                if client.has_collection(rname):
                    client.drop_collection(rname)
            owner = json.dumps({"t": time.time(), "at": now_iso(), "pid": os.getpid(), "host": socket.gethostname()})
            client.create_collection(mname, schema=sch, consistency_level="Strong", properties={OWNER_KEY: owner})
            made.append(mname)
            # Milvus Lite builds indexes at once and lacks the timestamp RPC that pymilvus' wait
            # for index completion uses: do not wait there
            sync = not is_lite(conn.uri)
            for rname, rsch, rindex in rows:
                client.create_collection(rname, schema=rsch, consistency_level="Strong")
                made.append(rname)
                client.create_index(rname, rindex, sync=sync)
            client.create_index(mname, index_params, sync=sync)
            extra = {"milvus_layout": layout_record()} if spec.kind == "multi" else {}
            manifest = new_manifest(name, spec, now_iso(), backend="milvus",
                                    milvus_full_text=full_text(spec, features), **extra)
            client.alter_collection_properties(mname, properties={MANIFEST_KEY: json.dumps(manifest)})
    except BaseException as e:
        if made:
            _undo(conn, name, made, e)
        raise


def _undo(conn: Connection, name: str, made: list[str], cause: BaseException) -> None:
    try:
        client = conn.client()
        for n in reversed(made):
            if client.has_collection(n):
                client.drop_collection(n)
        log.warning("creating collection %r failed (%s); what it had made in Milvus is dropped", name, cause)
    except Exception as e:  # noqa: BLE001 -- the creation's own error is the one to raise
        log.warning("creating collection %r failed (%s), and dropping what it had made failed too (%s); "
                    "the next creation of %r repairs it", name, cause, e, name)


def damage(conn: Connection, mname: str, spec: CollectionSpec, desc: dict[str, Any]) -> list[str]:
    """What a collection with a manifest lacks (empty: it is whole): a hidden collection of its
    vector rows, the scalar index of a multi-vector collection's ``doc_id``, text and metadata
    fields that can hold a missing value."""
    client = conn.client()
    gaps = [f"no Milvus collection {r!r}" for r, _ in vector_rows(mname, spec) if not client.has_collection(r)]
    if spec.kind == "multi" and not client.list_indexes(mname, field_name="doc_id"):
        gaps.append("no index on doc_id")
    fields = {f["name"]: f for f in desc.get("fields", [])}
    if NULLS not in fields and not fields.get("text", {}).get("nullable"):
        gaps.append("text and metadata fields that cannot store a missing value (this server dropped "
                    "`nullable`)")
    return gaps


def repair(conn: Connection, name: str, spec: CollectionSpec, desc: dict[str, Any], count: Any) -> None:
    """Make a collection that :func:`damage` finds gaps in whole (``count()``: its rows), or
    refuse it with what to do."""
    mname = milvus_name(name)
    with ClientPool.write_lock(conn, mname), conn.errors(f"repairing collection {name!r}"):
        gaps = damage(conn, mname, spec, desc)
        if not gaps:
            return
        if gaps == ["no index on doc_id"]:
            log.warning("collection %r lacks its index on doc_id (a creation that failed there); building it", name)
            client = conn.client()
            index_params = client.prepare_index_params()
            index_params.add_index(field_name="doc_id", index_type=conn.features.scalar_index)
            client.release_collection(mname)
            client.create_index(mname, index_params, sync=not is_lite(conn.uri))
            return
        if count() == 0:
            log.warning("collection %r was left half-made by a creation that failed (%s); it holds no documents: "
                        "dropping it and creating it again", name, "; ".join(gaps))
            drop_all(conn.client(), mname)
            _create(conn, name, mname, spec)
            return
    raise InternalError(
        f"collection {name!r} in Milvus at {conn.uri} is incomplete ({'; '.join(gaps)}) and holds documents; "
        f"delete it (DELETE /collections/{name}) and index the corpus again")
