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
measured by the worker, once, for both: all such requests of a group in one tokenizer call (the
server leaves short texts to it, whose limits hold without counting).

Rounds wait briefly for the clients just answered: before a round that is not full, while fewer
requests are queued than were in flight at once during the previous round (the clients that are
about to send again), the worker waits up to ``max_wait_ms`` -- and after a busy round (one that
ended with requests queued) at most a quarter of that round's own time, so a large
``max_wait_ms`` never idles the model for long between busy rounds (:data:`BUSY_WAIT_SHARE`). A
lone client's request starts at once, and a round of eight closed-loop clients starts as soon as
the eighth has arrived. Not waiting at all after a busy round (continuous batching, as TEI does)
was measured to split closed-loop clients for good: after a phase where one client's request ran
alone, 32 clients stayed in two groups whose rounds alternated (17 sentences per round instead of
28), and on an AMX CPU, where a round of 15 sentences costs nearly what one of 30 does, served
0.80x the throughput (docs/serving.md).

The event loop only enqueues and awaits (:meth:`Batcher.embed`), so it keeps answering while the
worker encodes. A full queue raises :class:`~embedpool.errors.OverloadedError` (HTTP 429). A cancelled request (client
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
from typing import TYPE_CHECKING, Any, Callable, Protocol


from embedpool.errors import OverloadedError, UnavailableError
from embedpool.poolers.pipeline import EmbedOptions, EmbedResult, Tokenized, Workload

if TYPE_CHECKING:
    from embedpool.poolers import Embedder

log = logging.getLogger("embedpool.batcher")


class BatchObserver(Protocol):  # what the server's metrics implement
    def on_queue(self, inputs: int, requests: int) -> None: ...
    def on_round(self, inputs: int, tokens: int, seconds: float) -> None: ...
    def on_stages(self, seconds: dict[str, float]) -> None: ...
    def on_dropped(self, inputs: int) -> None: ...
    def on_rejected(self) -> None: ...


@dataclass(eq=False)
class Job:
    """One request in the queue: its texts, pooler specs and the :class:`EmbedOptions` its
    caller built, unchanged, and per input two token counts, each with one use:
    ``cost_tokens`` schedules rounds and is the result's ``tokens`` (the tokens it takes through
    the encoder, all windows of all plans; an estimate until measured); ``usage_tokens`` is the
    result's ``usage`` (its tokens under the model's standard layout). ``tokenized`` is the
    tokenization itself (not a count), when the caller measured the request; the worker then
    does not tokenize it again."""

    texts: list[str]
    specs: list[str]
    options: EmbedOptions
    cost_tokens: list[int]
    usage_tokens: list[int]  # the caller's, or filled in by the worker when it measures
    tokenized: list[Tokenized] | None = None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    taken: int = 0  # inputs handed to the worker so far
    done: int = 0  # inputs finished
    cancelled: bool = False
    vectors: dict[str, list] = field(default_factory=dict)
    multi_vector: dict[str, bool] = field(default_factory=dict)

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class _Slice:
    job: Job
    start: int
    end: int
    tokenized: list[Tokenized] | None = None  # the worker's tokenization of an unmeasured job's slice


@dataclass
class _RoundTimes:
    """Seconds one round spent per stage, over all its groups."""

    measure: float = 0.0  # tokenizing requests the caller did not measure
    embed: float = 0.0  # Embedder.embed: forward and pooling
    deliver: float = 0.0  # copying vectors into the requests
    tokenize: float = 0.0  # of embed: the encoder's own tokenizing (EncoderStats)
    forward: float = 0.0  # of embed: the model's forward (EncoderStats)


def estimate_tokens(text: str, cap: int | None) -> int:
    """A cheap token estimate for scheduling (about 4 characters per token, plus specials)."""
    n = len(text) // 4 + 2
    return min(n, cap) if cap else n


#: After a busy round, the worker waits for the clients it just answered at most this share of
#: that round's time (and never more than ``max_wait_ms``): the model idles at most a fifth of
#: the time between busy rounds, and split groups of closed-loop clients merge again.
BUSY_WAIT_SHARE = 0.25


class Batcher:
    """Batches embedding requests across clients onto one worker thread.

    Args:
        embedder: a loaded :class:`poolers.Embedder` (used from the worker thread only).
        max_queue: inputs that may wait before :meth:`submit` raises :class:`~embedpool.errors.OverloadedError`
            (a request arriving at an empty queue is always admitted).
        max_batch_tokens: estimated tokens the worker takes per round.
        max_wait_ms: the longest the worker waits for more requests before starting a round
            that is not full (after a busy round, at most :data:`BUSY_WAIT_SHARE` of that
            round's time). It only waits while fewer requests are queued than were in flight at
            once during the previous round (so a lone client never waits), and stops as soon
            as that many are there.
        observer: optional metrics sink (see :class:`BatchObserver`).
        before_round: optional ``f(tokens)`` called in the worker thread with a round's
            estimated tokens before it is encoded (the server sets the encoder's thread count
            with it).
    """

    def __init__(self, embedder: Embedder, *, max_queue: int = 1024, max_batch_tokens: int = 2048,
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
        self._round_seconds = 0.0  # how long the last round took (worker writes it)
        self._cap = int(embedder.encoder.max_length) or None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "Batcher":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="embedpool-batcher", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Fail waiting requests with an :class:`~embedpool.errors.UnavailableError` and end the worker after its round."""
        with self._cond:
            self._stopping = True
            pending = list(self._pending)
            self._pending.clear()
            self._queued_inputs = self._queued_tokens = 0
            self._cond.notify_all()
        for job in pending:
            if not job.future.done():
                job.future.set_exception(UnavailableError("the server is shutting down", retry_after=5))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def queued_inputs(self) -> int:
        return self._queued_inputs

    # ------------------------------------------------------------------ client side
    def submit(self, texts: Sequence[str], specs: Sequence[str], options: EmbedOptions | None = None,
               workload: Workload | None = None) -> Job:
        """Enqueue a request (thread-safe, never blocks on the encoder); ``options`` as for
        :meth:`poolers.Embedder.embed` (default: the defaults), carried unchanged to the
        worker. If the caller measured it (:meth:`poolers.Embedder.measure` with the same
        options, as the server does for its limits), ``workload`` is what that found: each
        text's tokens over all windows of all plans (rounds are scheduled by them, so a long
        text under a windowing pooler fills a round of its own), the usage the request reports,
        and the tokenization, which the worker encodes without tokenizing again. Unmeasured, a
        request is scheduled by a cheap estimate and measured by the worker."""
        return self.submit_many([(texts, specs, options, workload)])[0]

    def submit_many(self, requests: Sequence[tuple[Sequence[str], Sequence[str], EmbedOptions | None,
                                                   Workload | None]]) -> list[Job]:
        """Enqueue several requests at once, next to each other in the queue, so the worker
        takes them in the same round when they fit its budget (``/rerank``: the query, in the
        query role, and its texts, as documents). ``requests``: ``(texts, specs, options,
        workload)`` as :meth:`submit` takes them. All are admitted or none."""
        jobs = [self._job(*request) for request in requests]
        live = [job for job in jobs if job.texts]
        for job in jobs:
            if not job.texts:
                job.future.set_result(EmbedResult({s: [] for s in job.specs}, {}, 0, list(job.specs), 0))
        if not live:
            return jobs
        n = sum(len(job.texts) for job in live)
        with self._cond:
            if self._stopping:
                raise UnavailableError("the server is shutting down", retry_after=5)
            if self._queued_inputs and self._queued_inputs + n > self.max_queue:
                if self.observer:
                    self.observer.on_rejected()
                raise OverloadedError(
                    f"the queue is full ({self._queued_inputs} inputs waiting, limit "
                    f"{self.max_queue}); retry later", retry_after=self._retry_after())
            for job in live:
                self._pending.append(job)
                self._queued_tokens += sum(job.cost_tokens)
            self._queued_inputs += n
            self._peak = max(self._peak, len(self._pending) + self._in_round)
            self._notify_queue()
            self._cond.notify()
        return jobs

    def _job(self, texts: Sequence[str], specs: Sequence[str], options: EmbedOptions | None,
             workload: Workload | None) -> Job:
        texts = list(texts)
        options = options if options is not None else EmbedOptions()
        specs = list(dict.fromkeys(specs))
        if workload is not None and len(workload.tokenized) == len(texts):
            return Job(texts, specs, options, list(workload.tokens), list(workload.counts), list(workload.tokenized))
        cap = self._cap if options.truncate else None
        return Job(texts, specs, options, [estimate_tokens(t, cap) for t in texts], [0] * len(texts))

    async def embed(self, texts: Sequence[str], specs: Sequence[str], options: EmbedOptions | None = None,
                    workload: Workload | None = None) -> EmbedResult:
        """Submit and await the result; cancelling the awaiting task drops the request."""
        job = self.submit(texts, specs, options, workload)
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
                self._queued_tokens -= sum(job.cost_tokens[job.taken:])
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
        idle = True  # the model had nothing to do before the requests now queued arrived
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    idle = True
                    self._cond.wait()
                if self._stopping:
                    return
                clients = self._peak  # in flight at once during the previous round
                # after a busy round the wait for its clients is bounded by that round's time too
                wait = self.max_wait if idle else min(self.max_wait, BUSY_WAIT_SHARE * self._round_seconds)
                if wait > 0 and self._wants_more(clients):
                    deadline = time.monotonic() + wait
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
                idle = False

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
            while end < len(job.texts) and (end == start and not out or job.cost_tokens[end] <= budget):
                budget -= job.cost_tokens[end]
                end += 1
            if end == start:
                break
            out.append(_Slice(job, start, end))
            job.taken = end
            self._queued_inputs -= end - start
            self._queued_tokens -= sum(job.cost_tokens[start:end])
            if end == len(job.texts):
                self._pending.popleft()
        self._notify_queue()
        return out

    def _process(self, slices: list[_Slice]) -> None:
        """Encode one round: its live slices grouped by options, one ``embed`` call per group.
        A group that fails is run again one request at a time, so that only the request whose
        input is bad (e.g. too long with truncate=false), or that trips a bug, fails."""
        if self.before_round is not None:
            self.before_round(sum(sum(s.job.cost_tokens[s.start:s.end]) for s in slices))
        stats = self.embedder.encoder.stats
        tokenize_before, forward_before = stats.tokenize_seconds, stats.forward_seconds
        times = _RoundTimes()
        t0 = time.perf_counter()
        groups: dict[EmbedOptions, list[_Slice]] = {}
        for s in slices:
            if not s.job.cancelled:
                groups.setdefault(s.job.options, []).append(s)
        todo = deque(groups.values())
        n_inputs = n_tokens = 0
        while todo:
            group = todo.popleft()
            try:
                result = self._embed_group(group, times)
            except Exception as exc:  # noqa: BLE001 - delivered to the request; its kind decides the answer
                if len(group) == 1:
                    self._fail(group[0].job, exc)
                else:
                    todo.extendleft([s] for s in reversed(group))
                continue
            t1 = time.perf_counter()
            self._deliver(group, result)
            times.deliver += time.perf_counter() - t1
            n_inputs += sum(s.end - s.start for s in group)
            n_tokens += int(result.tokens)
        times.tokenize = stats.tokenize_seconds - tokenize_before
        times.forward = stats.forward_seconds - forward_before
        self._finish_round(n_inputs, n_tokens, time.perf_counter() - t0, times)

    def _finish_round(self, n_inputs: int, n_tokens: int, seconds: float, times: _RoundTimes) -> None:
        """The input rate (for Retry-After) and the observer's round and stage metrics."""
        self._round_seconds = seconds
        if n_inputs and seconds > 0:
            inst = n_inputs / seconds
            self._rate = inst if self._rate == 0 else 0.8 * self._rate + 0.2 * inst
        if self.observer and n_inputs:
            self.observer.on_round(n_inputs, n_tokens, seconds)
            self.observer.on_stages({"tokenize": times.tokenize, "forward": times.forward,
                                     "pool": max(0.0, times.embed - times.tokenize - times.forward),
                                     "count": times.measure, "deliver": times.deliver})

    def _embed_group(self, group: list[_Slice], times: _RoundTimes) -> EmbedResult:
        """One ``embed`` call for the slices of a group (equal options, poolers joined). The
        requests the caller did not measure are measured here first: that one tokenization
        gives their tokens and usage and is what ``embed`` encodes."""
        options = group[0].job.options
        specs = list(dict.fromkeys(spec for s in group for spec in s.job.specs))
        texts = [t for s in group for t in s.job.texts[s.start:s.end]]
        t0 = time.perf_counter()
        unmeasured = [s for s in group if s.job.tokenized is None]
        if unmeasured:  # one tokenization for all of them (the measured ones are not tokenized again)
            work = self.embedder.measure([t for s in unmeasured for t in s.job.texts[s.start:s.end]], specs, options)
            offset = 0
            for s in unmeasured:
                n = s.end - s.start
                s.job.usage_tokens[s.start:s.end] = work.counts[offset:offset + n]
                s.job.cost_tokens[s.start:s.end] = work.tokens[offset:offset + n]
                s.tokenized = work.tokenized[offset:offset + n]
                offset += n
        tokenized = [t for s in group for t in (s.tokenized if s.job.tokenized is None else s.job.tokenized[s.start:s.end])]
        t1 = time.perf_counter()
        result = self.embedder.embed(texts, specs, options, tokenized=tokenized)
        times.measure += t1 - t0
        times.embed += time.perf_counter() - t1
        return result

    def _deliver(self, group: list[_Slice], result: EmbedResult) -> None:
        """Each slice's vectors into its request; a request complete with this slice is answered."""
        offset = 0
        for s in group:
            job, n = s.job, s.end - s.start
            offset += n
            if job.cancelled or job.future.done():
                continue
            for spec in job.specs:
                dest = job.vectors.setdefault(spec, [None] * len(job.texts))
                dest[s.start:s.end] = result.vectors[spec][offset - n:offset]
                job.multi_vector[spec] = bool(result.multi_vector[spec])
            job.done += n
            if job.done == len(job.texts):
                self._in_round = max(0, self._in_round - 1)  # before its client can send again
                try:
                    job.future.set_result(EmbedResult(job.vectors, job.multi_vector, sum(job.cost_tokens),
                                                      job.specs, sum(job.usage_tokens)))
                except concurrent.futures.InvalidStateError:  # cancelled meanwhile
                    pass

    def _fail(self, job: Job, exc: BaseException) -> None:
        with self._cond:
            if job in self._pending:  # drop its remaining slices
                self._pending.remove(job)
                left = len(job.texts) - job.taken
                self._queued_inputs -= left
                self._queued_tokens -= sum(job.cost_tokens[job.taken:])
                job.taken = len(job.texts)
                self._notify_queue()
            job.cancelled = True
        if not job.future.done():
            try:
                job.future.set_exception(exc)
            except concurrent.futures.InvalidStateError:
                pass
