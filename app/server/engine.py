"""The server's engine: one model (loaded in the background) and the batcher in front of it,
and the two cores every route calls -- embedding (:meth:`Engine.embed_pooled`,
:meth:`Engine.embed_many`) and reranking (:meth:`Engine.rank`). Routers translate their request
shapes into these calls and their answers back; they never call each other.

A model is an embedding model (:class:`poolers.Embedder`, ``Engine.embedder``) or a reranker (a
cross-encoder, :class:`poolers.CrossEncoderModel`, ``Engine.reranker``), told apart by its files
when it loads. A reranker answers :meth:`Engine.rank` only (its pairs through the same batcher,
limits and disconnect handling as texts); asked for embeddings (:meth:`Engine.require`) it is a
422 naming the model and what it is. An embedding model ranks by MaxSim or cosine of its vectors.

The options of an embedding are one :class:`poolers.EmbedOptions`, built once by the route from
its request and carried unchanged through the limits (:func:`app.server.limits.check_workload`,
which measures the request with them) and the batcher to the worker that encodes it; every
answer is one :class:`poolers.EmbedResult`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from fastapi import Request
from starlette.concurrency import run_in_threadpool

from embedpool import index
from embedpool.app.batcher import Batcher, Job
from embedpool.app.server.cache import VectorCache
from embedpool.app.server.limits import check_inputs, check_workload, within_limits
from embedpool.app.server.metrics import Metrics
from embedpool.app.settings import Settings
from embedpool.errors import ConflictError, InvalidError, NotFoundError, UnavailableError
from embedpool.poolers import EmbedOptions, EmbedResult, Workload

if TYPE_CHECKING:
    from embedpool.poolers import CrossEncoderModel, Embedder

log = logging.getLogger("embedpool.server")

#: Integer pooler options above this are refused over HTTP (e.g. attention:queries=10**6
#: would allocate without bound).
MAX_INT_OPTION = 4096
#: Requests with at most this many characters are tokenized (their limits checked) on the event
#: loop (~1 µs per character); larger ones in a worker thread.
INLINE_CHECK_CHARS = 4096
#: Requests with at most this many characters whose limits hold without counting are tokenized
#: by the batcher's worker, a round in one call: a query's cost is the tokenizer's Python per
#: call, which one call per round shares. A longer text's cost is per token, paid on the
#: worker's critical path (SciFact documents at c=32: 8% of its time), so it is tokenized before
#: queueing, alongside the forward of the round before.
WORKER_TOKENIZE_CHARS = 1024
#: the pooler of a rerank that names none: token vectors, scored by MaxSim
RERANK_POOLER = "tokens"
#: document token rows scored per :func:`index.maxsim_scores` call (bounds the copy into one block)
BLOCK_ROWS = 16384


@dataclass(frozen=True)
class EmbedPart:
    """One embedding of a request: ``texts`` with every pooler of ``specs``, under ``options``.
    ``names``: the request field each text came from (``["query"]``, ``["texts[3]", ...]``), when
    the route wants an input over the model's window (``truncate: false``) named by it; else the
    engine's own message (``input 3 has ... tokens``) answers."""

    texts: list[str]
    specs: list[str]
    options: EmbedOptions
    names: list[str] | None = None


@dataclass(frozen=True)
class Ranking:
    """Scores of the texts in request order, their order best first, and the usage (tokens)."""

    scores: np.ndarray
    order: np.ndarray
    tokens: int


