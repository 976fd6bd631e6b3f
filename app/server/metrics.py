"""Prometheus metrics: one registry per app (so several apps can live in one process)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    """Requests by route and status, latency histograms, queue size, batch size and tokens."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        disable_created_metrics()  # no *_created series: they only add noise to dashboards
        self.queues: dict[str, tuple[int, int]] = {}  # each served model's (inputs, requests) waiting
        r = self.registry = CollectorRegistry()
        self.requests = Counter("embedpool_requests", "HTTP requests by route template, method and status",
                                ["route", "method", "status"], registry=r)
        self.latency = Histogram("embedpool_request_duration_seconds", "HTTP request latency",
                                 ["route", "method"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_inputs = Gauge("embedpool_queue_size", "inputs waiting to be encoded", registry=r)
        self.queue_requests = Gauge("embedpool_queue_requests", "requests waiting to be encoded", registry=r)
        self.batch_size = Histogram("embedpool_batch_size", "inputs per batcher round",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096), registry=r)
        self.batch_tokens = Histogram("embedpool_batch_tokens", "tokens through the encoder per batcher round",
                                      buckets=(16, 64, 256, 1024, 4096, 16384, 65536, 262144), registry=r)
        self.batch_seconds = Histogram("embedpool_batch_duration_seconds", "time of one batcher round",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.stage_seconds = Counter("embedpool_round_stage_seconds", "worker time per stage of the batcher "
                                     "rounds: tokenize, forward, pool, count, deliver", ["stage"], registry=r)
        self.tokens = Counter("embedpool_tokens", "tokens through the encoder", registry=r)
        self.inputs = Counter("embedpool_inputs", "inputs embedded", registry=r)
        self.dropped = Counter("embedpool_dropped_inputs", "inputs dropped because their client went away",
                               registry=r)
        self.rejected = Counter("embedpool_rejected_requests", "requests refused with 429 (queue full)",
                                registry=r)
        self.model_loaded = Gauge("embedpool_model_loaded", "1 once the model is loaded", registry=r)
        self.encoder = Info("embedpool_encoder", "encoder path in use (precision), what was asked and the "
                            "CPU's ISA tier that decided it", registry=r)

    def on_loaded(self, precision: str, requested: str, isa: str) -> None:
        self.model_loaded.set(1)
        self.encoder.info({"precision": precision, "requested": requested, "isa": isa})

    def for_model(self, name: str) -> "_ModelQueue":
        """The batcher observer of one served model: the queue gauges count every model's queue
        (each batcher reports its own; the gauges hold their sum); the other series are shared."""
        return _ModelQueue(self, name)

    # batcher observer ---------------------------------------------------------------
    def on_queue(self, inputs: int, requests: int) -> None:
        self.queue_inputs.set(inputs)
        self.queue_requests.set(requests)

    def on_round(self, inputs: int, tokens: int, seconds: float) -> None:
        self.batch_size.observe(inputs)
        self.batch_tokens.observe(tokens)
        self.batch_seconds.observe(seconds)
        self.tokens.inc(tokens)
        self.inputs.inc(inputs)

    def on_stages(self, seconds: dict[str, float]) -> None:
        for stage, sec in seconds.items():
            self.stage_seconds.labels(stage).inc(max(0.0, sec))

    def on_dropped(self, inputs: int) -> None:
        self.dropped.inc(inputs)

    def on_rejected(self) -> None:
        self.rejected.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ModelQueue:
    """:meth:`Metrics.for_model`: one model's batcher observer."""

    def __init__(self, metrics: Metrics, name: str) -> None:
        self._metrics, self._name = metrics, name

    def on_queue(self, inputs: int, requests: int) -> None:
        queues = self._metrics.queues
        queues[self._name] = (inputs, requests)
        self._metrics.on_queue(*(sum(q[i] for q in list(queues.values())) for i in (0, 1)))

    def __getattr__(self, name: str):  # on_round, on_stages, on_dropped, on_rejected, on_loaded
        return getattr(self._metrics, name)


class MetricsMiddleware:
    """Counts and times every HTTP request by its route template (``/collections/{name}``)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            name = getattr(route, "path_format", None) or getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "")
            self.metrics.requests.labels(name, method, str(status)).inc()
            self.metrics.latency.labels(name, method).observe(time.perf_counter() - start)
