"""Benchmark only: the Milvus multi-vector layout 1 -- one row per token vector, the layout of
embedpool before issue 13 -- rebuilt with pymilvus directly, so ``bench/index.py --backend
milvus`` can time ``two_stage`` in the old layout next to the new one in the same run. The
runtime refuses layout-1 collections (``index/milvus/collection.py``: ``check_layout``).

The read path is the old one, that of the removed ``MilvusCollection._fetch_tokens``: the
candidates' row 0 by primary key (``<doc id>#0``, for ``n``), then every ``<doc id>#<pos>`` row
by primary key, 4,096 keys a query, then exact MaxSim in embedpool.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pymilvus import DataType, MilvusClient

from embedpool.index import maxsim_scores
from embedpool.index.milvus import milvus_index

NAME = "embedpool_bench_layout1"


@dataclass
class Hit:
    id: str
    score: float


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


class Layout1:
    """A layout-1 multi-vector collection (float32 token rows) in Milvus at ``uri``."""

    def __init__(self, uri: str, token: str | None, dim: int, token_factory: str = "HNSW32") -> None:
        self.client = MilvusClient(uri=uri, token=token or "")
        if self.client.has_collection(NAME):
            self.client.drop_collection(NAME)
        sch = self.client.create_schema(auto_id=False, enable_dynamic_field=False)
        sch.add_field("pk", DataType.VARCHAR, is_primary=True, max_length=524)
        sch.add_field("doc_id", DataType.VARCHAR, max_length=512)
        sch.add_field("pos", DataType.INT32)
        sch.add_field("n", DataType.INT32)
        sch.add_field("vector", DataType.FLOAT_VECTOR, dim=dim)
        itype, params, _ = milvus_index(token_factory)
        ip = self.client.prepare_index_params()
        ip.add_index(field_name="vector", index_type=itype, metric_type="IP",
                     params={**params, "params": params} if params else {})
        ip.add_index(field_name="doc_id", index_type="INVERTED")
        self.client.create_collection(NAME, schema=sch, index_params=ip, consistency_level="Strong")
        self.dim = dim
        self.vectors = 0

    def add(self, ids: list[str], docs: list[np.ndarray]) -> None:
        rows = [{"pk": f"{i}#{p}", "doc_id": i, "pos": p, "n": len(d), "vector": v}
                for i, d in zip(ids, docs) for p, v in enumerate(np.asarray(d, np.float32))]
        step = (8 << 20) // (4 * self.dim + 64)
        for s in range(0, len(rows), step):
            self.client.upsert(NAME, rows[s:s + step])
        self.vectors += len(rows)

    def commit(self) -> None:
        self.client.flush(NAME)

    def _get(self, pks: list[str], fields: list[str]) -> list[dict]:
        out: list[dict] = []
        for s in range(0, len(pks), 4096):
            flt = f"pk in [{', '.join(map(_quote, pks[s:s + 4096]))}]"
            out.extend(r for r in self.client.query(NAME, filter=flt, output_fields=fields))
        return out

    def rerank(self, qs: list[np.ndarray], cands: list[list[str]], k: int) -> list[list[Hit]]:
        union = sorted({c for lst in cands for c in lst})
        heads = self._get([f"{d}#0" for d in union], ["doc_id", "n"])
        rows = self._get([f"{h['doc_id']}#{p}" for h in heads for p in range(h["n"])], ["doc_id", "pos", "vector"])
        rows.sort(key=lambda r: (r["doc_id"], r["pos"]))
        names = [r["doc_id"] for r in rows]
        vectors = np.asarray([r["vector"] for r in rows], dtype=np.float32)
        starts = [0] + [j for j in range(1, len(names)) if names[j] != names[j - 1]]
        offsets = np.array(starts + [len(names)], dtype=np.int64)
        doc_ids = [names[j] for j in starts]
        where = {d: j for j, d in enumerate(doc_ids)}
        out = []
        for q, lst in zip(qs, cands):
            idx = np.array([where[c] for c in dict.fromkeys(lst) if c in where], dtype=np.int64)
            s = maxsim_scores([q], vectors, offsets, doc_idx=idx)[0]
            order = np.argsort(-s, kind="stable")[:k]
            out.append([Hit(doc_ids[idx[j]], float(s[j])) for j in order])
        return out

    def two_stage(self, qs: list[np.ndarray], companion, companion_queries: np.ndarray, candidates: int,
                  k: int = 10) -> list[list[Hit]]:
        """Candidates from ``companion``, a single-vector collection of the documents' mean
        vectors (how layout 1 was measured), reranked by exact MaxSim."""
        cands = [[h.id for h in hits] for hits in companion.search(companion_queries, k=candidates)]
        return self.rerank(qs, cands, k)

    def close(self, drop: bool = True) -> None:
        if drop:
            self.client.drop_collection(NAME)
        self.client.close()
