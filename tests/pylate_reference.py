"""PyLate's side of the ColBERT parity tests and of ``bench/families.py``, run by PyLate's own venv
(``.venv-pylate``: PyLate pins sentence-transformers < 6, embedpool needs >= 6, so the two cannot
share one environment). It imports nothing of embedpool.

``python pylate_reference.py JOB.json``: wraps the tiny BERT folder ``base`` as a PyLate
``ColBERT`` (``embedding_size``, ``query_length``, ``document_length``), saves it to ``out`` with
PyLate's ``save``, loads it back from there (as a user would), and writes to ``result`` (npz) each
query's and document's ``encode(is_query=...)`` token embeddings and, per pool factor, PyLate's
``pool_embeddings_hierarchical`` of the documents' embeddings. With ``"bench": N`` it also times
``encode`` of the documents N times (texts/s in ``meta``).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch


def main(job_file: str) -> None:
    job = json.loads(open(job_file).read())
    import pylate
    from pylate import models

    torch.manual_seed(job["seed"])
    model = models.ColBERT(model_name_or_path=job["base"], device="cpu", embedding_size=job["embedding_size"],
                           query_length=job["query_length"], document_length=job["document_length"])
    model.save(job["out"])
    model = models.ColBERT(model_name_or_path=job["out"], device="cpu")
    texts = job["texts"]
    out = {}
    q = model.encode(texts["queries"], is_query=True, batch_size=8, show_progress_bar=False)
    d = model.encode(texts["documents"], is_query=False, batch_size=8, show_progress_bar=False)
    for i, v in enumerate(q):
        out[f"queries_{i}"] = np.asarray(v, np.float32)
    for i, v in enumerate(d):
        out[f"documents_{i}"] = np.asarray(v, np.float32)
    for pf in job["pool_factors"]:
        pooled = model.pool_embeddings_hierarchical([torch.from_numpy(np.asarray(v)) for v in d], pool_factor=pf,
                                                    protected_tokens=1)
        for i, v in enumerate(pooled):
            out[f"pooled{pf}_{i}"] = v.numpy().astype(np.float32)
    seconds = None
    if job.get("bench"):
        torch.set_num_threads(job.get("threads", torch.get_num_threads()))
        docs = texts["bench"]
        model.encode(docs[:8], is_query=False, batch_size=32, show_progress_bar=False)  # warm up
        best = float("inf")
        for _ in range(job["bench"]):
            t0 = time.perf_counter()
            model.encode(docs, is_query=False, batch_size=32, show_progress_bar=False)
            best = min(best, time.perf_counter() - t0)
        seconds = best
    out["meta"] = np.array(json.dumps({"pylate": pylate.__version__, "seconds": seconds}))
    np.savez(job["result"], **out)


if __name__ == "__main__":
    main(sys.argv[1])
