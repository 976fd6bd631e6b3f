"""The maintained MUVERA FDE implementations on PyPI, measured against poolers/fde.py in one run:
does it install here, does it follow the paper's definition (the literal reading in
tests/poolers/fde_reference.py, ties between equally near points left open), how fast does it
encode real SciFact documents (cached MiniLM token vectors, bench/scifact_data.py), and how well
does its inner product track MaxSim.

The libraries run in their own venv (``--venv``, default bench/.venv-fdelibs, created on the first
run with fastembed and muvera-python; muvera-fde is tried there too), never in the project's.

    flock /tmp/embedpool-bench.lock .venv/bin/python bench/fde_libraries.py

Writes ``bench/results/fde_libraries.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CACHE = HERE / "results" / "cache"
CFG = {"k_sim": 4, "dim_proj": 32, "reps": 10, "seed": 42}


def reference():
    spec = importlib.util.spec_from_file_location("fde_reference", ROOT / "tests" / "poolers" / "fde_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cached_sets(n_docs: int = 512, n_queries: int = 60):
    def load(pattern, n):
        out = []
        for f in sorted(glob.glob(str(CACHE / pattern))):
            with np.load(f) as z:
                out += np.split(z["v0"], np.cumsum(z["n0"])[:-1])  # v0: the tokens pooler
            if len(out) >= n:
                break
        if len(out) < n:
            raise SystemExit(f"fill the embedding cache first: .venv/bin/python bench/scifact_data.py ({CACHE})")
        return out[:n]
    return load("scifact-document-*", n_docs), load("scifact-query-*", n_queries)


def measure(encode_docs, encode_queries, docs, queries) -> dict:
    """docs/s (documents one call per 128), and Spearman of the FDE inner product with MaxSim
    per query over the first 300 documents (documents L2-normalized, as stored)."""
    from scipy.stats import spearmanr

    t0 = time.perf_counter()
    fd = np.concatenate([encode_docs(docs[s:s + 128]) for s in range(0, len(docs), 128)])
    secs = time.perf_counter() - t0
    fq = encode_queries(queries)
    fd = fd[:300] / np.linalg.norm(fd[:300], axis=1, keepdims=True)
    ms = np.array([[(q @ d.T).max(1).sum() for d in docs[:300]] for q in queries])
    sp = np.mean([spearmanr(m, a).statistic for m, a in zip(ms, fq @ fd.T)])
    return {"docs_per_s": round(len(docs) / secs, 1), "dim": int(fd.shape[1]), "spearman_per_query": round(float(sp), 4)}


def definition_check(make, trials: int = 200) -> dict:
    """``make(dim, k, dp, reps, seed) -> (encode_query, encode_doc, gs, ss)`` for random small cases:
    how many FDEs are valid under the definition (the library's own random draws plugged in)."""
    ref = reference()
    rng = np.random.default_rng(0)
    ok = bad = 0
    for trial in range(trials):
        x = rng.standard_normal((int(rng.integers(1, 12)), 8))
        enc_q, enc_d, gs, ss = make(8, 3, 4, 3, trial)
        for role, fn in (("query", enc_q), ("document", enc_d)):
            if ref.matches_definition(np.asarray(fn(x), dtype=np.float64), x, role, gs, ss, tol=1e-4):
                ok += 1
            else:
                bad += 1
    return {"valid": ok, "invalid": bad}


# ------------------------------------------------------------------ in the libraries' venv
def worker() -> dict:
    docs, queries = cached_sets()
    out = {}
    from fastembed.postprocess import Muvera as FastembedMuvera

    def fastembed_make(dim, k, dp, reps, seed):
        m = FastembedMuvera(dim=dim, k_sim=k, dim_proj=dp, r_reps=reps, random_seed=seed)
        return (m.process_query, m.process_document, [s.simhash_vectors.T for s in m.simhash_projections],
                [m.dim_reduction_projections[r].T.astype(float) for r in range(reps)])

    fe = FastembedMuvera(dim=384, k_sim=CFG["k_sim"], dim_proj=CFG["dim_proj"], r_reps=CFG["reps"],
                         random_seed=CFG["seed"])
    out["fastembed.postprocess.Muvera"] = {
        **definition_check(fastembed_make),
        **measure(lambda ds: np.stack([fe.process_document(d) for d in ds]),
                  lambda qs: np.stack([fe.process_query(q) for q in qs]), docs, queries)}

    from muvera import Muvera
    from muvera.helper import ams_projection_matrix_from_seed, simhash_matrix_from_seed

    def muvera_make(dim, k, dp, reps, seed):
        m = Muvera(num_repetitions=reps, num_simhash_projections=k, dimension=dim, projection_type="ams_sketch",
                   projection_dimension=dp, seed=seed)

        def literal_order(v):  # its blocks by Gray-code index, first hyperplane most significant
            blocks = np.asarray(v).reshape(reps, 2 ** k, dp)
            out = np.zeros_like(blocks)
            for p in range(2 ** k):
                bits = p ^ (p >> 1)  # the reference's GrayCodeToBinary
                out[:, sum(((bits >> (k - 1 - i)) & 1) << i for i in range(k))] = blocks[:, p]
            return out.ravel()

        return (lambda x: literal_order(m.encode_queries(x)), lambda x: literal_order(m.encode_documents(x)),
                [simhash_matrix_from_seed(dim, k, seed + r).T for r in range(reps)],
                [ams_projection_matrix_from_seed(dim, dp, seed + r).T * np.sqrt(dp) for r in range(reps)])

    mp = Muvera(num_repetitions=CFG["reps"], num_simhash_projections=CFG["k_sim"], dimension=384,
                projection_type="ams_sketch", projection_dimension=CFG["dim_proj"], seed=CFG["seed"])
    out["muvera-python"] = {**definition_check(muvera_make),
                            **measure(mp.encode_documents, mp.encode_queries, docs, queries)}
    return out


def ensure_venv(venv: Path) -> dict:
    """Create the libraries' venv if needed; record what installs."""
    notes = {}
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "fastembed", "muvera-python", "scipy"], check=True)
    r = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--dry-run", "muvera-fde"],
                       capture_output=True, text=True)
    if r.returncode == 0:
        r = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "muvera-fde"], capture_output=True,
                           text=True, timeout=600)
    lines = [ln.strip() for ln in (r.stdout + r.stderr).splitlines() if "fatal:" in ln or "ERROR" in ln]
    notes["muvera-fde"] = {"installs": r.returncode == 0, "error": lines[:3]}
    return notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=HERE / ".venv-fdelibs")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker()))
        return
    from embedpool.poolers.fde import FDE

    docs, queries = cached_sets()
    ours = FDE(384, CFG["k_sim"], CFG["dim_proj"], CFG["reps"], CFG["seed"])

    def ours_make(dim, k, dp, reps, seed):
        f = FDE(dim, k, dp, reps, seed)
        return (lambda x: f.encode([x.astype(np.float32)], "query")[0], lambda x: f.encode([x.astype(np.float32)], "document")[0],
                [f.hyperplanes[:, r * k:(r + 1) * k].T for r in range(reps)],
                [f.projections[r].T * np.sqrt(dp) for r in range(reps)])

    res = {"config": CFG, "loadavg_1m": round(os.getloadavg()[0], 2),
           "embedpool poolers/fde.py": {**definition_check(ours_make),
                                        **measure(lambda ds: ours.encode(ds, "document"),
                                                  lambda qs: ours.encode(qs, "query"), docs, queries)}}
    res["install"] = ensure_venv(args.venv)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    w = subprocess.run([str(args.venv / "bin" / "python"), __file__, "--worker"], capture_output=True, text=True, env=env)
    if w.returncode != 0:
        raise SystemExit(w.stderr)
    res.update(json.loads(w.stdout.strip().splitlines()[-1]))
    (HERE / "results" / "fde_libraries.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"k_sim {CFG['k_sim']}, dim_proj {CFG['dim_proj']}, reps {CFG['reps']}; 512 SciFact documents, one "
          f"thread; load average {res['loadavg_1m']}\n")
    print("| implementation | valid FDEs (of 400 random cases) | docs/s | Spearman with MaxSim per query |")
    print("|---|---:|---:|---:|")
    for name in ("embedpool poolers/fde.py", "fastembed.postprocess.Muvera", "muvera-python"):
        r = res[name]
        print(f"| {name} | {r['valid']} | {r['docs_per_s']} | {r['spearman_per_query']} |")
    m = res["install"]["muvera-fde"]
    print(f"| muvera-fde | {'installs' if m['installs'] else 'does not install: ' + '; '.join(m['error'][:1])} | | |")
    print("\nwrote bench/results/fde_libraries.json")


if __name__ == "__main__":
    main()
