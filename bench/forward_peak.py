"""How near this CPU's matrix-multiply rate the encoder's forward runs (issue 34's documents cell).

``bench/serve.py`` finds the served documents cell bound by the forward (the worker runs it
97-98% of the time), so a served rate is at most the in-process one. This asks how much faster
that forward could still get on this CPU at its own precision, and so what a target relative to
another server's rate demands of the hardware. One process, one run:

- **the forward**: the engine's in-process ``embed`` of all texts of a set in one call (as
  ``bench/serve.py``'s in-process column; best of ``--reps``), converted to the useful
  floating-point operations of a BERT-type encoder: per text of ``n`` tokens (after truncation,
  special tokens included) ``2 n P + 4 n^2 h L``, ``P = L (4 h^2 + 2 h i)`` the multiply-adds
  per token of the attention projections and the feed-forward layers, ``h`` the hidden size,
  ``i`` the intermediate size, ``L`` the layers (the second term: the attention scores and
  their weighted sum). Embeddings, normalisation, softmax, activations and padding are not
  counted: the figure is a lower bound of the work done.
- **the library's matrix multiply at the model's shapes**: torch (oneDNN) ``[M, h] x [h, i]``
  and ``[M, i] x [i, h]`` (the feed-forward layers, the bulk of ``P``), ``M`` = ``--rows`` token
  rows, in bfloat16 (on CPUs with bf16 units) and float32, and the int8 ``torch._int_mm`` of
  the same shapes (the rate an int8 forward could reach at best); on the torch threads the
  encoder uses.

The forward's rate over the bf16 (or fp32) matmul rate is the share of the CPU's practical peak
the forward reaches. With ``--serve-json`` (a ``bench/serve.py`` result), the documents rate
another server reached there is turned into the rate a multiple of it would need.

    .venv/bin/python bench/forward_peak.py
    .venv/bin/python bench/forward_peak.py --serve-json bench/results/serve_vnni_epyc.json

Writes ``bench/results/forward_peak.json`` (or ``--out``) and prints the CPU flags and a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve  # noqa: E402  (bench/serve.py: the data loaders and the CPU report)


def best_seconds(fn, reps: int) -> float:
    fn()  # warm
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def encoder_flops(config, lengths: list[int]) -> float:
    """Useful floating-point operations of a BERT-type forward over texts of ``lengths`` tokens."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    per_token = layers * (4 * h * h + 2 * h * i)
    return float(sum(2 * n * per_token + 4 * n * n * h * layers for n in lengths))


