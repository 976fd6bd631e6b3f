"""HTTP serving benchmark: embedpool's server vs the in-process pipeline vs Infinity.

One text per request (OpenAI-compatible ``/v1/embeddings`` on both servers), at concurrency 1, 8
and 32, for short sentences (STS-B test) and documents (SciFact title + abstract). The in-process
numbers embed all texts of a set in one call (the engine's token-budget batches): the ceiling;
"1 text per call" embeds them one at a time in-process, what concurrency 1 can reach at best.
The load generator is a small keep-alive HTTP/1.1 client on asyncio (cheap on CPU: it shares the
machine with the server, for every server alike).

The machine is shared and noisy, so the systems are measured interleaved: all servers are up at
once (an idle server uses no CPU), each cell runs every system one after the other, ``--reps``
times in rotating order, and the best repetition counts. Then a load run: 64 clients for 60 s
against embedpool alone (non-429 failures, /health latency throughout, RSS before and after).

    .venv/bin/python bench/serve.py                        # fp32, ~15 min on 2 cores
    .venv/bin/python bench/serve.py --precision fp32 bf16  # also the bf16 path
    .venv/bin/python bench/serve.py --quick                # small sizes, ~3 min
    .venv/bin/python bench/serve.py --baseline ../old/.venv/bin/python  # + another checkout's server

``--baseline PYTHON`` adds a second embedpool server per precision, started with another
checkout's venv Python (from that checkout's folder, the venv's parent): the code before a change,
measured in the same interleaved cells as the current code, on the same load.

Infinity runs from its own venv (``--infinity-venv``, default bench/.infinity-venv, made by ``make infinity``, with
``infinity-emb[server,torch]`` and the CPU torch build) on the same local model folder with
``--engine torch --device cpu``; without that venv its columns stay empty.

Writes ``bench/results/serve.json`` and prints a markdown table. Every process (this one, the
servers) runs with ``OMP_WAIT_POLICY=PASSIVE`` so idle OpenMP threads do not spin.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from embedpool.app.datasets import CorpusSource, sts_sentences  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("EMBEDPOOL_SHARED_DATA", ROOT.parent / "shared" / "data"))
OUT = ROOT / "bench" / "results" / "serve.json"


# ---------------------------------------------------------------------- data
def load_sts(n: int) -> list[str]:
    """The first ``n`` distinct non-empty STS-B test sentences (app/datasets.py)."""
    return sts_sentences(DATA / "stsb", ("test",), unique=True)[:n]


def load_scifact(n: int) -> list[str]:
    """The first ``n`` SciFact documents (``title + " " + text``)."""
    return [r.text for r in itertools.islice(CorpusSource(str(DATA / "scifact" / "corpus.jsonl"), "beir").records(), n)]


# ---------------------------------------------------------------------- HTTP load generator
class Conn:
    """One keep-alive HTTP/1.1 connection (Content-Length or chunked answers)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        if self.writer is None:
            await self.open()
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        try:
            self.writer.write(head.encode() + body)
            line = await self.reader.readline()
            if not line:
                raise ConnectionError("connection closed")
            status = int(line.split()[1])
            length, chunked, close = None, False, False
            while True:
                line = await self.reader.readline()
                if line in (b"\r\n", b""):
                    break
                key, _, value = line.decode("latin-1").partition(":")
                key = key.strip().lower()
                if key == "content-length":
                    length = int(value)
                elif key == "transfer-encoding" and "chunked" in value:
                    chunked = True
                elif key == "connection" and "close" in value.lower():
                    close = True
            if chunked:
                parts = []
                while True:
                    size = int((await self.reader.readline()).strip(), 16)
                    if size == 0:
                        await self.reader.readline()
                        break
                    parts.append(await self.reader.readexactly(size))
                    await self.reader.readline()
                data = b"".join(parts)
            else:
                data = await self.reader.readexactly(length or 0)
        except BaseException:
            self.close()
            raise
        if close:
            self.close()
        return status, data


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))]


