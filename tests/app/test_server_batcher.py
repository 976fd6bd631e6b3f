"""The micro-batcher on a fake embedder: rounds, grouping, slicing, overload, cancellation,
error isolation. Fast and deterministic (no model, no server)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from embedpool.app.batcher import Batcher
from embedpool.errors import OverloadedError
from embedpool.poolers import EmbedOptions


class FakeResult:
    def __init__(self, vectors, multi, tokens):
        self.vectors, self.multi_vector, self.tokens = vectors, multi, tokens


class FakeWorkload:
    def __init__(self, counts, tokenized):
        self.counts, self.tokenized, self.tokens = counts, tokenized, counts


class FakeStats:
    tokenize_seconds = forward_seconds = 0.0


class FakeEncoder:
    max_length = 256
    stats = FakeStats()


class FakeEmbedder:
    """vector of a text = [len(text), hash-ish, dims...]; records every call."""

    def __init__(self, delay: float = 0.0, gate: threading.Event | None = None):
        self.encoder = FakeEncoder()
        self.calls: list[tuple[list[str], list[str], dict]] = []
        self.delay = delay
        self.gate = gate

    def measure(self, texts, poolers, options):
        """What the batcher asks of an embedder for a request its caller did not measure."""
        return FakeWorkload([len(t.split()) + 2 for t in texts], list(texts))

    def embed(self, texts, poolers, options, tokenized=None):
        if self.gate is not None:
            self.gate.wait(10)
        time.sleep(self.delay)
        self.calls.append((list(texts), list(poolers), dict(role=options.role, normalize=options.normalize,
                                                            dimensions=options.dimensions,
                                                            truncate=options.truncate)))
        for t in texts:
            if t == "BAD":
                raise ValueError("input is bad")
        vecs = {p: [np.array([len(t), sum(map(ord, t)) % 97, len(p)], dtype=np.float32) for t in texts]
                for p in poolers}
        return FakeResult(vecs, {p: False for p in poolers}, sum(len(t.split()) + 2 for t in texts))


def expected(text, pooler):
    return np.array([len(text), sum(map(ord, text)) % 97, len(pooler)], dtype=np.float32)


async def gather(batcher, requests):
    return await asyncio.gather(*(batcher.embed(t, s, EmbedOptions(**o)) for t, s, o in requests),
                                return_exceptions=True)


def test_concurrent_requests_share_rounds_and_get_their_own_vectors():
    gate = threading.Event()
    emb = FakeEmbedder(gate=gate)
    b = Batcher(emb, max_queue=1000, max_batch_tokens=10_000, max_wait_ms=0).start()
    try:
        reqs = [([f"text {i} {j}" for j in range(i % 3 + 1)], ["mean"] if i % 2 else ["mean", "cls"],
                 {"dimensions": None if i < 6 else 64}) for i in range(10)]

        async def run():
            tasks = [asyncio.ensure_future(b.embed(t, s, EmbedOptions(**o))) for t, s, o in reqs]
            await asyncio.sleep(0.05)
            gate.set()
            return await asyncio.gather(*tasks)

        outs = asyncio.run(run())
    finally:
        b.stop()
    for (texts, specs, _), out in zip(reqs, outs):
        assert set(out.vectors) == set(specs)
        for spec in specs:
            for t, v in zip(texts, out.vectors[spec]):
                assert np.array_equal(v, expected(t, spec))
        assert out.usage == sum(len(t.split()) + 2 for t in texts)
    # far fewer embed calls than requests: one per (round, option group); groups by dimensions
    assert len(emb.calls) <= 4
    for texts, poolers, opts in emb.calls:
        assert len(set(opts.values())) >= 1
    assert {c[2]["dimensions"] for c in emb.calls} == {None, 64}
    assert any(set(c[1]) == {"mean", "cls"} and len(c[0]) > 3 for c in emb.calls)


def test_large_request_is_sliced_by_token_budget():
    emb = FakeEmbedder()
    b = Batcher(emb, max_queue=10_000, max_batch_tokens=50, max_wait_ms=0).start()
    try:
        texts = [f"word {i} " * 10 for i in range(20)]  # ~ 22 estimated tokens each
        out = asyncio.run(b.embed(texts, ["mean"]))
    finally:
        b.stop()
    assert [np.array_equal(v, expected(t, "mean")) for t, v in zip(texts, out.vectors["mean"])] == [True] * 20
    assert len(emb.calls) >= 10 and all(len(c[0]) <= 2 for c in emb.calls)


def test_full_queue_raises_overloaded_but_empty_queue_admits_big_request():
    gate = threading.Event()
    b = Batcher(FakeEmbedder(gate=gate), max_queue=5, max_batch_tokens=4, max_wait_ms=0).start()
    try:
        first = b.submit(["a"] * 8, ["mean"])  # over max_queue, but the queue was empty
        time.sleep(0.05)  # the worker takes one slice and blocks on the gate
        with pytest.raises(OverloadedError) as exc:
            b.submit(["b"] * 3, ["mean"])
        assert exc.value.retry_after >= 1
        gate.set()
        first.future.result(10)
        b.submit(["c"], ["mean"]).future.result(10)
    finally:
        gate.set()
        b.stop()


def test_cancelled_request_is_dropped_before_encoding():
    gate = threading.Event()
    emb = FakeEmbedder(gate=gate)
    b = Batcher(emb, max_queue=100, max_batch_tokens=3, max_wait_ms=0).start()
    try:
        busy = b.submit(["busy"], ["mean"])
        time.sleep(0.05)
        gone = b.submit(["gone one", "gone two"], ["mean"])
        assert b.queued_inputs == 2
        b.cancel(gone)
        assert b.queued_inputs == 0
        gate.set()
        busy.future.result(10)
        later = b.submit(["later"], ["mean"])
        later.future.result(10)
    finally:
        gate.set()
        b.stop()
    encoded = [t for c in emb.calls for t in c[0]]
    assert "gone one" not in encoded and "gone two" not in encoded
    assert gone.future.cancelled()


def test_a_bad_request_fails_alone():
    gate = threading.Event()
    emb = FakeEmbedder(gate=gate)
    b = Batcher(emb, max_queue=100, max_batch_tokens=10_000, max_wait_ms=0).start()
    try:
        async def run():
            tasks = [asyncio.ensure_future(b.embed(t, ["mean"])) for t in (["ok 1"], ["BAD"], ["ok 2", "ok 3"])]
            await asyncio.sleep(0.05)
            gate.set()
            return await asyncio.gather(*tasks, return_exceptions=True)

        ok1, bad, ok2 = asyncio.run(run())
    finally:
        b.stop()
    assert isinstance(bad, ValueError)
    assert np.array_equal(ok1.vectors["mean"][0], expected("ok 1", "mean"))
    assert np.array_equal(ok2.vectors["mean"][1], expected("ok 3", "mean"))


def test_stop_fails_waiting_requests():
    gate = threading.Event()
    b = Batcher(FakeEmbedder(gate=gate), max_queue=100, max_batch_tokens=3, max_wait_ms=0).start()
    b.submit(["running"], ["mean"])
    time.sleep(0.05)
    waiting = b.submit(["waiting"], ["mean"])
    threading.Timer(0.1, gate.set).start()
    b.stop()
    with pytest.raises(Exception, match="shutting down"):
        waiting.future.result(1)


def test_a_lone_client_does_not_wait_for_a_round_to_fill():
    emb = FakeEmbedder()
    b = Batcher(emb, max_queue=100, max_batch_tokens=10_000, max_wait_ms=2000).start()
    try:
        t0 = time.monotonic()
        for i in range(3):  # one client, one request at a time
            b.submit([f"alone {i}"], ["mean"]).future.result(10)
        elapsed = time.monotonic() - t0
    finally:
        b.stop()
    assert elapsed < 1.5  # waiting max_wait_ms even once would take 2 s
    assert [c[0] for c in emb.calls] == [["alone 0"], ["alone 1"], ["alone 2"]]


def test_a_round_waits_for_the_clients_of_the_previous_round_and_no_longer():
    """Four clients in one round come back 20-80 ms after it (one after another): the next round
    waits for all four, and starts when the fourth arrives, not after max_wait_ms. The first
    requests are queued before the worker starts, so the first round holds all four whatever the
    threads' scheduling (on a loaded machine the worker could otherwise wake between them)."""
    emb = FakeEmbedder()
    b = Batcher(emb, max_queue=100, max_batch_tokens=10_000, max_wait_ms=2000)
    try:
        async def client(k: int) -> None:
            await b.embed([f"first {k}"], ["mean"])
            await asyncio.sleep(0.02 * (k + 1))  # the clients come back one after another
            await b.embed([f"second {k}"], ["mean"])

        async def run() -> float:
            tasks = [asyncio.ensure_future(client(k)) for k in range(4)]
            await asyncio.sleep(0.05)  # all four first requests queued
            t0 = time.monotonic()
            b.start()
            await asyncio.gather(*tasks)
            return time.monotonic() - t0

        elapsed = asyncio.run(run())
    finally:
        b.stop()
    rounds = [sorted(c[0]) for c in emb.calls]
    assert rounds == [[f"first {k}" for k in range(4)], [f"second {k}" for k in range(4)]]
    assert elapsed < 1.5  # it started when the fourth arrived, not after max_wait_ms