class Engine:
    """One served model: its embedder (or, for a cross-encoder, its reranker), loaded in a
    background thread, the batcher in front of it (its own queue and limits) and its rerank
    cache. ``name``: what requests call it by (``model``), ``settings.model`` its path or id."""

    def __init__(self, settings: Settings, metrics: Metrics, embedder: Embedder | CrossEncoderModel | None = None,
                 name: str | None = None) -> None:
        self.name = name or (embedder.model_id if embedder is not None else settings.model or "default")
        self.settings = settings
        self.metrics = metrics
        self.embedder: Embedder | None = None
        self.reranker: CrossEncoderModel | None = None
        self._set_model(embedder)
        self.batcher: Batcher | None = None
        self.error: str | None = None
        self.load_seconds: float | None = None
        self.loaded_at: int | None = None  # Unix time the model became ready (``created`` of /v1/models)
        self._thread: threading.Thread | None = None
        self._default_pooler: str | None = None
        self._names: list[str] | None = None
        self.rerank_cache = VectorCache(settings.rerank_cache_mb * 2**20)

    # ------------------------------------------------------------------ lifecycle
    @property
    def status(self) -> str:
        if self.batcher is not None:
            return "ready"
        return "failed" if self.error else "loading"

    @property
    def model(self) -> Embedder | CrossEncoderModel | None:
        """The loaded model, an embedder or a reranker (``None`` while it loads)."""
        return self.embedder if self.embedder is not None else self.reranker

    @property
    def kind(self) -> str | None:
        """``embedding`` or ``reranker`` once loaded."""
        return None if self.model is None else "reranker" if self.reranker is not None else "embedding"

    def _set_model(self, model: Embedder | CrossEncoderModel | None) -> None:
        if getattr(model, "kind", None) == "reranker":
            self.reranker = model
        else:
            self.embedder = model

    def start(self) -> None:
        """Load the model (unless given) in a thread, warm it up, then start the batcher."""
        if self.model is not None:
            self._ready()
            return
        self._thread = threading.Thread(target=self._load, name="embedpool-load", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        from embedpool.app.settings import load_model

        t0 = time.perf_counter()
        try:
            model = load_model(self.settings)
            if getattr(model, "kind", None) == "reranker":
                model.embed([("warm", "up")])  # first call builds kernels
            else:
                model.embed(["warm up"], [self.settings.pooler])
        except BaseException as exc:  # noqa: BLE001 - reported by /health
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("model %s failed to load: %s", self.name, self.error)
            return
        self._set_model(model)
        self.load_seconds = time.perf_counter() - t0
        # The model and its libraries are some hundred thousand long-lived objects that every
        # full garbage collection would walk again, on the thread that answers requests: set
        # them aside (they stay alive as long as the server anyway).
        gc.collect()
        gc.freeze()
        self._ready()
        log.info("%s model %s (%s) loaded in %.1fs", self.kind, self.name, model.model_id, self.load_seconds)

    def _ready(self) -> None:
        s = self.settings
        self.loaded_at = int(time.time())
        self._default_pooler = self.embedder.canonical(s.pooler) if self.embedder is not None else None
        self.batcher = Batcher(self.model, max_queue=s.max_queue, max_batch_tokens=s.max_batch_tokens,
                               max_wait_ms=s.max_wait_ms, observer=self.metrics.for_model(self.name),
                               before_round=thread_policy(s.single_thread_tokens)).start()
        from embedpool.cpu import cpu_features

        encoder = self.model.encoder
        self.metrics.on_loaded(encoder.precision, s.precision, cpu_features().isa)

    def stop(self) -> None:
        if self.batcher is not None:
            self.batcher.stop()

    def require_model(self) -> Embedder | CrossEncoderModel:
        """The model, embedder or reranker, or 503 while it loads."""
        if self.batcher is None:
            if self.error:
                raise UnavailableError(f"the model {self.name!r} failed to load: {self.error}")
            raise UnavailableError(f"the model {self.name!r} is still loading; retry shortly (GET /health turns 200 "
                                   "when ready)", retry_after=5)
        return self.model

    def require(self) -> Embedder:
        """The embedder, or 503 while it loads; 422 for a reranker, which gives no embeddings."""
        model = self.require_model()
        if self.reranker is not None:
            raise InvalidError(f"model {self.name!r} is a reranker (a cross-encoder: it scores query-document pairs) "
                               "and gives no embeddings; rank with it on POST /rerank, /v1/rerank or /tei/rerank, or "
                               "name an embedding model in `model`", param="model")
        return model

    def names(self) -> list[str]:
        """What a request may call this model: its name, its id and the id's aliases."""
        from embedpool.poolers.encoder import model_aliases

        if self.model is None:
            return [self.name]
        if self._names is None:  # asked on every request that names no served model (OpenAI clients)
            model_id = self.model.model_id
            self._names = list(dict.fromkeys([self.name, model_id, *model_aliases(model_id)]))
        return list(self._names)

    # ------------------------------------------------------------------ checks
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
    async def embed_pooled(self, request: Request | None, texts: list[str], pooler: str | None,
                           options: EmbedOptions, *, multi: bool, alternative: str,
                           field: str = "inputs") -> tuple[str, EmbedResult]:
        """``(canonical spec, result)`` of ``texts`` embedded with one pooler, which must be
        multi-vector or not as ``multi`` says (a 422 naming ``alternative``, the route that takes
        the other kind, if not): the checks and the embedding of ``/v1/embeddings`` and TEI's
        embedding routes."""
        check_inputs(texts, self.settings, field)
        spec, is_multi = self.pooler(pooler)
        if is_multi and not multi:
            raise InvalidError(f"pooler: {spec!r} gives several vectors per input, which this route's answer "
                               f"cannot carry; {alternative}", param="pooler")
        if multi and not is_multi:
            raise InvalidError(f"pooler: {spec!r} gives one vector per input, and this route answers a list of "
                               f"vectors per input: send a multi-vector pooler (tokens, cluster), or {alternative}",
                               param="pooler")
        self.check_dimensions(options.dimensions)
        self.check_prompt(options.prompt_name)
        return spec, await self.embed(request, texts, [spec], options, field=field)

    async def embed(self, request: Request | None, texts: list[str], specs: list[str],
                    options: EmbedOptions, field: str = "inputs") -> EmbedResult:
        """``texts`` embedded with every pooler of ``specs`` through the batcher; if the client
        disconnects first, its work is dropped (499). ``field`` names the request field in a
        413 of the work limits (see :meth:`embed_many`)."""
        return (await self.embed_many(request, [EmbedPart(texts, specs, options)], field=field))[0]

    async def embed_many(self, request: Request | None, parts: list[EmbedPart],
                         field: str = "inputs") -> list[EmbedResult]:
        """Several embeddings of one request, queued together so they share a batcher round
        (see :meth:`Batcher.submit_many`); all or none.

        The request's work limits (all parts together) are checked first: 413 before anything
        is queued or encoded. When they hold whatever its texts tokenize to (single-vector
        poolers on truncated inputs: :func:`limits.within_limits`) and it is short (e.g. a query
        on ``/v1/embeddings``), it is queued unmeasured and the batcher's worker tokenizes it once,
        with the other requests of its round, in one tokenizer call. Otherwise they are checked
        on its tokenization (a large request tokenizes in a worker thread, not to stall the event
        loop), which is what the batcher's worker encodes. Either way a request is tokenized once."""
        embedder = self.require()
        assert self.batcher is not None
        works: list[Workload | None]
        chars = sum(len(t) for part in parts for t in part.texts)
        if chars <= WORKER_TOKENIZE_CHARS and within_limits(embedder, parts, self.settings):
            # nothing to check: the worker tokenizes it once, with the rest of its round, in one
            # tokenizer call (cheaper than one per request on the thread that answers requests)
            works = [None] * len(parts)
        elif chars <= INLINE_CHECK_CHARS:
            # a few sentences tokenize in well under a millisecond: not worth a thread hop
            works = check_workload(embedder, parts, self.settings, field=field)
        else:
            works = await run_in_threadpool(check_workload, embedder, parts, self.settings, field=field)
        jobs = self.batcher.submit_many([(p.texts, p.specs, p.options, w) for p, w in zip(parts, works)])
        return await self._wait(request, jobs)

    async def _wait(self, request: Request | None, jobs: list[Job]) -> list[EmbedResult]:
        """The results of ``jobs``, queued together; if the client disconnects first, their work
        is dropped (499)."""
        futures = [asyncio.wrap_future(job.future) for job in jobs]
        gathered = futures[0] if len(futures) == 1 else asyncio.gather(*futures)  # one request, one part: no gather
        if request is None:
            return _results(await gathered)
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
            return _results(gathered.result())
        self._cancel(jobs)
        gathered.cancel()
        raise InvalidError("the client closed the connection; its work was dropped", code="client_closed")

    def _cancel(self, jobs: list[Job]) -> None:
        assert self.batcher is not None
        for job in jobs:
            self.batcher.cancel(job)

    # ------------------------------------------------------------------ rerank
    async def rank(self, request: Request | None, query: str, texts: list[str], pooler: str | None,
                   options: EmbedOptions, *, raw_scores: bool, field: str = "texts") -> Ranking:
        """Score ``texts`` against ``query``: the one path of POST /rerank, /v1/rerank and TEI's
        /tei/rerank (limits, pooler, the cache, one batcher round). ``options``: the route's
        (truncation); the query is embedded in the query role, the texts as documents, both
        normalized at full size. A multi-vector pooler (default ``tokens``) scores each text by
        exact MaxSim (:func:`index.maxsim_scores`), a single-vector one by cosine. ``field``
        names the texts in errors. A reranker (cross-encoder) scores each (query, text) pair itself
        (:meth:`_cross_rank`)."""
        check_inputs([query], self.settings, "query")
        check_inputs(texts, self.settings, field)
        if self.require_model() is self.reranker:
            return await self._cross_rank(request, query, texts, pooler, options, raw_scores=raw_scores, field=field)
        spec, multi = self.pooler(pooler or RERANK_POOLER)
        base = dataclasses.replace(options, normalize=True, dimensions=None, prompt_name=None)
        q_opts = dataclasses.replace(base, role="query")
        d_opts = dataclasses.replace(base, role="document")
        key = (spec, d_opts)
        docs = self.rerank_cache.get_many(key, texts)
        missing = list(dict.fromkeys(t for t, v in zip(texts, docs) if v is None))
        first = {t: i for i, t in reversed(list(enumerate(texts)))}
        q_out, d_out = await self.embed_many(request, [
            EmbedPart([query], [spec], q_opts, names=["query"]),
            EmbedPart(missing, [spec], d_opts, names=[f"{field}[{first[t]}]" for t in missing]),
        ], field=field)
        fresh = dict(zip(missing, d_out.vectors.get(spec, [])))
        self.rerank_cache.put_many(key, missing, [fresh[t] for t in missing])
        vectors = [v if v is not None else fresh[t] for t, v in zip(texts, docs)]
        scores = await run_in_threadpool(_scores, q_out.vectors[spec][0], vectors, multi, raw_scores)
        return Ranking(scores, np.argsort(-scores, kind="stable"), q_out.usage + d_out.usage)

    async def _cross_rank(self, request: Request | None, query: str, texts: list[str], pooler: str | None,
                          options: EmbedOptions, *, raw_scores: bool, field: str) -> Ranking:
        """A reranker's scores: each (query, text) pair through the cross-encoder, its activation
        applied unless ``raw_scores``. The pairs are measured first (the work limits; an input
        over the model's window with ``truncate: false`` is a 422 naming it), then queued as one
        request: the batcher cuts them into token-budget rounds shared with other requests."""
        from embedpool.poolers.crossencoder import SCORE

        if pooler is not None:
            raise InvalidError(f"pooler: model {self.name!r} is a reranker (a cross-encoder), which scores each "
                               "query-text pair itself; send no pooler", param="pooler")
        assert self.batcher is not None
        pairs = [(query, t) for t in texts]
        parts = [EmbedPart(pairs, [SCORE], options)]  # type: ignore[arg-type]  # pairs are the reranker's inputs
        if len(query) * len(texts) + sum(len(t) for t in texts) <= INLINE_CHECK_CHARS:
            works = check_workload(self.reranker, parts, self.settings, field=field)
        else:
            works = await run_in_threadpool(check_workload, self.reranker, parts, self.settings, field=field)
        jobs = self.batcher.submit_many([(pairs, [SCORE], options, works[0])])
        (result,) = await self._wait(request, jobs)
        rows = np.stack(result.vectors[SCORE]) if texts else np.zeros((0, 2), np.float32)
        scores = np.ascontiguousarray(rows[:, 1 if raw_scores else 0], dtype=np.float32)
        return Ranking(scores, np.argsort(-scores, kind="stable"), result.usage)


class Engines:
    """The models a server holds, by name, in the order given; the first is the default.

    A request picks one by ``model`` (its name, its id or an alias of the id); none named: the
    default. Each engine has its own encoder, batcher (queue) and rerank cache."""

    def __init__(self, engines: list[Engine]) -> None:
        if not engines:
            raise InvalidError("serve at least one model (--model)", param="--model")
        self._engines = {e.name: e for e in engines}
        self.default = engines[0]

    def __iter__(self):
        return iter(self._engines.values())

    def __len__(self) -> int:
        return len(self._engines)

    @property
    def status(self) -> str:
        """``ready`` when every model is, ``failed`` when one failed, else ``loading``."""
        states = {e.status for e in self}
        return "ready" if states == {"ready"} else "failed" if "failed" in states else "loading"

    def start(self) -> None:
        for e in self:
            e.start()

    def stop(self) -> None:
        for e in self:
            e.stop()

    def pick(self, model: str | None, *, lenient: bool = False) -> Engine:
        """The engine ``model`` names (``None``: the default). An unknown name is a 404 naming the
        served ones -- except, with ``lenient`` (the OpenAI and Cohere routes, whose clients must
        send some model name), on a server of one model, which answers every name as it always did."""
        if model is None:
            return self.default
        if model in self._engines:
            return self._engines[model]
        for e in self:
            if model in e.names():
                return e
        if lenient and len(self) == 1:
            return self.default
        served = ", ".join(repr(n) for n in self._engines)
        raise NotFoundError(f"model {model!r} is not served here; this server serves {served} (GET /v1/models "
                            "lists them with their other names)", param="model")

    def for_collection(self, collection: str, model_id: str | None) -> Engine:
        """The engine of the model a collection's vectors were made with (``model_id``, from its
        manifest; ``None``: the default): it embeds every write and query of that collection."""
        if not model_id:
            return self.default
        for e in self:
            e.require_model()
            if e.embedder is not None and e.embedder.model_id == model_id:
                return e
        served = ", ".join(repr(e.embedder.model_id) for e in self if e.embedder is not None)
        raise ConflictError(f"collection {collection!r} holds vectors of model {model_id!r}, but this server runs "
                            f"{served}; serve that model too (--model NAME={model_id}) or use another collection",
                            param="model")


def _scores(query: np.ndarray, docs: list[np.ndarray], multi: bool, raw: bool) -> np.ndarray:
    if not multi:
        return np.stack(docs) @ query
    out = np.empty(len(docs), dtype=np.float32)
    start = 0
    while start < len(docs):  # blocks of documents, so the token rows are copied a block at a time
        end, rows = start, 0
        while end < len(docs) and (end == start or rows + len(docs[end]) <= BLOCK_ROWS):
            rows += len(docs[end])
            end += 1
        block = docs[start:end]
        offsets = np.zeros(len(block) + 1, dtype=np.int64)
        np.cumsum([len(d) for d in block], out=offsets[1:])
        out[start:end] = index.maxsim_scores([query], np.concatenate(block), offsets)[0]
        start = end
    return out if raw else out / len(query)


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


def _results(gathered: EmbedResult | list[EmbedResult]) -> list[EmbedResult]:
    return [gathered] if isinstance(gathered, EmbedResult) else list(gathered)


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