async def run_cell(host: str, port: int, path: str, texts: list[str], concurrency: int,
                   model: str, *, text_field: str = "input", fields: dict | None = None) -> dict:
    """Send each text as its own request from ``concurrency`` clients; latency and throughput.

    Each body is ``{text_field: [text], "model": model, **fields}`` (``/v1/embeddings``' shape by
    default; ``text_field="inputs"`` for ``POST /embed``, ``fields`` e.g. ``{"pooler": "splade"}``)."""
    bodies = [json.dumps({text_field: [t], "model": model, **(fields or {})}).encode() for t in texts]
    todo = iter(range(len(bodies)))
    lat: list[float] = []
    statuses: dict[int, int] = {}
    errors = 0

    async def worker() -> None:
        nonlocal errors
        conn = Conn(host, port)
        for i in todo:
            t0 = time.perf_counter()
            try:
                status, data = await conn.request("POST", path, bodies[i])
            except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError):
                errors += 1
                continue
            lat.append(time.perf_counter() - t0)
            statuses[status] = statuses.get(status, 0) + 1
        conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    ok = statuses.get(200, 0)
    return {"requests": len(bodies), "ok": ok, "statuses": statuses, "errors": errors,
            "seconds": round(wall, 3), "throughput": round(ok / wall, 2),
            "p50_ms": round(pct(lat, 50) * 1000, 1), "p99_ms": round(pct(lat, 99) * 1000, 1)}


async def check_embedding(host: str, port: int, path: str, model: str) -> int:
    conn = Conn(host, port)
    status, data = await conn.request("POST", path, json.dumps({"input": ["hello"], "model": model}).encode())
    conn.close()
    assert status == 200, data[:300]
    return len(json.loads(data)["data"][0]["embedding"])


