"""The micro-batcher: one worker thread that owns the encoder.

Requests enter a bounded queue (counted in inputs). The worker takes the oldest requests --
splitting a large one into slices -- until a token budget is reached, groups the slices by the
options that change the forward pass or its post-processing (role, truncate, normalize,
dimensions, prompt name, truncation direction), and calls :meth:`poolers.Embedder.embed` once per group with the union of the
group's pooler specs. The engine sorts that group's texts by length and cuts them into
token-budget forward batches, so texts of different clients share forward batches, and one
forward pass per tokenization plan serves every pooler asked for. A request the server measured
(its limits, :meth:`poolers.Embedder.measure`) arrives tokenized, off the worker: the worker
encodes those rows and tokenizes nothing (it runs the model and the poolers only), and the
request's usage is the count that measurement made. A request its caller did not measure is
measured by the worker, once, for both.

Before a round that is not full the worker waits up to ``max_wait_ms`` for more requests, but
only while fewer are queued than were in flight at once during the previous round (the clients
that are about to send again): a lone client's request starts at once, and a round of eight
closed-loop clients starts as soon as the eighth has arrived.

The event loop only enqueues and awaits (:meth:`Batcher.embed`), so it keeps answering while the
worker encodes. A full queue raises :class:`Overloaded` (HTTP 429). A cancelled request (client
gone) is skipped if the worker has not reached it yet, and its remaining slices are dropped.
An input's vector does not depend on what it was batched with (up to float rounding of a
differently padded batch): per-text pooling only ever reads that text's tokens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from embedpool.errors import OverloadedError, UnavailableError

log = logging.getLogger("embedpool.batcher")


class Overloaded(OverloadedError):
    """The queue is full; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message, retry_after=retry_after)


class Stopped(UnavailableError):
    """The batcher was stopped (server shutting down)."""

    def __init__(self, message: str = "the server is shutting down") -> None:
        super().__init__(message, retry_after=5)


class BatchObserver(Protocol):  # what the server's metrics implement
    def on_queue(self, inputs: int, requests: int) -> None: ...
    def on_round(self, inputs: int, tokens: int, seconds: float) -> None: ...
    def on_stages(self, seconds: dict[str, float]) -> None: ...
    def on_dropped(self, inputs: int) -> None: ...
    def on_rejected(self) -> None: ...


@dataclass
class EmbedOutput:
    """What one request gets back: vectors per canonical pooler spec, in input order."""

    vectors: dict[str, list[np.ndarray]]
    multi_vector: dict[str, bool]
    tokens: int


@dataclass(eq=False)
class Job:
    texts: list[str]
    specs: list[str]
    role: str
    normalize: bool
    dimensions: int | None
    truncate: bool
    est_tokens: list[int]
    prompt_name: str | None = None
    truncation_direction: str = "right"
    counts: list[int] | None = None  # exact standard-plan tokens per input, counted before submit
    tokenized: list | None = None  # the inputs as the embedder's measure() tokenized them
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    taken: int = 0  # inputs handed to the worker so far
    done: int = 0  # inputs finished
    tokens: int = 0
    cancelled: bool = False
    vectors: dict[str, list] = field(default_factory=dict)
    multi_vector: dict[str, bool] = field(default_factory=dict)

    @property
    def key(self) -> tuple:
        return (self.role, self.truncate, self.normalize, self.dimensions, self.prompt_name,
                self.truncation_direction)

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class _Slice:
    job: Job
    start: int
    end: int


def estimate_tokens(text: str, cap: int | None) -> int:
    """A cheap token estimate for scheduling (about 4 characters per token, plus specials)."""
    n = len(text) // 4 + 2
    return min(n, cap) if cap else n


