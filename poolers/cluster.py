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

from poolers.base import Pooler, register
from poolers.states import TokenStates
from poolers.tokens import normalized_tokens


def cluster_tokens(tokens: Tensor, pool_factor: float, protected: int = 1) -> Tensor:
    """Pool one text's normalized tokens ``[n, D]`` into ``[m, D]`` (protected first, then
    cluster means in order of first appearance of the cluster label as fcluster numbers it)."""
    keep, rest = tokens[:protected], tokens[protected:]
    n = rest.shape[0]
    k = max(int(n // pool_factor), 1)
    if k >= n:
        return tokens
    # Same arithmetic as the reference: float32 cosine distance, clamped, condensed.
    dist = (1 - torch.mm(rest, rest.t())).clamp_(0, 2).numpy()
    labels = fcluster(linkage(squareform(dist, checks=False), method="ward"), t=k, criterion="maxclust")
    uniq, inverse = np.unique(labels, return_inverse=True)
    onehot = np.zeros((len(uniq), n), dtype=np.float32)
    onehot[inverse, np.arange(n)] = 1.0
    means = torch.from_numpy(onehot) @ rest / torch.from_numpy(onehot.sum(1, keepdims=True))
    return torch.cat([keep, means])


@register
class ClusterPooler(Pooler):
    """Hierarchical (Ward) token clustering.

    Args:
        pool_factor: keep about ``1 / pool_factor`` of the tokens (default 2).
        protected: leading tokens kept out of clustering (default 1, the ``[CLS]``).
    """

    name = "cluster"
    options = {"pool_factor": float, "protected": int}
    multi_vector = True
    pool_factor = 2.0
    protected = 1

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if self.pool_factor < 1:
            raise ValueError(f"cluster pool_factor must be >= 1, got {self.pool_factor}")
        if self.protected < 0:
            raise ValueError(f"cluster protected must be >= 0, got {self.protected}")

    def pool(self, states: TokenStates) -> list[Tensor]:
        return [cluster_tokens(t, self.pool_factor, self.protected) for t in normalized_tokens(states)]