def test_requests_queued_during_a_round_start_as_soon_as_it_ends():
    """A round that ends with requests queued is followed by a round of those after at most a
    quarter of its own time, even when fewer are queued than were in flight during it (so
    waiting for the clients just answered looks worthwhile) and max_wait_ms is large: waiting
    max_wait_ms here (60 s) would idle the model, and the second round would miss the 10 s below."""
    gate = threading.Event()
    emb = FakeEmbedder(gate=gate)
    b = Batcher(emb, max_queue=100, max_batch_tokens=10_000, max_wait_ms=60_000).start()
    try:
        running = b.submit(["running"], ["mean"])  # a lone request: starts at once, held by the gate
        deadline = time.monotonic() + 10
        while b.queued_inputs and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b.queued_inputs == 0  # taken by the worker: the round is running
        queued = [b.submit([f"queued {k}"], ["mean"]) for k in range(2)]  # three in flight, two queued
        gate.set()
        running.future.result(10)
        outs = [job.future.result(10) for job in queued]
    finally:
        gate.set()
        b.stop()
    assert [c[0] for c in emb.calls] == [["running"], ["queued 0", "queued 1"]]  # one round for both
    assert [o.vectors["mean"][0].tolist() for o in outs] == [expected(f"queued {k}", "mean").tolist()
                                                             for k in range(2)]