class Batcher:
    """Batches embedding requests across clients onto one worker thread.

    Args:
        embedder: a loaded :class:`poolers.Embedder` (used from the worker thread only).
        max_queue: inputs that may wait before :meth:`submit` raises :class:`Overloaded`
            (a request arriving at an empty queue is always admitted).
        max_batch_tokens: estimated tokens the worker takes per round.
        max_wait_ms: the longest the worker waits for more requests before starting a round
            that is not full. It only waits while fewer requests are queued than were in
            flight at once during the previous round (so a lone client never waits), and stops
            as soon as that many are there.
        observer: optional metrics sink (see :class:`BatchObserver`).
        before_round: optional ``f(tokens)`` called in the worker thread with a round's
            estimated tokens before it is encoded (the server sets the encoder's thread count
            with it).
    """

    def __init__(self, embedder: Any, *, max_queue: int = 1024, max_batch_tokens: int = 2048,
                 max_wait_ms: float = 2.0, observer: BatchObserver | None = None,
                 before_round: Callable[[int], Any] | None = None) -> None:
        self.embedder = embedder
        self.max_queue = int(max_queue)
        self.max_batch_tokens = int(max_batch_tokens)
        self.max_wait = max(0.0, float(max_wait_ms)) / 1000.0
        self.observer = observer
        self.before_round = before_round
        self._in_round = 0  # unfinished requests in the round being encoded (worker writes it)
        self._peak = 0  # most requests in flight (queued or encoding) since the round began
        self._pending: deque[Job] = deque()
        self._queued_inputs = 0
        self._queued_tokens = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._rate = 0.0  # inputs per second, moving average (for Retry-After)
        encoder = getattr(embedder, "encoder", None)
        self._cap = int(getattr(encoder, "max_length", 0) or 0) or None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "Batcher":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="embedpool-batcher", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Fail waiting requests with :class:`Stopped` and end the worker after its round."""
        with self._cond:
            self._stopping = True
            pending = list(self._pending)
            self._pending.clear()
            self._queued_inputs = self._queued_tokens = 0
            self._cond.notify_all()
        for job in pending:
            if not job.future.done():
                job.future.set_exception(Stopped("the server is shutting down"))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def queued_inputs(self) -> int:
        return self._queued_inputs

    @property
    def queued_requests(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ client side
    def submit(self, texts: Sequence[str], specs: Sequence[str], *, role: str = "document",
               normalize: bool = True, dimensions: int | None = None, truncate: bool = True,
               prompt_name: str | None = None, truncation_direction: str = "right",
               counts: Sequence[int] | None = None, est_tokens: Sequence[int] | None = None,
               tokenized: Sequence[Any] | None = None) -> Job:
        """Enqueue a request (thread-safe, never blocks on the encoder). If the caller measured
        it (:meth:`poolers.Embedder.measure`, as the server does for its limits), it passes
        what that found: ``counts``, the inputs' standard-plan token counts (the usage the
        request reports; the worker does not count them again); ``est_tokens``, each text's
        tokens over all windows of all plans (a long text under a windowing pooler then fills a
        round of its own); ``tokenized``, the tokenization itself, which the worker encodes
        without tokenizing again. Rounds are scheduled by ``est_tokens``, else ``counts``, else
        a cheap estimate."""
        return self.submit_many([(texts, specs, {"role": role, "normalize": normalize, "dimensions": dimensions,
                                                 "truncate": truncate, "prompt_name": prompt_name,
                                                 "truncation_direction": truncation_direction,
                                                 "counts": counts, "est_tokens": est_tokens,
                                                 "tokenized": tokenized})])[0]

    def submit_many(self, requests: Sequence[tuple[Sequence[str], Sequence[str], dict[str, Any]]]) -> list[Job]:
        """Enqueue several requests at once, next to each other in the queue, so the worker
        takes them in the same round when they fit its budget (``/rerank``: the query, in the
        query role, and its texts, as documents). ``requests``: ``(texts, specs, options)``
        with the keyword options of :meth:`submit`. All are admitted or none."""
        jobs = [self._job(texts, specs, **options) for texts, specs, options in requests]
        live = [job for job in jobs if job.texts]
        for job in jobs:
            if not job.texts:
                job.future.set_result(EmbedOutput({s: [] for s in job.specs}, {}, 0))
        if not live:
            return jobs
        n = sum(len(job.texts) for job in live)
        with self._cond:
            if self._stopping:
                raise Stopped("the server is shutting down")
            if self._queued_inputs and self._queued_inputs + n > self.max_queue:
                if self.observer:
                    self.observer.on_rejected()
                raise Overloaded(
                    f"the queue is full ({self._queued_inputs} inputs waiting, limit "
                    f"{self.max_queue}); retry later", self._retry_after())
            for job in live:
                self._pending.append(job)
                self._queued_tokens += sum(job.est_tokens)
            self._queued_inputs += n
            self._peak = max(self._peak, len(self._pending) + self._in_round)
            self._notify_queue()
            self._cond.notify()
        return jobs

    def _job(self, texts: Sequence[str], specs: Sequence[str], *, role: str = "document",
             normalize: bool = True, dimensions: int | None = None, truncate: bool = True,
             prompt_name: str | None = None, truncation_direction: str = "right",
             counts: Sequence[int] | None = None, est_tokens: Sequence[int] | None = None,
             tokenized: Sequence[Any] | None = None) -> Job:
        texts = list(texts)
        cap = self._cap if truncate else None
        exact = [int(c) for c in counts] if counts is not None and len(counts) == len(texts) else None
        if est_tokens is None or len(est_tokens) != len(texts):
            est_tokens = exact or [estimate_tokens(t, cap) for t in texts]
        tokenized = list(tokenized) if tokenized is not None and len(tokenized) == len(texts) else None
        return Job(texts, list(dict.fromkeys(specs)), role, bool(normalize), dimensions, bool(truncate),
                   list(est_tokens), prompt_name, truncation_direction, exact, tokenized)

    async def embed(self, texts: Sequence[str], specs: Sequence[str], **options: Any) -> EmbedOutput:
        """Submit and await the result; cancelling the awaiting task drops the request."""
        job = self.submit(texts, specs, **options)
        try:
            return await asyncio.shield(asyncio.wrap_future(job.future))
        except asyncio.CancelledError:
            self.cancel(job)
            raise

    def cancel(self, job: Job) -> None:
        """Drop what the worker has not started of ``job`` (e.g. its client disconnected)."""
        with self._cond:
            if job.cancelled or job.future.done():
                return
            job.cancel()
            left = len(job.texts) - job.taken
            if job in self._pending:
                self._pending.remove(job)
                self._queued_inputs -= left
                self._queued_tokens -= sum(job.est_tokens[job.taken:])
                self._notify_queue()
        if self.observer and left:
            self.observer.on_dropped(left)
        if not job.future.done():
            job.future.cancel()

    def _retry_after(self) -> int:
        if self._rate <= 0:
            return 1
        return int(min(60, max(1, math.ceil(self._queued_inputs / self._rate))))

    def _notify_queue(self) -> None:
        if self.observer:
            self.observer.on_queue(self._queued_inputs, len(self._pending))

    # ------------------------------------------------------------------ worker side
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                clients = self._peak  # in flight at once during the previous round
                if self.max_wait and self._wants_more(clients):
                    deadline = time.monotonic() + self.max_wait
                    while self._wants_more(clients) and not self._stopping:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                slices = self._take()
                self._in_round = len({id(s.job) for s in slices})
                self._peak = len(self._pending) + self._in_round
            if slices:
                try:
                    self._process(slices)
                except BaseException as exc:  # never let the worker die silently
                    log.exception("batcher round failed")
                    for s in slices:
                        self._fail(s.job, exc)
                with self._cond:
                    self._in_round = 0

    def _wants_more(self, clients: int) -> bool:
        """Worth waiting: room in the round, and fewer requests queued than were in flight
        during the previous round (their clients are likely sending the next ones). Caller
        holds the lock."""
        return self._queued_tokens < self.max_batch_tokens and len(self._pending) < clients

    def _take(self) -> list[_Slice]:
        """The oldest requests (large ones sliced) up to the token budget; caller holds the lock."""
        out: list[_Slice] = []
        budget = self.max_batch_tokens
        while self._pending and budget > 0:
            job = self._pending[0]
            start = end = job.taken
            while end < len(job.texts) and (end == start and not out or job.est_tokens[end] <= budget):
                budget -= job.est_tokens[end]
                end += 1
            if end == start:
                break
            out.append(_Slice(job, start, end))
            job.taken = end
            self._queued_inputs -= end - start
            self._queued_tokens -= sum(job.est_tokens[start:end])
            if end == len(job.texts):
                self._pending.popleft()
        self._notify_queue()
        return out

    def _process(self, slices: list[_Slice]) -> None:
        if self.before_round is not None:
            self.before_round(sum(sum(s.job.est_tokens[s.start:s.end]) for s in slices))
        t0 = time.perf_counter()
        stats = getattr(getattr(self.embedder, "encoder", None), "stats", None)
        before = (stats.tokenize_seconds, stats.forward_seconds) if stats is not None else (0.0, 0.0)
        self._stage = {"embed": 0.0, "count": 0.0, "deliver": 0.0}
        groups: dict[tuple, list[_Slice]] = {}
        for s in slices:
            if not s.job.cancelled:
                groups.setdefault(s.job.key, []).append(s)
        n_inputs = n_tokens = 0
        for group in groups.values():
            n_inputs += sum(s.end - s.start for s in group)
            n_tokens += self._run_group(group)
        dt = time.perf_counter() - t0
        if n_inputs and dt > 0:
            inst = n_inputs / dt
            self._rate = inst if self._rate == 0 else 0.8 * self._rate + 0.2 * inst
        if self.observer and n_inputs:
            self.observer.on_round(n_inputs, n_tokens, dt)
            if stats is not None and hasattr(self.observer, "on_stages"):
                tok = stats.tokenize_seconds - before[0]
                fwd = stats.forward_seconds - before[1]
                st = self._stage
                self.observer.on_stages({"tokenize": tok, "forward": fwd,
                                         "pool": max(0.0, st["embed"] - tok - fwd),
                                         "count": st["count"], "deliver": st["deliver"]})

    def _run_group(self, group: list[_Slice]) -> int:
        job0 = group[0].job
        specs = list(dict.fromkeys(spec for s in group for spec in s.job.specs))
        texts = [t for s in group for t in s.job.texts[s.start:s.end]]
        t0 = time.perf_counter()
        try:
            extra = {}  # only what differs from the defaults (any embedder takes those)
            if job0.prompt_name is not None:
                extra["prompt_name"] = job0.prompt_name
            if job0.truncation_direction != "right":
                extra["truncation_direction"] = job0.truncation_direction
            if all(s.job.tokenized is not None and s.job.counts is not None for s in group):
                tokenized = [t for s in group for t in s.job.tokenized[s.start:s.end]]
                counts = [c for s in group for c in s.job.counts[s.start:s.end]]
            else:  # not measured by the caller: measure here, the one tokenization serving both
                work = self.embedder.measure(texts, specs, role=job0.role, truncate=job0.truncate, **extra)
                tokenized, counts = work.tokenized, work.counts
            t1 = time.perf_counter()
            result = self.embedder.embed(texts, specs, role=job0.role, normalize=job0.normalize,
                                         dimensions=job0.dimensions, truncate=job0.truncate,
                                         tokenized=tokenized, **extra)
        except Exception as exc:  # noqa: BLE001 - delivered to the request; its kind decides the answer
            if len(group) == 1:
                self._fail(job0, exc)
                return 0
            # One request's input is bad (e.g. too long with truncate=false), or trips a bug:
            # run each alone so that only that request fails.
            return sum(self._run_group([s]) for s in group)
        t2 = time.perf_counter()
        offset = 0
        for s in group:
            n = s.end - s.start
            self._deliver(s, result, offset, counts[offset:offset + n])
            offset += n
        stage = getattr(self, "_stage", None)
        if stage is not None:
            stage["count"] += t1 - t0
            stage["embed"] += t2 - t1
            stage["deliver"] += time.perf_counter() - t2
        return int(result.tokens)

    def _deliver(self, s: _Slice, result: Any, offset: int, counts: list[int]) -> None:
        job = s.job
        if job.cancelled or job.future.done():
            return
        n = s.end - s.start
        for spec in job.specs:
            dest = job.vectors.setdefault(spec, [None] * len(job.texts))
            dest[s.start:s.end] = result.vectors[spec][offset:offset + n]
            job.multi_vector[spec] = bool(result.multi_vector[spec])
        job.tokens += int(sum(counts))
        job.done += n
        if job.done == len(job.texts):
            self._in_round = max(0, self._in_round - 1)  # before its client can send again
            try:
                job.future.set_result(EmbedOutput(job.vectors, job.multi_vector, job.tokens))
            except concurrent.futures.InvalidStateError:  # cancelled meanwhile
                pass

    def _fail(self, job: Job, exc: BaseException) -> None:
        with self._cond:
            if job in self._pending:  # drop its remaining slices
                self._pending.remove(job)
                left = len(job.texts) - job.taken
                self._queued_inputs -= left
                self._queued_tokens -= sum(job.est_tokens[job.taken:])
                job.taken = len(job.texts)
                self._notify_queue()
            job.cancelled = True
        if not job.future.done():
            try:
                job.future.set_exception(exc)
            except concurrent.futures.InvalidStateError:
                pass
