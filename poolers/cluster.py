"""Token clustering (Clavié et al. 2024, arXiv 2409.14683): a multi-vector pooler that merges
similar tokens, reproducing sentence-transformers' ``HierarchicalTokenPooling``.

For each text: L2-normalize its token states; keep the first ``protected`` tokens as they are;
Ward-link the rest on cosine distance, cut the tree into ``max(n // pool_factor, 1)`` clusters
and replace each cluster by the plain mean of its (normalized) tokens.
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


def cluster_tokens(tokens: Tensor, pool_factor: float, protected: int = 1) -> Tensor:
    """Pool one text's normalized tokens ``[n, D]`` into ``[m, D]`` (protected first, then
    cluster means in order of first appearance of the cluster label as fcluster numbers it)."""
    rest = tokens[protected:]
    if max(int(rest.shape[0] // pool_factor), 1) >= rest.shape[0]:
        return tokens
    # Same arithmetic as the reference: float32 cosine distance, clamped, condensed.
    dist = (1 - torch.mm(rest, rest.t())).clamp_(0, 2).numpy()
    return torch.from_numpy(_cluster_from_distances(tokens.numpy(), dist, pool_factor, protected))


def _cluster_from_distances(tokens: np.ndarray, dist: np.ndarray, pool_factor: float, protected: int) -> np.ndarray:
    """Ward-cluster ``tokens[protected:]`` given their ``[n, n]`` cosine distances (numpy only:
    no torch op per text, whose thread-pool dispatch dominates on small matrices)."""
    keep, rest = tokens[:protected], tokens[protected:]
    n = rest.shape[0]
    k = max(int(n // pool_factor), 1)
    if k >= n:
        return tokens
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
    """:func:`cluster_tokens` for every text of a batch, with the batch's token normalization
    and distance matrices computed in three batched torch ops instead of several per text.

    Falls back to the per-text path when a text spans several rows (landmark windows) or its
    tokens are not a prefix of its row.
    """
    mask = states.attention_mask.bool()
    lengths = mask.sum(1)
    contiguous = bool((mask == (torch.arange(mask.shape[1])[None, :] < lengths[:, None])).all())
    if not states.one_row_per_text or not contiguous:
        return [cluster_tokens(t, pool_factor, protected) for t in normalized_tokens(states)]
    order = states.text_index.tolist()
    normed = torch.nn.functional.normalize(states.hidden.float(), dim=-1)
    rest = normed[:, protected:]
    dist = torch.bmm(rest, rest.transpose(1, 2)).neg_().add_(1).clamp_(0, 2).numpy()
    normed_np = normed.numpy()
    out: list[Tensor | None] = [None] * states.n_texts
    for r, n in enumerate(lengths.tolist()):
        m = max(n - protected, 0)
        pooled = _cluster_from_distances(normed_np[r, :n], dist[r, :m, :m], pool_factor, protected)
        out[order[r]] = torch.from_numpy(np.ascontiguousarray(pooled))
    return out


@register
class ClusterPooler(TokenVectorPooler):
    """Hierarchical (Ward) token clustering.

    Args:
        pool_factor: keep about ``1 / pool_factor`` of the tokens (default 2).
        protected: leading tokens kept out of clustering (default 1, the ``[CLS]``).
        pool_queries: also cluster query tokens (default false: as in PyLate and the paper,
            only documents are pooled and a query keeps all its token vectors).
        window: cluster the tokens of every window of a long input together (default:
            truncate at the model's window).
    """

    name = "cluster"
    options = {"pool_factor": float, "protected": int, "pool_queries": bool, "window": bool}
    pool_factor = 2.0
    protected = 1
    pool_queries = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if self.pool_factor < 1:
            raise InvalidError(f"cluster pool_factor must be >= 1, got {self.pool_factor}")
        if self.protected < 0:
            raise InvalidError(f"cluster protected must be >= 0, got {self.protected}")
        self.role_aware = not self.pool_queries  # queries keep every token

    def pool(self, states: TokenStates) -> list[Tensor]:
        return cluster_batch(states, self.pool_factor, self.protected)

    def pool_role(self, states: TokenStates, role: str) -> list[Tensor]:
        if role == "query" and not self.pool_queries:
            return normalized_tokens(states)
        return self.pool(states)
