"""Encoder families: embedpool's ``auto`` against each family's reference library, in one run.

For every family of ``tests/family_models.py`` (BERT with a Dense head, BERT mean+max with
LayerNorm, BERT CLS with prompts, DistilBERT, MPNet with Matryoshka truncation, RoBERTa,
ModernBERT, Qwen3 last-token, Llama weighted mean; and a PyLate ColBERT) this builds a
MiniLM-sized random-weight model (hidden 384, 6 layers, 12 heads, window 256: random weights run
exactly as fast as trained ones), saved through the reference library, and on the first
``--docs`` SciFact documents measures:

- texts/s of the reference's own encode (sentence-transformers ``encode_document`` fp32; PyLate
  ``encode(is_query=False)`` fp32, in PyLate's venv, ``make pylate``), and of embedpool ``auto``
  at ``--precision fp32`` and at ``--precision auto`` (the path this CPU gets), each the best of
  ``--repeat`` runs, back to back in this process (PyLate's in its own, right after);
- the parity figure: the minimum cosine of embedpool's vectors to the reference's (ColBERT: over
  every token vector of every document), fp32 and the auto path.

Quality (SciFact / STS-B) is not measured here: no package on this machine carries a second
real model's weights (only all-MiniLM-L6-v2, bench/eval.py's model).

    flock /work/locks/cpu.lock .venv/bin/python bench/families.py            # full run
    .venv/bin/python bench/families.py --docs 16 --repeat 1 --family bert-dense   # a quick look

Writes ``bench/results/families.json`` (or ``--out``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent / "tests"))

import numpy as np  # noqa: E402

from scale import machine  # noqa: E402

SIZE = dict(hidden=384, layers=6, heads=12, intermediate=1536, window=256, positions=514)


def scifact_docs(n: int) -> list[str]:
    from embedpool.app.datasets import load_beir

    data_dir = Path(os.environ.get("EMBEDPOOL_SHARED_DATA", _HERE.parent.parent / "shared" / "data"))
    return [r.text for r in load_beir(data_dir / "scifact", "test").corpus[:n]]


def best_of(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def min_cos(a, b) -> float:
    if isinstance(a, list):  # token vectors: every token of every document
        if any(x.shape != y.shape for x, y in zip(a, b)):
            return float("nan")
        a, b = np.concatenate(a), np.concatenate(b)
    na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
    return float(((a * b).sum(-1) / np.maximum(na * nb, 1e-30)).min())


def sentence_family(name: str, root: Path, docs: list[str], repeat: int, size) -> dict:
    import family_models as fm

    from embedpool.poolers import Embedder, FrozenEncoder

    fam = fm.FAMILIES[name]
    path = fm.build(fam, root, size=size)
    ref = fm.reference(path, fam)
    ref.encode_document(docs[:4], batch_size=32)
    t_ref, expected = best_of(lambda: ref.encode_document(docs, batch_size=32, convert_to_numpy=True), repeat)
    row = {"family": name, "arch": fam.arch, "stack": describe(ref), "reference": "sentence-transformers fp32",
           "ref_texts_s": len(docs) / t_ref}
    for precision in ("fp32", "auto"):
        emb = Embedder(FrozenEncoder(str(path), precision=precision, truncate_dim=fam.truncate_dim))
        emb.embed(docs[:4], ["auto"])
        t, got = best_of(lambda: emb.embed(docs, ["auto"], normalize=False).matrix("auto"), repeat)
        row[f"{precision}_texts_s"] = len(docs) / t
        row[f"{precision}_min_cos"] = min_cos(got, expected)
        row[f"{precision}_dim"] = int(got.shape[1])
        if precision == "auto":
            row["auto_path"], row["auto_reason"] = emb.encoder.precision, emb.encoder.precision_reason
    row["ref_dim"] = int(expected.shape[1])
    return row


def colbert_family(root: Path, docs: list[str], repeat: int, size) -> dict:
    import family_models as fm

    from embedpool.poolers import Embedder, FrozenEncoder

    ref = fm.run_pylate(root / "colbert", {"queries": ["q"], "documents": docs, "bench": docs}, size=size,
                        colbert={"embedding_size": 128, "query_length": 32, "document_length": 180},
                        bench=repeat, timeout=3600)
    row = {"family": "colbert", "arch": "bert", "stack": "Transformer, Dense(384->128) per token, skiplist, "
           "Normalize", "reference": f"PyLate {ref['pylate']} fp32", "ref_texts_s": len(docs) / ref["seconds"]}
    for precision in ("fp32", "auto"):
        emb = Embedder(FrozenEncoder(str(ref["path"]), precision=precision))
        emb.embed(docs[:4], ["tokens"])
        t, got = best_of(lambda: emb.embed(docs, ["tokens"]).vectors["tokens"], repeat)
        row[f"{precision}_texts_s"] = len(docs) / t
        row[f"{precision}_min_cos"] = min_cos(got, ref["documents"])
        row[f"{precision}_dim"] = int(got[0].shape[1])
        if precision == "auto":
            row["auto_path"], row["auto_reason"] = emb.encoder.precision, emb.encoder.precision_reason
    row["ref_dim"] = int(ref["documents"][0].shape[1])
    return row


def describe(st) -> str:
    names = []
    for m in st:
        n = type(m).__name__
        if n == "Pooling":
            mode = m.pooling_mode
            n += "(" + ("+".join(mode) if not isinstance(mode, str) else mode) + ")"
        elif n == "Dense":
            n += f"({m.in_features}->{m.out_features})"
        names.append(n)
    if st.truncate_dim:
        names.append(f"truncate_dim={st.truncate_dim}")
    return ", ".join(names)


def table(rows: list[dict]) -> str:
    head = ("| family | module stack | reference | ref texts/s | embedpool fp32 texts/s (x ref) | embedpool auto "
            "texts/s (x ref) | min cos fp32 | min cos auto | dim (ref) |\n|---|---|---|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['family']} | {r['stack']} | {r['reference']} | {r['ref_texts_s']:.1f} | "
                     f"{r['fp32_texts_s']:.1f} ({r['fp32_texts_s'] / r['ref_texts_s']:.2f}x) | "
                     f"{r['auto_texts_s']:.1f} ({r['auto_texts_s'] / r['ref_texts_s']:.2f}x, {r['auto_path']}) | "
                     f"{r['fp32_min_cos']:.6f} | {r['auto_min_cos']:.5f} | {r['fp32_dim']} ({r['ref_dim']}) |")
    return "\n".join(lines)


def main() -> None:
    import family_models as fm
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--family", action="append", help="only these (default: every family and colbert)")
    p.add_argument("--out", default=str(_HERE / "results" / "families.json"))
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 2)
    size = fm.Size(**SIZE)
    docs = scifact_docs(args.docs)
    names = args.family or [*fm.FAMILIES, "colbert"]
    info = machine()
    print(f"machine: {info['cpu']} x{info['cpus']} {' '.join(info['cpu_flags'])}; torch {torch.__version__}",
          file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            t0 = time.perf_counter()
            row = (colbert_family(Path(tmp), docs, args.repeat, size) if name == "colbert"
                   else sentence_family(name, Path(tmp), docs, args.repeat, size))
            rows.append(row)
            print(f"{name}: {time.perf_counter() - t0:.0f}s {json.dumps({k: v for k, v in row.items() if k != 'auto_reason'})}",
                  file=sys.stderr)
    info["loadavg_end"] = os.getloadavg()
    result = {"machine": info, "docs": len(docs), "repeat": args.repeat, "size": SIZE, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
