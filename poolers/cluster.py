"""Token clustering (Clavié et al. 2024, arXiv 2409.14683): a multi-vector pooler that merges
similar tokens, reproducing sentence-transformers' ``HierarchicalTokenPooling``.

For each text: L2-normalize its token states; keep the first ``protected`` tokens as they are;
Ward-link the rest on cosine distance, cut the tree into ``max(n // pool_factor, 1)`` clusters
and replace each cluster by the plain mean of its (normalized) tokens.

A text longer than the model's window (``window=true``) is clustered window by window, each
window (a ``[CLS] … [SEP]`` sequence of at most the model's window) exactly as a text of its
own, and the windows' vectors are concatenated in order. Ward linkage needs the ``n × n``
distance matrix of what it clusters and ``O(n²)`` time, so clustering a whole 37k-token text at
once took 20 GB; per window, cost and memory are linear in the text's length. A window of
``n`` tokens gives ``protected + max((n - protected) // pool_factor, 1)`` vectors.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.spatial.distance import squareform
from torch import Tensor

from embedpool.errors import InvalidError
from embedpool.poolers.base import register
from embedpool.poolers.states import TokenStates
from embedpool.poolers.tokens import TokenVectorPooler, normalized_tokens


def n_clusters(n: int, pool_factor: float, protected: int = 1) -> int:
    """Vectors :func:`cluster_tokens` makes of ``n`` tokens: all of them when there are too few
    to merge, else the protected ones plus ``max((n - protected) // pool_factor, 1)`` clusters."""
    rest = max(n - protected, 0)
    k = max(int(rest // pool_factor), 1)
    return n if k >= rest else protected + k


def cluster_tokens(tokens: Tensor, pool_factor: float, protected: int = 1) -> Tensor:
    """Pool one sequence's normalized tokens ``[n, D]`` into ``[m, D]`` (protected first, then
    cluster means in order of first appearance of the cluster label as fcluster numbers it)."""
    rest = tokens[protected:]
    if n_clusters(tokens.shape[0], pool_factor, protected) == tokens.shape[0]:
        return tokens
    # Same arithmetic as the reference: float32 cosine distance, clamped, condensed.
    dist = (1 - torch.mm(rest, rest.t())).clamp_(0, 2).numpy()
    return torch.from_numpy(_cluster_from_distances(tokens.numpy(), dist, pool_factor, protected))


def _cluster_from_distances(tokens: np.ndarray, dist: np.ndarray, pool_factor: float, protected: int) -> np.ndarray:
    """Ward-cluster ``tokens[protected:]`` given their ``[n, n]`` cosine distances (numpy only:
    no torch op per text, whose thread-pool dispatch dominates on small matrices)."""
    keep, rest = tokens[:protected], tokens[protected:]
    if n_clusters(tokens.shape[0], pool_factor, protected) == tokens.shape[0]:
        return tokens
    k = max(int(rest.shape[0] // pool_factor), 1)
    condensed = squareform(np.ascontiguousarray(dist), checks=False)
    labels = fcluster(linkage(condensed, method="ward"), t=k, criterion="maxclust")
    uniq, inverse = np.unique(labels, return_inverse=True)
    inverse = inverse.reshape(-1)
    perm = np.argsort(inverse, kind="stable")
    counts = np.bincount(inverse, minlength=len(uniq))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    means = np.add.reduceat(rest[perm], starts, axis=0) / counts.astype(np.float32)[:, None]
    return np.concatenate([keep, means.astype(np.float32, copy=False)])


def cluster_batch(states: TokenStates, pool_factor: float, protected: int = 1) -> list[Tensor]:
    """:func:`cluster_tokens` for every row (window) of a batch, each text's rows concatenated
    in order. Token normalization and distance matrices come from three batched torch ops
    instead of several per row; the distances take ``R × T²`` floats, i.e. the batch's token
    budget times the window, whatever the length of its texts.

    Rows whose tokens are not a prefix of the row take the per-row path.
    """
    mask = states.vector_mask.bool()
    lengths = mask.sum(1)
    normed = torch.nn.functional.normalize(states.hidden.float(), dim=-1)
    contiguous = bool((mask == (torch.arange(mask.shape[1])[None, :] < lengths[:, None])).all())
    if not contiguous:
        return states.rows_by_text([cluster_tokens(normed[r][mask[r]], pool_factor, protected)
                                    for r in range(normed.shape[0])])
    rest = normed[:, protected:]
    dist = torch.bmm(rest, rest.transpose(1, 2)).neg_().add_(1).clamp_(0, 2).numpy()
    normed_np = normed.numpy()
    per_row = []
    for r, n in enumerate(lengths.tolist()):
        m = max(n - protected, 0)
        pooled = _cluster_from_distances(normed_np[r, :n], dist[r, :m, :m], pool_factor, protected)
        per_row.append(torch.from_numpy(np.ascontiguousarray(pooled)))
    return states.rows_by_text(per_row)


@register
class ClusterPooler(TokenVectorPooler):
    """Hierarchical (Ward) token clustering.

    Args:
        pool_factor: keep about ``1 / pool_factor`` of the tokens (default 2).
        protected: leading tokens kept out of clustering (default 1, the ``[CLS]``).
        pool_queries: also cluster query tokens (default false: as in PyLate and the paper,
            only documents are pooled and a query keeps all its token vectors).
        window: keep every window of a long input, each clustered on its own (default:
            truncate at the model's window). Each window keeps its own protected ``[CLS]``.
    """

    name = "cluster"
    options = {"pool_factor": float, "protected": int, "pool_queries": bool, "window": bool}
    pool_factor = 2.0
    protected = 1
    pool_queries = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if self.pool_factor < 1:
            raise InvalidError(f"cluster pool_factor must be >= 1, got {self.pool_factor}", param="pooler")
        if self.protected < 0:
            raise InvalidError(f"cluster protected must be >= 0, got {self.protected}", param="pooler")
        self.role_aware = not self.pool_queries  # queries keep every token

    def pool(self, states: TokenStates) -> list[Tensor]:
        return cluster_batch(states, self.pool_factor, self.protected)

    def pool_role(self, states: TokenStates, role: str) -> list[Tensor]:
        if role == "query" and not self.pool_queries:
            return normalized_tokens(states)
        return self.pool(states)

    def n_vectors(self, rows: list[int], role: str) -> int:
        if role == "query" and not self.pool_queries:
            return sum(rows)
        return sum(n_clusters(n, self.pool_factor, self.protected) for n in rows)
