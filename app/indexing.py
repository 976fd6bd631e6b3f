"""The batch indexing job behind ``embedpool index`` (and the evaluation command).

Takes a stream of records (read lazily by :class:`app.datasets.CorpusSource`: BEIR
``corpus.jsonl``, JSON lines with chosen fields, Parquet, plain text lines, or stdin), embeds it
with every requested pooler -- one forward pass per tokenization plan
for all of them -- and writes one :class:`index.CollectionBase` per pooler spec; every multi-vector
collection also keeps the companion rows its ``two_stage`` search takes candidates from.

Work is sized in tokens and bytes, never in records alone, so that the job's memory is set by its
budgets whatever the corpus and however long its records (a record may be a 40,000-token
transcript): records are tokenized once and cut into embedding calls of ``batch_tokens`` tokens,
counted after windowing (:func:`token_calls`; a longer record is a call of its own, forwarded a
token-budget batch at a time), and the job commits once the vectors added since the last commit
take ``commit_bytes`` in their stored precision, or after ``commit_every`` records.

Resumability: at every commit the job stages, in the collection property
``embedpool.indexjob`` (on every backend: the state lives and dies with the collection), how many
input records that collection holds and the id of the last one, then commits the collection: the
state becomes durable with (FAISS: atomically with) the documents it describes, never before
them. A rerun skips those records (checking that the id at that position is still the same) and
continues; records added after the last commit are simply upserted again (same ids replace), and
the final compaction removes any tombstones they left, so an interrupted and resumed run ends
with the same documents and vectors as an uninterrupted one. The job state also pins the
settings (corpus, fields, model, encoder precision, pooler, dimensions); a rerun with different
ones is refused with a message naming them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from embedpool.allocator import release_free_memory
from embedpool.app import recipe
from embedpool.app.datasets import Record
from embedpool.app.retrieval import stored_rows
from embedpool.app.timed_embedding import embed_by_plan
from embedpool.app.tables import render_table
from embedpool.errors import InvalidError, NotFoundError
from embedpool.index import CollectionSpec, bytes_per_vector, open_collection
from embedpool.poolers import EmbedOptions, Tokenized

JOB_PROPERTY = "embedpool.indexjob"  # the collection property holding the job state
JOB_VERSION = 1
#: default tokens per embedding call: ~100 MB of float32 token vectors for ``tokens`` (1.5 KB a
#: token at 384 dimensions), whatever the records' length
BATCH_TOKENS = 65_536
#: default bytes of vectors added between two commits (what the pending segments hold)
COMMIT_BYTES = 256 << 20
#: records (and characters) tokenized in one tokenizer call, before they are cut into calls
#: the options of a job that names none: documents, normalized, at the model's full size
DOCUMENT = EmbedOptions(role="document")
MEASURE_RECORDS = 64
MEASURE_CHARS = 1 << 20
#: the job's flags for the collection recipe's options (its errors name the flag)
FLAGS = {"companion_pooler": "--companion-pooler", "analyzer": "--analyzer", "dimensions": "--dimensions"}


# ---------------------------------------------------------------------------------- helpers
_BAD = re.compile(r"[^A-Za-z0-9._-]+")


def collection_name(base: str, spec: str, several: bool) -> str:
    """``base`` for a lone pooler, else ``base-<spec>`` with the spec made filename-safe
    (``cluster:pool_factor=3`` -> ``cluster-pool_factor-3``)."""
    if not several:
        return base
    slug = re.sub(r"-{2,}", "-", _BAD.sub("-", spec.replace(":", "-").replace("=", "-").replace(",", "-"))).strip("-.")
    name = f"{base}-{slug}"
    if len(name) > 128:
        import hashlib

        name = name[:110] + "-" + hashlib.sha1(spec.encode()).hexdigest()[:12]
    return name


class _DeferSigint:
    """SIGINT raises KeyboardInterrupt at once, except inside :meth:`critical` blocks (adds,
    commits, job-state writes), where it is held until the block ends. No-op off the main thread."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending = False
        self.prev = None
        self.active = False

    def _handler(self, signum, frame) -> None:
        if self.depth:
            self.pending = True
        else:
            raise KeyboardInterrupt

    def __enter__(self) -> "_DeferSigint":
        if threading.current_thread() is threading.main_thread():
            self.prev = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._handler)
            self.active = True
        return self

    def __exit__(self, *exc) -> None:
        if self.active:
            signal.signal(signal.SIGINT, self.prev)
            self.active = False

    @contextlib.contextmanager
    def critical(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if not self.depth and self.pending:
            self.pending = False
            raise KeyboardInterrupt


# ---------------------------------------------------------------------------------- the job
@dataclass
class Target:
    """One output collection."""

    spec: str  # canonical pooler spec
    label: str  # as the user wrote it
    name: str
    multi: bool
    plan: str
    collection: CollectionSpec | None = None  # the collection recipe's spec of it
    coll: Any = None  # an index.CollectionBase
    committed: int = 0  # input records durably in the collection
    added: int = 0  # input records added (committed or not)
    last_id: str | None = None
    encode_seconds: float = 0.0
    settings: dict = field(default_factory=dict)

    @property
    def companion_pooler(self) -> str | None:
        """multi: the pooler of the companion it keeps (canonical spec), else ``None``."""
        return self.collection.companion_pooler if self.collection is not None else None

    @property
    def companion_rows(self) -> str:
        """... and its rows: one per ``document``, or one per ``window``."""
        return self.collection.companion_rows if self.collection is not None else "document"


class IndexJob:
    """Index a stream of records into one collection per pooler spec.

    Args:
        embedder: a :class:`poolers.Embedder`.
        data_dir: folder of collections (``backend="milvus"``: of the default Milvus Lite file).
        name: collection name (``name`` for one pooler, ``name-<pooler>`` for several).
        poolers: pooler specs.
        source: a description of the corpus pinned in the job state (``CorpusSource.describe()``).
        companion_pooler: pooler spec of the companion every multi-vector collection keeps for
            ``two_stage`` candidates (:func:`app.recipe.resolve_companion_pooler`: ``mean``,
            ``fde:...``, a per-window form such as ``mean:per_window=true``, or ``auto``;
            ``None`` or ``none``: none), written with its documents in the same commits.
        commit_every: commit after this many input records (rounded up to whole calls).
        commit_bytes: commit as well once the vectors added since the last commit take this many
            bytes in their stored precision (what the collections hold in memory until a commit).
        batch_tokens: tokens per embedding call, counted as the encoder will read them (every
            plan the poolers need, after windowing); a record over it is a call of its own. The
            job's memory follows this and ``commit_bytes``, not the corpus or its records' length.
        batch_docs: records per embedding call at most (length-sorted into token-budget forward
            batches).
        factory / storage_precision / token_factory / analyzer: index settings (see
            ``CollectionSpec``; ``analyzer``: the lexical index's, ``none`` for none).
        dimensions, normalize: post-processing (Matryoshka, L2; a sparse pooler's weights are never
            normalized).
        store_text: keep document texts in the document store.
        progress: show a tqdm bar on stderr.
        backend, milvus_uri, milvus_token: where the collections live (see
            :func:`index.open_collection`).
    """

    def __init__(self, embedder, data_dir: str | os.PathLike, name: str, poolers: list[str], *,
                 source: dict | None = None, companion_pooler: str | None = "auto", commit_every: int = 1000,
                 commit_bytes: int = COMMIT_BYTES, batch_tokens: int = BATCH_TOKENS,
                 batch_docs: int = 256, factory: str = "IDMap2,Flat", storage_precision: str = "float32",
                 token_factory: str = "HNSW32", analyzer: str = "english", dimensions: int | None = None,
                 normalize: bool = True,
                 store_text: bool = True, progress: bool = True, log: Callable[[str], None] | None = None,
                 backend: str = "faiss", milvus_uri: str | None = None, milvus_token: str | None = None) -> None:
        if not poolers:
            raise InvalidError("give at least one --pooler", param="--pooler")
        for flag, value in (("--commit-every", commit_every), ("--commit-bytes", commit_bytes),
                            ("--batch-tokens", batch_tokens), ("--batch-docs", batch_docs)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidError(f"{flag} must be a whole number >= 1, got {value!r}", param=flag)
        embedder.check_dimensions(dimensions)
        self.embedder = embedder
        self.data_dir = Path(data_dir)
        self.backend = backend
        self._where = {"backend": backend, "milvus_uri": milvus_uri, "milvus_token": milvus_token}
        self.name = name
        self.commit_every = int(commit_every)
        self.commit_bytes = int(commit_bytes)
        self.batch_tokens = int(batch_tokens)
        self.batch_docs = int(min(batch_docs, commit_every))
        # the one options object of every embedding call of the job, built here from its arguments
        self.options = EmbedOptions(role="document", normalize=normalize, dimensions=dimensions)
        self.store_text = store_text
        self.progress = progress
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        # every collection's spec is the collection recipe's, as the HTTP create route's; the job's
        # normalize (default true) leaves sparse poolers' weights as they are, as the recipe does
        options = recipe.CollectionOptions(
            dimensions=dimensions, normalize=None if normalize else False, factory=factory,
            storage_precision=storage_precision, token_factory=token_factory, analyzer=analyzer,
            companion_pooler=companion_pooler or recipe.NO_COMPANION)

        labels: dict[str, str] = {}
        for p in poolers:
            labels.setdefault(embedder.canonical(p), p)
        several = len(labels) > 1
        self.targets: dict[str, Target] = {}
        for spec, label in labels.items():
            pooler = embedder.pooler(spec)
            self.targets[spec] = t = Target(spec, label, collection_name(name, label if several else spec, several),
                                            bool(pooler.multi_vector), pooler.plan.key)
            try:  # the companion option is every multi-vector collection's
                t.collection = recipe.collection_spec(
                    embedder, spec, options if t.multi else replace(options, companion_pooler=None))
            except InvalidError as e:
                raise recipe.renamed(e, FLAGS) from None
        encoding = {"model": embedder.model_id,
                    "encoder_precision": embedder.encoder.precision,
                    "dimensions": dimensions, "normalize": normalize, "role": "document"}
        for t in self.targets.values():
            # the job state's key stays "companion": a job started before the rename resumes
            t.settings = {"source": source or {}, **encoding, "pooler": t.spec,
                          **({"companion": t.companion_pooler} if t.companion_pooler else {})}
        self.runner: dict[str, Any] = {"runner": "in-process"}  # where embedding ran (set by a runner)
        self.records_read = 0
        self.records_indexed = 0
        self.tokens = 0
        self.elapsed = 0.0

    # -- collections
    def open(self) -> None:
        """Open or create every collection and load (or start) its job state."""
        try:
            states = {}
            for t in self.targets.values():  # settings first: the clearest message
                state = self._read_state(t)
                if state is not None:
                    diffs = _diff_settings(state.get("settings", {}), t.settings)
                    if diffs:
                        raise InvalidError(
                            f"collection {t.name!r} was indexed with different settings ({'; '.join(diffs)}); "
                            "rerun with the original settings to continue it, or use another --collection "
                            "name (or delete the collection)")
                states[t.spec] = state
            for t in self.targets.values():
                t.coll = open_collection(self.data_dir, t.name, t.collection, **self._where)
                state = states[t.spec]
                if state is None:
                    if len(t.coll):
                        raise InvalidError(
                            f"collection {t.name!r} already holds {len(t.coll)} documents that were not "
                            "written by `embedpool index`; use another --collection name or delete it")
                    self._commit(t)
                    continue
                t.committed = t.added = int(state.get("committed_records", 0))
                t.last_id = state.get("last_id")
                t.encode_seconds = float(state.get("encode_seconds", 0.0))
        except BaseException:
            self.close()
            raise

    def _read_state(self, t: Target) -> dict | None:
        try:
            coll = open_collection(self.data_dir, t.name, **self._where)
        except NotFoundError:
            return None
        try:
            raw = coll.get_property(JOB_PROPERTY)
        finally:
            coll.close()
        try:
            return None if raw is None else json.loads(raw)
        except json.JSONDecodeError as e:
            raise InvalidError(f"job state of collection {t.name!r} is unreadable ({e}); delete "
                               "the collection to start over") from None

    def _commit(self, t: Target) -> None:
        """Commit ``t``'s collection together with the job state that says what it holds."""
        state = {"version": JOB_VERSION, "settings": t.settings, "committed_records": t.added,
                 "last_id": t.last_id, "encode_seconds": round(t.encode_seconds, 3),
                 "collection": t.name, "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        t.coll.set_property(JOB_PROPERTY, json.dumps(state, indent=2))
        t.coll.commit()
        t.committed = t.added

    def close(self) -> None:
        for t in self.targets.values():
            if t.coll is not None:
                t.coll.close()
                t.coll = None

    def __enter__(self) -> "IndexJob":
        self.open()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def where(self) -> dict[str, Any]:
        """The backend, Milvus URI and token the collections live in (``open_collection`` keywords)."""
        return dict(self._where)

    @property
    def start(self) -> int:
        return min(t.committed for t in self.targets.values())

    # -- the loop
    def run(self, records: Iterable[Record], total: int | None = None) -> dict[str, Any]:
        """Index ``records`` in this process (the whole corpus, from its first record: already
        committed ones are skipped). Returns the summary (see :meth:`summary`)."""
        return self.drive(self._embedded_here(records), total)

    def drive(self, blocks: Iterable["EmbeddedBlock"], total: int | None = None) -> dict[str, Any]:
        """Write embedded blocks in corpus order, committing every ``commit_every`` records --
        the part of the job every runner shares. ``blocks`` (from :meth:`run`'s own loop, or
        from a distributed runner) start at :attr:`start`; the runner sets :attr:`records_read`."""
        if any(t.coll is None for t in self.targets.values()):
            self.open()
        t_start = time.perf_counter()
        start = self.start
        self._bar = None
        if self.progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, unit="doc", dynamic_ncols=True, file=sys.stderr,
                             desc=f"indexing {self.name}", smoothing=0.1,
                             mininterval=0.5 if sys.stderr.isatty() else 30)
        if start:
            self.log(f"resuming {self.name}: {start} records already committed")
        self._since_commit = 0
        self._pending_bytes = 0
        with _DeferSigint() as guard:
            self._guard = guard
            try:
                for block in blocks:
                    self._write(block)
                for t in self.targets.values():
                    if t.committed > self.records_read:
                        raise InvalidError(
                            f"the corpus has {self.records_read} records but collection {t.name!r} "
                            f"already holds {t.committed} of an earlier run; it is not the same corpus")
                with guard.critical():
                    self._commit_all()
                    self._compact_if_needed()
            except KeyboardInterrupt:
                with guard.critical():
                    self._commit_all()
                self.log(f"\ninterrupted: {min(t.committed for t in self.targets.values())} records "
                         "committed; rerun the same command to continue")
                raise
            finally:
                if self._bar is not None:
                    self._bar.close()
        self.elapsed = time.perf_counter() - t_start
        return self.summary()

    def remaining_work(self) -> dict[str, Any]:
        """What a runner needs to embed the rest of the corpus the way :meth:`run` does."""
        return {"start": self.start, "batch_docs": self.batch_docs, "batch_tokens": self.batch_tokens,
                "specs": self.specs,
                "checks": {t.committed - 1: (t.last_id, t.name) for t in self.targets.values() if t.committed > 0},
                "options": self.options}

    @property
    def specs(self) -> list[str]:
        """Every pooler spec the job embeds with: the collections' and their companions'."""
        return _specs(self.targets.values())

    def _embedded_here(self, records: Iterable[Record]) -> Iterator["EmbeddedBlock"]:
        """The in-process runner: the records from :attr:`start` on, cut into embedding calls by
        :func:`token_calls`, embedded in this process."""
        start = self.start
        checks = self.remaining_work()["checks"]
        self.records_read = 0

        def todo() -> Iterator[tuple[int, Record]]:
            for pos, rec in enumerate(records):
                if pos in checks:
                    check_position(pos, rec, *checks[pos])
                self.records_read = pos + 1
                if pos >= start:
                    yield pos, rec

        for call in token_calls(self.embedder, todo(), self.specs, self.options, batch_tokens=self.batch_tokens,
                                batch_docs=self.batch_docs):
            yield self._embed_call(call)

    def _embed_call(self, call: list["Measured"]) -> "EmbeddedBlock":
        end = call[-1].pos + 1
        active = [t for t in self.targets.values() if t.added < end]
        first = min((t.added for t in active), default=end)
        n_plans = max(len({t.plan for t in active}), 1)
        progress = [0.0]

        def on_batch(n_texts: int, tokens: int) -> None:
            if self._bar is not None:
                progress[0] += n_texts / n_plans
                step = int(progress[0])
                if step:
                    progress[0] -= step
                    self._bar.update(step)

        return embed_records(self.embedder, [m for m in call if m.pos >= first], end, call[-1].record.id,
                             _specs(active), self.options, on_batch=on_batch)

    def _write(self, block: "EmbeddedBlock") -> None:
        """Add one embedded block to every collection that does not hold it yet (a block the
        workers already wrote only moves the job state on), committing every ``commit_every``."""
        with self._guard.critical():
            for t in self.targets.values():
                if t.added >= block.end:
                    continue  # resumed at a later commit than this block
                sel = [i for i, p in enumerate(block.positions) if p >= t.added]
                if sel and block.vectors is not None:
                    vec = [block.vectors[t.spec][i] for i in sel]
                    comp = None if t.companion_pooler is None else [block.vectors[t.companion_pooler][i] for i in sel]
                    t.coll.add([block.ids[i] for i in sel], stored_rows(t.coll.spec, vec),
                               texts=[block.texts[i] for i in sel] if self.store_text else None,
                               metadata=[block.metadata[i] for i in sel],
                               model=self.embedder.model_id, pooler=t.spec, companion=comp)
                    self._pending_bytes += self._stored_bytes(t, vec)
                t.encode_seconds += block.seconds.get(t.spec, 0.0) * (len(sel) / max(len(block.positions), 1))
                t.added = block.end
                t.last_id = block.last_id
            self.records_indexed += block.read
            self.tokens += block.tokens
            self._since_commit += block.read
            if self._bar is not None:
                self._bar.update(block.end - self._bar.n)
                el = self._bar.format_dict.get("elapsed") or 0
                if el:
                    self._bar.set_postfix_str(f"{self.tokens / el:,.0f} tok/s", refresh=False)
            if self._since_commit >= self.commit_every or self._pending_bytes >= self.commit_bytes:
                self._commit_all()
            else:  # a call's freed vectors: heap pages the next call may not fit in (embedpool/allocator.py)
                release_free_memory()

    def _stored_bytes(self, t: Target, vectors: list[np.ndarray]) -> int:
        """Bytes ``vectors`` take in ``t``'s collection until a commit (stored precision; the
        companion rows stay in the companion index after a commit, so they are not counted)."""
        spec = t.coll.spec
        if spec.kind == "sparse":  # (token id, weight) pairs: ids of 2 or 4 bytes, float32 weights
            return sum(int(np.count_nonzero(v)) for v in vectors) * 8 + 16 * len(vectors)
        n = sum(len(v) for v in vectors) if t.multi else len(vectors)
        return n * bytes_per_vector(spec.dim, spec.precision if t.multi else "float32")

    def _commit_all(self) -> None:
        for t in self.targets.values():
            if t.coll is None or t.added == t.committed:
                continue
            self._commit(t)
        self._since_commit = 0
        self._pending_bytes = 0
        release_free_memory()  # the batches' freed buffers: keep the job's memory flat (embedpool/allocator.py)

    def _compact_if_needed(self) -> None:
        """Records re-added after a crash leave tombstones: rebuild so the result equals an
        uninterrupted run."""
        for t in self.targets.values():
            if t.coll.stats().get("tombstones"):
                t.coll.compact()

    def summary(self) -> dict[str, Any]:
        rows = []
        for t in self.targets.values():
            st = t.coll.stats() if t.coll is not None else {}
            rows.append({"pooler": t.label, "spec": t.spec, "collection": t.name,
                         "kind": t.coll.spec.kind if t.coll is not None else ("multi" if t.multi else "single"),
                         "companion_pooler": t.companion_pooler,
                         "documents": st.get("documents"), "vectors": st.get("vectors"),
                         "bytes_on_disk": st.get("bytes_on_disk"), "bytes_per_doc": st.get("bytes_per_doc"),
                         "location": st.get("location"),
                         "encode_seconds": round(t.encode_seconds, 3)})
        secs = self.elapsed
        return {"collection": self.name, "data_dir": str(self.data_dir), "backend": self.backend,
                "runner": self.runner,
                "milvus_uri": self._where["milvus_uri"], "records": self.records_read,
                "indexed_this_run": self.records_indexed, "seconds": round(secs, 3),
                "docs_per_s": round(self.records_indexed / secs, 2) if secs else None,
                "tokens": self.tokens, "tokens_per_s": round(self.tokens / secs, 1) if secs else None,
                "bytes_on_disk": sum(r["bytes_on_disk"] or 0 for r in rows), "collections": rows}


def _specs(targets: Iterable[Target]) -> list[str]:
    """The pooler specs the targets need embedded: their own and their companions'."""
    targets = list(targets)
    return list(dict.fromkeys([t.spec for t in targets] + [t.companion_pooler for t in targets if t.companion_pooler]))


# Recorded in the job state but not compared on resume: vectors of fp32 and of any encoder path
# within the quality bar are compatible (poolers/precision.py), so `auto` on another CPU may continue a job.
_RECORDED_ONLY = frozenset({"encoder_precision"})


# ---------------------------------------------------------------------------------- shared by the runners
@dataclass
class EmbeddedBlock:
    """One block of the corpus, embedded: what every runner hands to :meth:`IndexJob.drive`.

    Attributes:
        positions, ids, texts, metadata: the records kept (a duplicate id inside the block:
            its last record), in corpus order.
        vectors: per spec, one vector (or ``[n_i, D]`` array) per kept record; ``None`` when the
            workers wrote them to the collections themselves.
        seconds: per spec, the time it took to embed the block with it.
        tokens: tokens through the encoder.
        end: the position after the block's last record; last_id: that record's id.
        read: records of the block embedded (kept or not).
    """

    positions: list[int]
    ids: list[str]
    texts: list[str]
    metadata: list[dict | None]
    vectors: dict[str, list[np.ndarray]] | None
    seconds: dict[str, float]
    tokens: int
    end: int
    last_id: str
    read: int


def check_position(pos: int, rec: Record, expected_id: str | None, collection: str) -> None:
    """The record at a committed position must still be the one indexed there."""
    if rec.id != expected_id:
        raise InvalidError(
            f"the corpus changed since collection {collection!r} was indexed: record {pos} is {rec.id!r}, "
            f"it was {expected_id!r}; use another --collection name (or delete the collection) to index "
            "this corpus")


@dataclass
class Measured:
    """A record of the corpus at position ``pos``, tokenized (``tokenized``, ``tokens``: what
    :meth:`poolers.Embedder.measure` gives) for the embedding call it goes into."""

    pos: int
    record: Record
    tokenized: Tokenized | None = None
    tokens: int = 0


def token_calls(embedder, items: Iterable[tuple[int, Record]], specs: list[str], options: EmbedOptions = DOCUMENT,
                *, batch_tokens: int, batch_docs: int) -> Iterator[list[Measured]]:
    """``(position, record)`` items cut into embedding calls of at most ``batch_tokens`` tokens
    -- every plan the ``specs`` need, counted after windowing, tokenized with ``options`` (the
    job's) -- and ``batch_docs`` records; a
    record over the budget is a call of its own (the encoder forwards its windows a token-budget
    batch at a time). Records are tokenized a group at a time and each call reuses their rows,
    so nothing is tokenized twice. The same cut in this process and on a Ray worker."""
    call: list[Measured] = []
    tokens = 0
    for group in _measure_groups(items, min(MEASURE_RECORDS, batch_docs), min(MEASURE_CHARS, 4 * batch_tokens)):
        for m in _measure(embedder, group, specs, options):
            if call and tokens + m.tokens > batch_tokens:
                yield call
                call, tokens = [], 0
            call.append(m)
            tokens += m.tokens
            if len(call) >= batch_docs or tokens >= batch_tokens:
                yield call
                call, tokens = [], 0
    if call:
        yield call


def _measure_groups(items: Iterable[tuple[int, Record]], records: int,
                    chars_max: int) -> Iterator[list[tuple[int, Record]]]:
    """The items in groups tokenized together: at most ``records`` of them and about
    ``chars_max`` characters (so a group is read no further ahead than a call needs)."""
    group: list[tuple[int, Record]] = []
    chars = 0
    for item in items:
        group.append(item)
        chars += len(item[1].text) if isinstance(item[1].text, str) else 0
        if len(group) >= records or chars >= chars_max:
            yield group
            group, chars = [], 0
    if group:
        yield group


def _measure(embedder, group: list[tuple[int, Record]], specs: list[str], options: EmbedOptions) -> list[Measured]:
    try:
        w = embedder.measure([r.text for _, r in group], specs, options)
    except InvalidError as e:
        raise InvalidError(f"{_culprit(group)}: {e}") from e
    return [Measured(p, r, tok, n) for (p, r), tok, n in zip(group, w.tokenized, w.tokens)]


def embed_records(embedder, recs: list[Measured], end: int, last_id: str, specs: list[str],
                  options: EmbedOptions = DOCUMENT, *,
                  on_batch: Callable[[int, int], None] | None = None) -> EmbeddedBlock:
    """Embed one call's records (from :func:`token_calls`, with the same ``options``) with every
    spec -- the same code in this process and on a Ray worker -- reusing their tokenization. A record the encoder refuses
    fails the call with an :class:`InvalidError` naming it."""
    last_of: dict[str, int] = {}  # duplicate ids inside one call: the last one wins (as a later upsert would)
    for j, m in enumerate(recs):
        last_of[m.record.id] = j
    keep = [recs[j] for j in sorted(last_of.values())]
    texts = [m.record.text for m in keep]
    if not keep or not specs:
        return EmbeddedBlock([], [], [], [], {s: [] for s in specs}, {}, 0, end, last_id, len(recs))
    tokenized = [m.tokenized for m in keep]
    try:
        emb = embed_by_plan(embedder, texts, specs, options, on_batch=on_batch,
                            tokenized=None if None in tokenized else tokenized)
    except InvalidError as e:
        raise InvalidError(f"{_culprit([(m.pos, m.record) for m in keep])}: {e}") from e
    return EmbeddedBlock([m.pos for m in keep], [m.record.id for m in keep], texts,
                         [m.record.metadata for m in keep], emb.vectors, emb.seconds, emb.tokens, end, last_id,
                         len(recs))


def _culprit(keep: list[tuple[int, Record]]) -> str:
    """The record of a block the encoder refused: the first whose text is no valid string, else
    the block's range."""
    for pos, r in keep:
        try:
            if isinstance(r.text, str):
                r.text.encode("utf-8")
                continue
            why = f"its text is {type(r.text).__name__}, not a string"
        except UnicodeEncodeError:
            why = "its text is not valid Unicode"
        return f"record {pos} (id {r.id!r}) cannot be embedded ({why})"
    return f"records {keep[0][0]}-{keep[-1][0]} (ids {keep[0][1].id!r}..{keep[-1][1].id!r}) cannot be embedded"


def _diff_settings(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted((set(old) | set(new)) - _RECORDED_ONLY):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff_settings(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} then, {b!r} now")
    return out


def format_summary(s: dict[str, Any]) -> str:
    """The end-of-job summary as a small table."""
    head = (f"{s['records']} records ({s['indexed_this_run']} this run) in {s['seconds']:.1f}s"
            + (f", {s['docs_per_s']:.1f} docs/s, {s['tokens_per_s']:,.0f} tokens/s" if s["docs_per_s"] else "")
            + (f"; {s['bytes_on_disk'] / 1e6:.1f} MB on disk in {s['data_dir']}"
               if all(r["bytes_on_disk"] is not None for r in s["collections"]) else
               f"; in {s['collections'][0]['location']}"))
    cols = ["collection", "pooler", "companion_pooler", "kind", "documents", "vectors", "bytes_per_doc",
            "bytes_on_disk", "encode_seconds"]
    return head + "\n" + render_table(cols, [[r[c] for c in cols] for r in s["collections"]])