# ---------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int, health: str, log: Path,
                 cwd: Path = ROOT) -> None:
        self.name, self.port, self.health = name, port, health
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, cwd=cwd, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float = 600) -> float:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                status, _ = asyncio.run(_get(self.port, self.health))
                if status == 200:
                    return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout}s")

    def rss_mb(self) -> float:
        import psutil

        p = psutil.Process(self.proc.pid)
        return round(sum(q.memory_info().rss for q in [p, *p.children(recursive=True)]) / 2**20, 1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


async def _get(port: int, path: str) -> tuple[int, bytes]:
    conn = Conn("127.0.0.1", port)
    try:
        return await conn.request("GET", path)
    finally:
        conn.close()


def start_embedpool(precision: str, logdir: Path, max_batch_tokens: int | None = None,
                    python: Path | None = None) -> Proc:
    """embedpool's server with this checkout's Python, or (``python``, a baseline) with another
    checkout's venv Python, run from that checkout (the venv's parent folder)."""
    port = free_port()
    name = f"embedpool-{precision}" + ("-baseline" if python else "")
    env = {"EMBEDPOOL_PRECISION": precision, "EMBEDPOOL_DATA_DIR": str(logdir / "data" / name),
           "EMBEDPOOL_LOG_LEVEL": "warning"}
    if max_batch_tokens:
        env["EMBEDPOOL_MAX_BATCH_TOKENS"] = str(max_batch_tokens)
    cmd = [str(python or sys.executable), "-m", "embedpool.app.cli", "serve", "--port", str(port)]
    return Proc(name, cmd, env, port, "/health", logdir / f"{name}.log",
                cwd=baseline_tree(python) if python else ROOT)


def baseline_tree(python: Path) -> Path:
    """The checkout a venv Python belongs to (``TREE/.venv/bin/python``)."""
    return Path(os.path.abspath(python)).parents[2]


def git_commit(tree: Path) -> str | None:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or None


def start_infinity(venv: Path, model_path: str, logdir: Path, dtype: str = "float32") -> Proc:
    port = free_port()
    cmd = [str(venv / "bin" / "infinity_emb"), "v2", "--model-id", model_path, "--served-model-name",
           "all-MiniLM-L6-v2", "--engine", "torch", "--device", "cpu", "--dtype", dtype,
           "--no-bettertransformer", "--url-prefix", "/v1", "--port", str(port), "--log-level", "warning"]
    return Proc(f"infinity-{dtype}", cmd, {}, port, "/health", logdir / f"infinity-{dtype}.log")


def infinity_dtype(path: str, override: str | None = None) -> str:
    """Infinity's dtype comparable to an embedpool path (bf16 paths vs Infinity bfloat16), unless
    ``--infinity-dtype`` names one."""
    return override or ("bfloat16" if "bf16" in path else "float32")


async def stage_seconds(port: int) -> dict[str, float]:
    """embedpool's worker time per round stage so far (``/metrics``)."""
    status, body = await _get(port, "/metrics")
    out = {}
    for line in body.decode().splitlines():
        if line.startswith("embedpool_round_stage_seconds_total{"):
            stage = line.split('stage="', 1)[1].split('"', 1)[0]
            out[stage] = float(line.rsplit(" ", 1)[1])
    return out


async def server_precision(port: int) -> dict:
    status, body = await _get(port, "/info")
    info = json.loads(body)
    return {k: info.get(k) for k in ("precision", "precision_requested", "precision_reason", "cpu")}


def infinity_version(venv: Path) -> str | None:
    try:
        out = subprocess.run([str(venv / "bin" / "python"), "-c",
                              "import importlib.metadata as m; print(m.version('infinity-emb'))"],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.strip() or None
    except OSError:
        return None


# ---------------------------------------------------------------------- in-process
class InProcess:
    """The pipeline (and, in fp32, sentence-transformers) in this process, all texts of a set
    in one call (the engine's own token-budget batches): the throughput ceiling. Also the
    pipeline with one text per call (``pipeline_1``, on the first ``single`` texts): what a
    server at concurrency 1 can reach at best, as it cannot batch."""

    def __init__(self, precision: str, max_batch_tokens: int | None = None) -> None:
        from embedpool.app.settings import Settings, load_embedder
        from embedpool.poolers.encoder import default_model_path

        overrides = {"max_batch_tokens": max_batch_tokens} if max_batch_tokens else {}
        self.embedder = load_embedder(Settings(precision=precision, **overrides))
        self.embedder.embed(["warm up"] * 8)
        self.st = None
        if precision == "fp32":
            from sentence_transformers import SentenceTransformer

            self.st = SentenceTransformer(default_model_path(), device="cpu")
            self.st.encode(["warm up"] * 8)

    def run(self, texts: list[str], single: int = 0) -> dict:
        import torch

        t0 = time.perf_counter()
        self.embedder.embed(texts)
        out = {"pipeline": round(len(texts) / (time.perf_counter() - t0), 2)}
        if single:
            t0 = time.perf_counter()
            for t in texts[:single]:
                self.embedder.embed([t])
            out["pipeline_1"] = round(single / (time.perf_counter() - t0), 2)
        if self.st is not None:
            t0 = time.perf_counter()
            with torch.inference_mode():
                self.st.encode(texts, batch_size=32)
            out["sentence_transformers"] = round(len(texts) / (time.perf_counter() - t0), 2)
        return out


# ---------------------------------------------------------------------- load run
async def load_run(port: int, texts: list[str], clients: int, seconds: float) -> dict:
    stop_at = time.perf_counter() + seconds
    statuses: dict[int, int] = {}
    errors = 0
    lat: list[float] = []
    health: list[float] = []
    bad_health = 0

    async def client(k: int) -> None:
        nonlocal errors
        conn = Conn("127.0.0.1", port)
        i = k
        while time.perf_counter() < stop_at:
            body = json.dumps({"input": [texts[i % len(texts)]], "model": "x"}).encode()
            i += clients
            t0 = time.perf_counter()
            try:
                status, _ = await conn.request("POST", "/v1/embeddings", body)
            except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError):
                errors += 1
                continue
            lat.append(time.perf_counter() - t0)
            statuses[status] = statuses.get(status, 0) + 1
            if status == 429:
                await asyncio.sleep(1)
        conn.close()

    async def prober() -> None:
        nonlocal bad_health
        conn = Conn("127.0.0.1", port)
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            try:
                status, _ = await conn.request("GET", "/health")
            except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError):
                bad_health += 1
                continue
            health.append(time.perf_counter() - t0)
            bad_health += status != 200
            await asyncio.sleep(0.25)
        conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(prober(), *(client(k) for k in range(clients)))
    wall = time.perf_counter() - t0
    ok = statuses.get(200, 0)
    failures = errors + sum(n for s, n in statuses.items() if s not in (200, 429))
    return {"clients": clients, "seconds": round(wall, 1), "requests": sum(statuses.values()) + errors,
            "ok": ok, "rejected_429": statuses.get(429, 0), "non_429_failures": failures,
            "statuses": statuses, "throughput": round(ok / wall, 2),
            "p50_ms": round(pct(lat, 50) * 1000, 1), "p99_ms": round(pct(lat, 99) * 1000, 1),
            "health_probes": len(health), "health_failures": bad_health,
            "health_p50_ms": round(pct(health, 50) * 1000, 1), "health_p99_ms": round(pct(health, 99) * 1000, 1),
            "health_max_ms": round(max(health) * 1000, 1) if health else None}