def test_before_round_gets_the_round_tokens_in_the_worker_thread():
    seen = []
    b = Batcher(FakeEmbedder(), max_queue=100, max_batch_tokens=10_000, max_wait_ms=0,
                before_round=lambda tokens: seen.append((tokens, threading.current_thread().name))).start()
    try:
        b.submit(["x" * 40, "y"], ["mean"]).future.result(10)
    finally:
        b.stop()
    # estimated at ~4 characters a token plus [CLS]/[SEP]: 40 characters are 12, one character 2
    assert seen == [(14, "embedpool-batcher")]


def test_thread_policy_runs_small_rounds_on_one_thread():
    """Run with the thread counts it needs, whatever this machine has: one thread (no policy),
    then two (small rounds on one, large ones on both, set in the encoding thread)."""
    import torch
    from embedpool.app.server.engine import thread_policy

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert thread_policy(1024) is None  # one thread anyway: nothing to switch
        torch.set_num_threads(2)
        assert thread_policy(0) is None  # the setting off
        policy = thread_policy(1024)
        seen = []

        def worker() -> None:  # OpenMP thread counts are per thread: set in the encoding thread
            policy(20)
            seen.append(torch.get_num_threads())
            policy(4096)
            seen.append(torch.get_num_threads())

        t = threading.Thread(target=worker)
        t.start()
        t.join()
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2]