def matmul_rates(h: int, i: int, rows: int, reps: int, bf16: bool) -> dict[str, float]:
    """GFLOP/s (int8: GOP/s) of the feed-forward shapes ``[rows, h] x [h, i]`` and back."""
    import torch

    out = {}
    kinds = (["bf16"] if bf16 else []) + ["fp32", "int8"]
    for kind in kinds:
        g = torch.Generator().manual_seed(0)
        if kind == "int8":
            a1 = torch.randint(-127, 128, (rows, h), dtype=torch.int8, generator=g)
            w1 = torch.randint(-127, 128, (h, i), dtype=torch.int8, generator=g)
            a2 = torch.randint(-127, 128, (rows, i), dtype=torch.int8, generator=g)
            w2 = torch.randint(-127, 128, (i, h), dtype=torch.int8, generator=g)

            def run():
                torch._int_mm(a1, w1)
                torch._int_mm(a2, w2)
        else:
            dt = torch.bfloat16 if kind == "bf16" else torch.float32
            a1, w1 = torch.randn(rows, h, generator=g).to(dt), torch.randn(h, i, generator=g).to(dt)
            a2, w2 = torch.randn(rows, i, generator=g).to(dt), torch.randn(i, h, generator=g).to(dt)

            def run():
                with torch.inference_mode():
                    torch.mm(a1, w1)
                    torch.mm(a2, w2)
        out[kind] = 2 * 2 * rows * h * i / best_seconds(run, reps) / 1e9
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--documents", type=int, default=100, help="SciFact documents (bench/serve.py's set)")
    ap.add_argument("--sentences", type=int, default=1000, help="STS-B test sentences")
    ap.add_argument("--rows", type=int, default=4096, help="token rows of the matmul")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--serve-json", type=Path, help="a bench/serve.py result: other servers' documents rates")
    ap.add_argument("--out", type=Path, default=serve.ROOT / "bench" / "results" / "forward_peak.json")
    args = ap.parse_args()

    import torch

    from embedpool.app.settings import Settings, load_embedder

    emb = load_embedder(Settings(precision=args.precision))
    enc = emb.encoder
    config = enc.model.config
    cpu = serve._isa()
    bf16 = "bf16" in enc.precision or "avx512_bf16" in cpu or "amx" in cpu
    res: dict = {"cpu": cpu, "cpu_model": serve._cpu(), "precision": args.precision, "resolved": enc.precision,
                 "torch_threads": torch.get_num_threads(), "reps": args.reps, "sets": {}}
    print(f"{serve._cpu()}; precision {args.precision} -> {enc.precision}; "
          f"torch threads {torch.get_num_threads()}", flush=True)
    sets = {"scifact documents": serve.load_scifact(args.documents), "sts-b sentences": serve.load_sts(args.sentences)}
    for name, texts in sets.items():
        lengths = [min(n, enc.max_length) for n in enc.lengths(texts)]
        sec = best_seconds(lambda: emb.embed(texts), args.reps)
        flops = encoder_flops(config, lengths)
        res["sets"][name] = {"texts": len(texts), "tokens": sum(lengths), "texts_per_s": round(len(texts) / sec, 2),
                             "gflop_per_text": round(flops / len(texts) / 1e9, 4),
                             "forward_gflops": round(flops / sec / 1e9, 1)}
        print(f"  {name}: {res['sets'][name]}", flush=True)
    rates = matmul_rates(config.hidden_size, config.intermediate_size, args.rows, args.reps, bf16)
    res["matmul_gflops"] = {k: round(v, 1) for k, v in rates.items()}
    ref = "bf16" if bf16 else "fp32"
    print(f"  matmul [{args.rows}, {config.hidden_size}] x [{config.hidden_size}, {config.intermediate_size}] "
          f"and back: {res['matmul_gflops']} (int8: GOP/s)", flush=True)
    others = {}
    if args.serve_json:
        for path_run in json.loads(args.serve_json.read_text())["runs"].values():
            for c in path_run["cells"]:
                if c["set"] == "scifact documents" and c.get("infinity"):
                    others[f"Infinity, documents, c={c['concurrency']}"] = c["infinity"]["throughput"]
    print(f"\n| set | tokens / text | texts/s | forward GFLOP/s | ÷ {ref} matmul | ÷ int8 matmul |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, s in res["sets"].items():
        s[f"share_of_{ref}_matmul"] = round(s["forward_gflops"] / rates[ref], 3)
        s["share_of_int8_matmul"] = round(s["forward_gflops"] / rates["int8"], 3)
        print(f"| {name} | {s['tokens'] / s['texts']:.0f} | {s['texts_per_s']} | {s['forward_gflops']} "
              f"| {s[f'share_of_{ref}_matmul']:.2f} | {s['share_of_int8_matmul']:.2f} |")
    doc = res["sets"]["scifact documents"]
    for label, rps in others.items():
        need = 2 * rps * doc["gflop_per_text"]
        res.setdefault("twice_other_servers", {})[label] = {"rps": rps, "needed_gflops": round(need, 1),
                                                             f"needed_share_of_{ref}_matmul": round(need / rates[ref], 3)}
        print(f"2x {label} ({rps} docs/s) needs {need:.0f} GFLOP/s of forward = {need / rates[ref]:.2f} of the "
              f"{ref} matmul rate ({need / rates['int8']:.2f} of the int8 one)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