# ---------------------------------------------------------------------- main
def table(results: dict) -> str:
    rows = ["| precision | set | conc. | embedpool req/s (p50/p99 ms) | Infinity req/s (p50/p99 ms) "
            "| in-process texts/s | 1 text/call | embedpool / in-process | embedpool / Infinity | worker time: "
            "tokenize / forward / pool / count / deliver / idle |",
            "|---|---|---:|---|---|---:|---:|---:|---:|---|"]
    for prec, per in results["runs"].items():
        label = prec if prec != "auto" else f"auto ({per.get('server', {}).get('precision')})"
        for cell in per["cells"]:
            ep, inf = cell["embedpool"], cell.get("infinity") or {}
            ip = per["inprocess"][cell["set"]]
            r_ep = ep["throughput"] / ip["pipeline"]
            r_vs = ep["throughput"] / inf["throughput"] if inf else None
            base = cell.get("baseline")
            st = ep.get("stages") or {}
            busy = ep["seconds"] or 1.0
            shares = " / ".join(f"{100 * st.get(k, 0) / busy:.0f}%" for k in ("tokenize", "forward", "pool", "count",
                                                                               "deliver"))
            idle = max(0.0, 100 * (1 - sum(st.values()) / busy)) if st else None
            inf_s = f"{inf['throughput']:g} ({inf['p50_ms']:g}/{inf['p99_ms']:g})" if inf else ""
            base_s = (f" {base['throughput']:g} ({base['p50_ms']:g}/{base['p99_ms']:g}) | "
                      f"{ep['throughput'] / base['throughput']:.2f}x |" if base else "")
            rows.append(
                f"| {label} | {cell['set']} | {cell['concurrency']} | {ep['throughput']:g} ({ep['p50_ms']:g}/"
                f"{ep['p99_ms']:g}) | {inf_s} | {ip['pipeline']:g} | {ip.get('pipeline_1', '')} | {r_ep:.2f}x "
                f"| {'' if r_vs is None else f'{r_vs:.2f}x'} | {shares + f' / {idle:.0f}%' if st else ''} |"
                + base_s)
    commit = results["setup"].get("baseline_commit")
    if commit:
        rows[0] += f" baseline {commit} req/s (p50/p99 ms) | embedpool / baseline |"
        rows[1] += "---|---:|"
    load = results.get("load")
    if load:
        rows += ["", f"Load run ({load['clients']} clients, {load['seconds']} s, {load['precision']}): "
                 f"{load['ok']} ok, {load['rejected_429']} 429, **{load['non_429_failures']} non-429 failures**, "
                 f"{load['throughput']} req/s, p50 {load['p50_ms']} ms, p99 {load['p99_ms']} ms; "
                 f"/health p50 {load['health_p50_ms']} ms, p99 {load['health_p99_ms']} ms, max "
                 f"{load['health_max_ms']} ms ({load['health_failures']} not 200 of {load['health_probes']}); "
                 f"server RSS {load['rss_before_mb']} MB before, {load['rss_after_mb']} MB after."]
    return "\n".join(rows)


def best(a: dict | None, b: dict) -> dict:
    """Keep the repetition with the higher throughput (the machine is shared: noise only slows)."""
    if a is None:
        return b
    key = "throughput" if "throughput" in b else "pipeline"
    return b if b[key] > a[key] else a


def best_each(a: dict | None, b: dict) -> dict:
    """Per key, the higher of two in-process repetitions."""
    return dict(b) if a is None else {k: max(v, a.get(k, v)) for k, v in b.items()}


