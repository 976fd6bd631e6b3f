"""What the routes share: the engine (model loaded in the background, the batcher) and the open
collections. Routes get them through the dependencies in :mod:`app.server.deps`."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from embedpool import index
from embedpool.app.batcher import Batcher, EmbedOutput, Job
from embedpool.app.server.cache import VectorCache
from embedpool.app.server.limits import check_workload
from embedpool.app.server.metrics import Metrics
from embedpool.app.settings import Settings
from embedpool.errors import ConflictError, InvalidError, NotFoundError, UnavailableError
from embedpool.index import CollectionBase

if TYPE_CHECKING:
    from embedpool.poolers import Embedder

log = logging.getLogger("embedpool.server")

#: Integer pooler options above this are refused over HTTP (e.g. attention:queries=10**6
#: would allocate without bound).
MAX_INT_OPTION = 4096
#: Requests with at most this many characters are tokenized (their limits checked) on the event
#: loop (~1 µs per character); larger ones in a worker thread.
INLINE_CHECK_CHARS = 4096


class Engine:
    """The embedder, loaded in a background thread, and the batcher in front of it."""

    def __init__(self, settings: Settings, metrics: Metrics, embedder: Embedder | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.embedder = embedder
        self.batcher: Batcher | None = None
        self.error: str | None = None
        self.load_seconds: float | None = None
        self.loaded_at: int | None = None  # Unix time the model became ready (``created`` of /v1/models)
        self._thread: threading.Thread | None = None
        self._default_pooler: str | None = None
        self.rerank_cache = VectorCache(settings.rerank_cache_mb * 2**20)

    # ------------------------------------------------------------------ lifecycle
    @property
    def status(self) -> str:
        if self.batcher is not None:
            return "ready"
        return "failed" if self.error else "loading"

    def start(self) -> None:
        """Load the model (unless given) in a thread, warm it up, then start the batcher."""
        if self.embedder is not None:
            self._ready()
            return
        self._thread = threading.Thread(target=self._load, name="embedpool-load", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        from embedpool.app.settings import load_embedder

        t0 = time.perf_counter()
        try:
            embedder = load_embedder(self.settings)
            embedder.embed(["warm up"], [self.settings.pooler])  # first call builds kernels
        except BaseException as exc:  # noqa: BLE001 - reported by /health
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("model failed to load: %s", self.error)
            return
        self.embedder = embedder
        self.load_seconds = time.perf_counter() - t0
        self._ready()
        log.info("model %s loaded in %.1fs", embedder.model_id, self.load_seconds)

    def _ready(self) -> None:
        s = self.settings
        self.loaded_at = int(time.time())
        self._default_pooler = self.embedder.canonical(s.pooler)
        self.batcher = Batcher(self.embedder, max_queue=s.max_queue, max_batch_tokens=s.max_batch_tokens,
                               max_wait_ms=s.max_wait_ms, observer=self.metrics,
                               before_round=thread_policy(s.single_thread_tokens)).start()
        from embedpool.poolers.precision import cpu_features

        encoder = self.embedder.encoder
        self.metrics.on_loaded(encoder.precision, s.precision, cpu_features().isa)

    def stop(self) -> None:
        if self.batcher is not None:
            self.batcher.stop()

    def require(self) -> Embedder:
        """The embedder, or 503 while it loads."""
        if self.batcher is None:
            if self.error:
                raise UnavailableError(f"the model failed to load: {self.error}")
            raise UnavailableError("the model is still loading; retry shortly (GET /health turns 200 when ready)",
                                   retry_after=5)
        return self.embedder

    # ------------------------------------------------------------------ poolers
    @property
    def default_pooler(self) -> str:
        return self._default_pooler or self.settings.pooler

    def pooler(self, spec: str | None, field: str = "pooler", *, trusted: bool = False) -> tuple[str, bool]:
        """Validate ``spec`` (``None``: the server's default) -> (canonical spec, multi_vector).

        ``trusted``: the spec comes from a collection's manifest, not from the request."""
        from embedpool.poolers import parse_spec

        embedder = self.require()
        spec = spec or self.settings.pooler
        try:
            name, opts = parse_spec(spec)
            if not trusted:
                self._check_options(name, opts)
            p = embedder.pooler(spec)
        except (InvalidError, NotFoundError, OSError) as exc:  # a weights path: missing, unreadable
            raise InvalidError(f"{field}: {exc}", param=field) from None
        return p.spec, bool(p.multi_vector)

    def _check_options(self, name: str, opts: dict[str, str]) -> None:
        from embedpool.poolers import parse_spec

        if "weights" in opts and not self.settings.allow_pooler_paths:
            allowed = parse_spec(self.settings.pooler)[1].get("weights")
            if opts["weights"] != allowed:
                raise InvalidError("loading pooler weights from a path named in a request is disabled; "
                                 "set the server's default pooler (EMBEDPOOL_POOLER) to that head, or "
                                 "start it with EMBEDPOOL_ALLOW_POOLER_PATHS=true")
        for key, raw in opts.items():
            try:
                value = float(raw)
            except ValueError:
                continue
            if not math.isfinite(value) or abs(value) > MAX_INT_OPTION:
                raise InvalidError(f"pooler {name!r}: option {key}={raw} is out of range "
                                 f"(use a finite value of at most {MAX_INT_OPTION})")

    def check_dimensions(self, dimensions: int | None, field: str = "dimensions") -> None:
        try:
            self.require().check_dimensions(dimensions)
        except InvalidError as exc:
            raise InvalidError(f"{field}: {exc}", param=field) from None

    def check_prompt(self, prompt_name: str | None, field: str = "prompt_name") -> None:
        """422 unless the model has a prompt of that name (``None``: nothing to check)."""
        if prompt_name is None:
            return
        try:
            self.require().encoder.prompt_for(None, prompt_name)
        except ValueError as exc:
            raise InvalidError(str(exc) if str(exc).startswith(field) else f"{field}: {exc}", param=field) from None

    # ------------------------------------------------------------------ embedding
    async def embed(self, request: Request | None, texts: list[str], specs: list[str], *,
                    role: str = "document", normalize: bool = True, dimensions: int | None = None,
                    truncate: bool = True, prompt_name: str | None = None,
                    truncation_direction: str = "right", field: str = "inputs") -> EmbedOutput:
        """Embed through the batcher; if the client disconnects first, drop the work (499).
        ``field`` names the request field in a 413 of the work limits (see :meth:`embed_many`)."""
        options = {"role": role, "normalize": normalize, "dimensions": dimensions, "truncate": truncate,
                   "prompt_name": prompt_name, "truncation_direction": truncation_direction}
        return (await self.embed_many(request, [(texts, specs, options)], field=field))[0]

    async def embed_many(self, request: Request | None,
                         parts: list[tuple[list[str], list[str], dict[str, Any]]],
                         field: str = "inputs") -> list[EmbedOutput]:
        """Several embeddings of one request (``(texts, specs, options)`` each, options as for
        :meth:`embed`), queued together so they share a batcher round (see
        :meth:`Batcher.submit_many`); all or none.

        The request's work limits (all parts together) are checked first, on its tokenization:
        413 before anything is queued or encoded (a large request tokenizes in a worker thread,
        not to stall the event loop). That tokenization is what the batcher's worker encodes,
        so a request is tokenized once, off the thread that runs the model."""
        embedder = self.require()
        assert self.batcher is not None
        check = functools.partial(check_workload, embedder, parts, self.settings, field=field)
        # a few sentences tokenize in well under a millisecond: not worth a thread hop
        small = sum(len(t) for texts, _, _ in parts for t in texts) <= INLINE_CHECK_CHARS
        works = check() if small else await run_in_threadpool(check)
        # the worker encodes the tokenization the check made (it does not tokenize again)
        jobs = self.batcher.submit_many([
            (texts, specs, {**options, "cost_tokens": w.tokens, "usage_tokens": w.counts, "tokenized": w.tokenized})
            for (texts, specs, options), w in zip(parts, works)])
        results = [asyncio.wrap_future(job.future) for job in jobs]
        gathered = asyncio.ensure_future(asyncio.gather(*results))
        if request is None:
            return list(await gathered)
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self._cancel(jobs)
            raise
        finally:
            if not watcher.done():
                watcher.cancel()
        if gathered in done:
            if gathered.exception() is not None:
                self._cancel(jobs)
            return list(gathered.result())
        self._cancel(jobs)
        gathered.cancel()
        raise InvalidError("the client closed the connection; its work was dropped", code="client_closed")

    def _cancel(self, jobs: list[Job]) -> None:
        assert self.batcher is not None
        for job in jobs:
            self.batcher.cancel(job)


def thread_policy(single_thread_tokens: int):
    """``f(tokens)`` for the batcher's worker: rounds under ``single_thread_tokens`` (estimated)
    run torch on one thread, larger ones on all of them. A one-sentence forward is a chain of
    tiny matrix products that a second thread barely speeds up, while every one of them waits
    for that thread; on a busy machine it is often descheduled, and the forward gets slower.
    ``None`` (no policy) when the setting is 0 or torch has one thread anyway."""
    if single_thread_tokens <= 0:
        return None
    import torch

    full = torch.get_num_threads()
    if full <= 1:
        return None
    current = [full]

    def before_round(tokens: int) -> None:
        n = 1 if tokens < single_thread_tokens else full
        if n != current[0]:  # per thread in OpenMP: this runs in the worker that encodes
            torch.set_num_threads(n)
            current[0] = n

    return before_round


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class Collections:
    """Open collections, shared by all requests, on the configured backend (``faiss`` folders
    under ``data_dir``, or Milvus).

    One collection object per name stays open (searches run concurrently on it; its writes are
    serialized by the collection). Each request first asks it to ``refresh()`` (cheap when
    nothing changed): if another process committed to it (e.g. ``embedpool index``), the request
    sees the new state; if another process deleted it, it is closed here too.
    """

    def __init__(self, settings: Settings) -> None:
        self.data_dir = Path(settings.data_dir)
        self._where = settings.store()
        self._open: dict[str, CollectionBase] = {}
        self._lock = threading.RLock()

    def get(self, name: str) -> CollectionBase:
        with self._lock:
            coll = self._open.get(name)
        if coll is not None:  # refreshed outside the lock: requests for others do not wait
            try:
                coll.refresh()  # committed by another process
                return coll
            except ConflictError:
                return coll  # our own write is in progress; it refreshes after
            except NotFoundError:  # deleted by another process
                with self._lock:
                    if self._open.get(name) is coll:
                        del self._open[name]
                coll.close()
        with self._lock:
            coll = self._open.get(name)
            if coll is None:
                coll = self._open[name] = index.open_collection(self.data_dir, name, **self._where)
            return coll

    def create(self, name: str, spec: index.CollectionSpec) -> tuple[CollectionBase, bool]:
        """(collection, created): an existing one with the same spec is returned as is."""
        with self._lock:
            existed = name in self.names()
            coll = index.open_collection(self.data_dir, name, spec, **self._where)
            old = self._open.get(name)
            if old is not None and old is not coll:
                coll.close()
                coll = old
            self._open[name] = coll
            return coll, not existed

    def add(self, coll: CollectionBase, ids: list[str], vectors: Any, texts: list[str] | None = None,
            metadata: list[dict | None] | None = None, *, model: str | None = None, pooler: str | None = None,
            companion: Any = None) -> None:
        """:meth:`index.CollectionBase.add` (an upsert), committed."""
        self._committed(coll, lambda: coll.add(ids, vectors, texts, metadata, model=model, pooler=pooler,
                                               companion=companion))

    def delete_documents(self, coll: CollectionBase, ids: list[str]) -> None:
        """``coll.delete(ids)``, committed."""
        self._committed(coll, lambda: coll.delete(ids))

    def delete_where(self, coll: CollectionBase, filter: Any) -> int:
        """``coll.delete_where(filter)``, committed: how many documents it deleted."""
        n = [0]
        self._committed(coll, lambda: n.__setitem__(0, coll.delete_where(filter)))
        return n[0]

    @staticmethod
    def _committed(coll: CollectionBase, write: Callable[[], None]) -> None:
        """``write()`` then commit; if another process committed meanwhile, refresh and retry once."""
        for attempt in (0, 1):
            try:
                write()
                coll.commit()
                break
            except ConflictError:
                if attempt or not coll.refresh():
                    raise

    def delete(self, name: str) -> None:
        with self._lock:
            coll = self._open.pop(name, None)
            if coll is not None:
                coll.close()
            index.delete_collection(self.data_dir, name, **self._where)

    def names(self) -> list[str]:
        return index.list_collections(self.data_dir, **self._where)

    def manifest(self, name: str) -> dict[str, Any]:
        """The manifest: with the current counts of a collection this server has open, else the
        committed one, read without opening the collection (loading its vectors)."""
        with self._lock:
            if name in self._open:
                return self.get(name).manifest
        return index.read_collection_manifest(self.data_dir, name, **self._where)

    def close(self) -> None:
        with self._lock:
            for coll in self._open.values():
                coll.close()
            self._open.clear()