def test_measured_requests_are_counted_once_and_not_tokenized_again(embedder, monkeypatch):
    """The server measures a request (its limits) on other threads, concurrently, then submits
    what that found: the worker encodes that tokenization without tokenizing again, the usage
    is the inputs' standard-plan counts, and the vectors are a plain embed's."""
    from concurrent.futures import ThreadPoolExecutor

    texts = ["a short one", "Mitochondrial dysfunction is a hallmark of aging. " * 40, "", "ünïcödé ☃ text"]
    expected = [len(ids) for ids in embedder.encoder.tokenizer(texts, truncation=True,
                                                                     max_length=embedder.encoder.max_length)["input_ids"]]
    with ThreadPoolExecutor(4) as pool:
        works = list(pool.map(lambda _: embedder.measure(texts, ["mean"]), range(8)))
    assert all(w.counts == expected for w in works)
    calls = []
    real = embedder.encoder.tokenize
    monkeypatch.setattr(embedder.encoder, "tokenize", lambda *a, **k: calls.append(a) or real(*a, **k))
    b = Batcher(embedder, max_queue=1000, max_batch_tokens=2048, max_wait_ms=0).start()
    try:
        jobs = [b.submit(texts, ["mean"], workload=w) for w in works[:4]]
        outs = [j.future.result(timeout=120) for j in jobs]
    finally:
        b.stop()
    assert calls == []
    assert all(o.usage == sum(expected) for o in outs)
    ref = embedder.embed(texts, ["mean"]).matrix("mean")
    assert np.allclose(np.stack(outs[0].vectors["mean"]), ref, atol=1e-5)


def test_unmeasured_requests_of_a_round_are_tokenized_in_one_call(embedder, monkeypatch):
    """Requests queued unmeasured (the server leaves short texts whose limits hold without
    counting to the worker) are tokenized by the worker in one call for the whole round, a
    measured request of the same round is not tokenized again, and each gets its own usage and
    vectors."""
    texts = [f"query number {i} about mitochondria" for i in range(6)]
    measured = ["a measured one", "and its second text"]
    work = embedder.measure(measured, ["mean"])
    calls = []
    real = embedder.encoder.tokenize
    monkeypatch.setattr(embedder.encoder, "tokenize", lambda *a, **k: calls.append(list(a[0])) or real(*a, **k))
    b = Batcher(embedder, max_queue=1000, max_batch_tokens=2048, max_wait_ms=0)  # queued before the worker starts
    jobs = [b.submit([t], ["mean"]) for t in texts] + [b.submit(measured, ["mean"], workload=work)]
    b.start()
    try:
        outs = [j.future.result(timeout=120) for j in jobs]
    finally:
        b.stop()
    assert calls == [texts]  # one round: one tokenization of the six, none of the measured request
    ref = embedder.embed(texts + measured, ["mean"]).matrix("mean")
    got = np.stack([v for o in outs for v in o.vectors["mean"]])
    assert np.allclose(got, ref, atol=1e-5)
    counts = [len(ids) for ids in embedder.encoder.tokenizer(texts + measured)["input_ids"]]
    assert [o.usage for o in outs] == [*counts[:6], sum(counts[6:])]


def test_clients_split_into_two_groups_merge_again():
    """Four closed-loop clients (each sends its next request as soon as the last is answered)
    whose first requests arrive split -- one alone, whose round starts at once, and three during
    that round -- are one round again after the next one: after a busy round the worker waits
    (at most a quarter of the round's time) for the clients it just answered. Without that wait
    the two groups alternate for good (rounds of 1 and 3: ~12 rounds for the 24 requests)."""
    emb = FakeEmbedder(delay=0.04)  # a 40 ms round: the wait after it is at most 10 ms
    b = Batcher(emb, max_queue=100, max_batch_tokens=10_000, max_wait_ms=2000).start()
    try:
        async def client(k: int) -> None:
            for i in range(6):
                await b.embed([f"c{k} r{i}"], ["mean"])

        async def run() -> None:
            first = asyncio.ensure_future(client(0))
            deadline = time.monotonic() + 10
            while not b._in_round and time.monotonic() < deadline:  # client 0's round is running
                await asyncio.sleep(0.001)
            await asyncio.gather(first, *[client(k) for k in (1, 2, 3)])

        asyncio.run(run())
    finally:
        b.stop()
    sizes = [len(c[0]) for c in emb.calls]
    assert sum(sizes) == 24
    assert sizes[0] == 1 and sizes[1] == 4  # clients 1-3 and client 0's second request, merged
    assert len(sizes) <= 8 and sizes.count(4) >= 5, sizes