def start_peers(args, logdir: Path, results: dict, servers: dict, inf_ok: bool) -> tuple[dict, dict]:
    """Wait for the embedpool servers (recording the path each resolved), start Infinity in the
    dtypes those paths need (added to ``servers``), check every server embeds. Returns
    ``(paths, models)``: embedpool precision -> path, server name -> model name to send."""
    from embedpool.poolers.encoder import default_model_path

    paths: dict[str, str] = {}
    for p in args.precision:
        srv = servers[f"embedpool-{p}"]
        results["setup"][f"{srv.name}_load_seconds"] = round(srv.wait(), 1)
        info = asyncio.run(server_precision(srv.port))
        results["runs"][p] = {"server": info}
        paths[p] = info["precision"] or p
        print(f"  {srv.name}: path {paths[p]} ({info.get('precision_reason')})", flush=True)
        base = servers.get(f"embedpool-{p}-baseline")
        if base is not None:
            results["setup"][f"{base.name}_load_seconds"] = round(base.wait(), 1)
            results["runs"][p]["baseline_server"] = asyncio.run(server_precision(base.port))
    if inf_ok:
        for dtype in dict.fromkeys(infinity_dtype(paths[p], args.infinity_dtype) for p in args.precision):
            srv = servers[f"infinity-{dtype}"] = start_infinity(args.infinity_venv, default_model_path(), logdir, dtype)
            results["setup"][f"{srv.name}_load_seconds"] = round(srv.wait(), 1)
    models = {name: ("all-MiniLM-L6-v2" if name.startswith("infinity") else "x") for name in servers}
    for name, srv in servers.items():
        asyncio.run(check_embedding("127.0.0.1", srv.port, "/v1/embeddings", models[name]))
    return paths, models



def write_results(results: dict, out: Path) -> None:
    """The run's JSON, with the load average at its end (this benchmark's and serve_rounds.py's)."""
    results["machine"]["load_avg_end"] = os.getloadavg()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precision", nargs="+", default=["fp32", "auto"],
                    help="encoder precisions to bench (EMBEDPOOL_PRECISION values); Infinity runs in the "
                    "matching dtype (bfloat16 for bf16 paths, else float32)")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--sts", type=int, default=300, help="STS-B test sentences (requests per cell)")
    ap.add_argument("--scifact", type=int, default=100, help="SciFact documents (requests per cell)")
    ap.add_argument("--max-batch-tokens", type=int, default=None,
                    help="token budget of a forward batch, in-process and server alike (default: the setting's)")
    ap.add_argument("--single", type=int, default=40,
                    help="texts embedded one per call in-process (the concurrency-1 ceiling); 0 = skip")
    ap.add_argument("--reps", type=int, default=2, help="interleaved repetitions per cell; the best counts")
    ap.add_argument("--infinity-venv", type=Path, default=ROOT / "bench" / ".infinity-venv",
                    help="Infinity venv (make infinity creates it)")
    ap.add_argument("--infinity-dtype", choices=["float32", "bfloat16"], default=None,
                    help="Infinity's dtype for every path (default: bfloat16 next to a bf16 path, else float32), "
                    "e.g. bfloat16 on a CPU without bf16 units, where auto's path is float32")
    ap.add_argument("--no-infinity", action="store_true")
    ap.add_argument("--load-seconds", type=float, default=60)
    ap.add_argument("--load-clients", type=int, default=64)
    ap.add_argument("--baseline", type=Path, default=None, metavar="PYTHON",
                    help="also run the server of another checkout (its venv's Python, e.g. "
                    "../old/.venv/bin/python) in the same interleaved cells")
    ap.add_argument("--quick", action="store_true", help="64 sentences, 24 documents, 1 rep, 10 s load run")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.quick:
        args.sts, args.scifact, args.reps, args.load_seconds = 64, 24, 1, 10

    from embedpool.poolers.encoder import default_model_path

    sets = {"sts-b sentences": load_sts(args.sts), "scifact documents": load_scifact(args.scifact)}
    logdir = ROOT / "bench" / "results" / "cache" / "serve"
    logdir.mkdir(parents=True, exist_ok=True)
    inf_ok = not args.no_infinity and (args.infinity_venv / "bin" / "infinity_emb").exists()
    results: dict = {
        "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "python": platform.python_version(),
                    "isa": _isa(), "load_avg_start": os.getloadavg()},
        "setup": {"one_text_per_request": True, "route": "/v1/embeddings",
                  "sets": {k: len(v) for k, v in sets.items()}, "concurrency": args.concurrency,
                  "reps": args.reps, "max_batch_tokens": args.max_batch_tokens or _default_budget(),
                  "OMP_WAIT_POLICY": os.environ["OMP_WAIT_POLICY"],
                  "method": "all servers up at once (idle ones use no CPU); per cell the systems run "
                            "one after another, repeated --reps times in rotating order; best of the reps",
                  "infinity": infinity_version(args.infinity_venv) if inf_ok else None,
                  "commit": git_commit(ROOT)},
        "runs": {},
    }
    # Servers first (they load in parallel), then the in-process engines.
    servers: dict[str, Proc] = {f"embedpool-{p}": start_embedpool(p, logdir, args.max_batch_tokens)
                                for p in args.precision}
    if args.baseline:
        results["setup"]["baseline_commit"] = git_commit(baseline_tree(args.baseline))
        servers.update({f"embedpool-{p}-baseline": start_embedpool(p, logdir, args.max_batch_tokens, args.baseline)
                        for p in args.precision})
    try:
        paths, models = start_peers(args, logdir, results, servers, inf_ok)
        engines = {p: InProcess(p, args.max_batch_tokens) for p in args.precision}
        cells: dict[tuple, dict] = {}
        inproc: dict[tuple, dict] = {}
        order = list(servers)
        for set_name, texts in sets.items():
            for name, srv in servers.items():  # warm up
                asyncio.run(run_cell("127.0.0.1", srv.port, "/v1/embeddings", texts[:16], 4, models[name]))
            for rep in range(args.reps):
                for p, eng in engines.items():
                    inproc[(p, set_name)] = best_each(inproc.get((p, set_name)),
                                                      eng.run(texts, single=min(len(texts), args.single)))
                    print(f"  in-process {p} {set_name} rep {rep}: {inproc[(p, set_name)]}", flush=True)
                for c in args.concurrency:
                    for name in order:
                        srv = servers[name]
                        ours = name.startswith("embedpool")
                        before = asyncio.run(stage_seconds(srv.port)) if ours else {}
                        r = asyncio.run(run_cell("127.0.0.1", srv.port, "/v1/embeddings", texts, c, models[name]))
                        if ours:
                            after = asyncio.run(stage_seconds(srv.port))
                            r["stages"] = {k: round(after[k] - before.get(k, 0.0), 3) for k in after}
                        cells[(name, set_name, c)] = best(cells.get((name, set_name, c)), r)
                        print(f"  {name} {set_name} c={c} rep {rep}: {r}", flush=True)
                    order = order[1:] + order[:1]
        for p in args.precision:
            results["runs"][p].update({
                "infinity_dtype": infinity_dtype(paths[p], args.infinity_dtype),
                "inprocess": {s: inproc[(p, s)] for s in sets},
                "cells": [{"set": s, "concurrency": c, "embedpool": cells[(f"embedpool-{p}", s, c)],
                           "infinity": cells.get((f"infinity-{infinity_dtype(paths[p], args.infinity_dtype)}", s, c)),
                           "baseline": cells.get((f"embedpool-{p}-baseline", s, c))}
                          for s in sets for c in args.concurrency]})
        del engines
        gc.collect()
        for name in [n for n in servers if n.startswith("infinity") or n.endswith("-baseline")]:
            # the load run is the current embedpool's alone
            servers.pop(name).stop()
        if args.load_seconds > 0:
            p = args.precision[0]
            srv = servers[f"embedpool-{p}"]
            rss0 = srv.rss_mb()
            print(f"[{p}] load run {args.load_clients} clients x {args.load_seconds}s ...", flush=True)
            load = asyncio.run(load_run(srv.port, sets["sts-b sentences"], args.load_clients, args.load_seconds))
            load.update(precision=p, rss_before_mb=rss0, rss_after_mb=srv.rss_mb())
            print(f"  {load}", flush=True)
            results["load"] = load
    finally:
        for srv in servers.values():
            srv.stop()
    write_results(results, args.out)
    print()
    print(table(results))
    print(f"\nwritten {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


def _default_budget() -> int:
    from embedpool.app.settings import Settings

    return Settings().max_batch_tokens


def _isa() -> dict:
    from embedpool.cpu import cpu_features

    f = cpu_features()
    print(f"CPU: {f.summary()}\nall flags: {' '.join(sorted(f.flags))}", flush=True)
    return {"summary": f.summary(), "isa": f.isa, "torch_capability": f.capability, "flags": sorted(f.flags)}


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
