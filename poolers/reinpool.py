"""ReinPool-style learned selection: a policy keeps some of a document's token vectors and the kept
ones are averaged into one vector (after Cha et al., "ReinPool: Reinforcement Learning Pooling
Multi-Vector Embeddings for Retrieval System", 2026).

The vectors are the ``tokens`` pooler's: every token state L2-normalized, ``v_1..v_N``. The
policy ``pi_theta`` is a small transformer layer over them (multi-head self-attention with a
residual connection and layer norm) and a linear classification head, giving each vector a keep
probability ``p_t = sigmoid(l_t)``; the action is ``a_t ~ Bernoulli(p_t)`` and the document's
vector is the mean of the kept ones, ``v_pool = mean{v_t : a_t = 1}`` (the paper's "standard
pooling function" over ``V_keep``).

**Training: REINFORCE with an nDCG reward, as the paper does** (:func:`reinforce_loss`), not a
relaxation. The reward of one sampled selection is the nDCG@10 of the paper's inverse retrieval:
the document's pooled vector ranks the training queries, and the queries linked to it are the
relevant ones. The reward is a rank metric of a discrete choice, with no gradient to relax
toward; REINFORCE needs only the reward's value, and with the candidate queries embedded once
per epoch a sample costs one ``[D] x [D, Q]`` product, so several samples per document are cheap
(their mean reward, leaving the sample itself out, is the baseline that keeps the estimator's
variance down). A Gumbel-sigmoid relaxation would have to replace nDCG by a differentiable
surrogate (InfoNCE), i.e. train another objective than the one the paper names.

**At inference** the policy's mode is taken: keep ``v_t`` when ``p_t >= 0.5`` (``l_t >= 0``); a
document whose policy keeps nothing keeps its highest-scoring vector. A **query** is the mean of
all its vectors: against one document vector, ColBERT's MaxSim ``sum_i max_j q_i . d_j`` is
``sum_i q_i . v_pool``, the mean query vector's product up to the query's length, so the
ranking of a query's documents is exactly MaxSim's with the query left whole.

**Untrained** (no weights, or a new head) the classification head is zero, every ``l_t = 0``, every
vector is kept: ``reinpool`` is the mean of the ``tokens`` vectors, the issue's "mean of the same
vectors" baseline (not ``mean``, which averages the states before normalizing them).

The head saves, loads and binds like :mod:`poolers.attention`'s (``kind: reinpool``);
``embedpool train-pooler --pooler reinpool`` trains it with the objectives' data and dev
selection of the other heads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from embedpool.errors import InvalidError
from embedpool.poolers.attention import AttentionPooler, HeadModule, head_class, role_heads
from embedpool.poolers.base import masked_mean, register
from embedpool.poolers.states import TokenStates


@head_class
class ReinPoolHead(HeadModule):
    """The selection policy and the mean of the kept token vectors.

    Args:
        dim: token state size ``D``.
        queries: must be 1.
        value_projection: must be false (the pooled vector is a mean of the token vectors).
        heads: attention heads of the policy's self-attention (must divide ``dim``).
        encoder: the model the head is trained on (recorded in its config).
        meta: provenance kept in the config.
    """

    kind = "reinpool"
    config_keys = (*HeadModule.config_keys, "kind")

    def __init__(self, dim: int, queries: int = 1, value_projection: bool = False, heads: int = 4,
                 encoder: str | None = None, meta: dict[str, Any] | None = None) -> None:
        if queries != 1:
            raise InvalidError(f"reinpool gives one vector per text: queries must be 1, got {queries}", param="pooler")
        if heads < 1 or dim % heads:
            raise InvalidError(f"reinpool heads must be >= 1 and divide the state size {dim}, got {heads}",
                               param="pooler")
        super().__init__(dim, queries, False, heads, encoder, meta)
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.keep = nn.Linear(dim, 1)  # the classification head: zero, every vector kept
        nn.init.zeros_(self.keep.weight)
        nn.init.zeros_(self.keep.bias)

    @staticmethod
    def vectors(hidden: Tensor) -> Tensor:
        """The ``tokens`` pooler's vectors: each token state L2-normalized."""
        return F.normalize(hidden, dim=-1)

    def logits(self, vectors: Tensor, mask: Tensor) -> Tensor:
        """The keep logits ``l_t`` ``[B, T]`` (``-inf`` on padding)."""
        pad = ~mask.bool()
        ctx, _ = self.attention(vectors, vectors, vectors, key_padding_mask=pad, need_weights=False)
        return self.keep(self.norm(vectors + ctx)).squeeze(-1).masked_fill(pad, float("-inf"))

    def select(self, logits: Tensor) -> Tensor:
        """The policy's mode ``[B, T]`` (1.0 = kept): ``l_t >= 0``, and a text's best vector when
        nothing else is kept."""
        kept = (logits >= 0).float()
        best = F.one_hot(logits.argmax(dim=1), logits.shape[1]).float()
        return torch.where(kept.sum(dim=1, keepdim=True) > 0, kept, best)

    def forward(self, hidden: Tensor, mask: Tensor, role: str | None = "document") -> Tensor:
        """``hidden [B,T,D]``, ``mask [B,T]`` -> ``[B, 1, D]``: a document's kept vectors' mean;
        a query's (``role="query"``) mean of all its vectors."""
        v = self.vectors(hidden)
        if role == "query":
            return masked_mean(v, mask).unsqueeze(1)
        return masked_mean(v, self.select(self.logits(v, mask))).unsqueeze(1)


ReinPoolRoleHeads = role_heads(ReinPoolHead)


def ndcg_at_10(scores: Tensor, relevant: Tensor) -> Tensor:
    """nDCG@10 (binary gains) of each row of ``scores [S, Q]`` ranking ``Q`` candidates, of
    which ``relevant [Q]`` (bool) are relevant; ``[S]``."""
    k = min(10, scores.shape[1])
    top = scores.topk(k, dim=1).indices  # [S, k]
    discount = 1.0 / torch.log2(torch.arange(2, k + 2, dtype=scores.dtype))
    dcg = (relevant[top].to(scores.dtype) * discount).sum(dim=1)
    ideal = discount[: min(int(relevant.sum()), k)].sum()
    return dcg / ideal.clamp(min=1e-12)


def reinforce_loss(head: ReinPoolHead, hidden: Tensor, mask: Tensor, candidates: Tensor, relevant: Tensor,
                   samples: int = 8, anchor: float = 0.0, generator: torch.Generator | None = None) -> Tensor:
    """REINFORCE on a batch of documents (the module docstring).

    Args:
        hidden, mask: the documents' token states ``[B, T, D]`` and mask ``[B, T]``.
        candidates: the queries the pooled document ranks (inverse retrieval), L2-normalized ``[Q, D]``.
        relevant: ``[B, Q]`` bool, the queries relevant to each document.
        samples: selections drawn per document; each one's baseline is the mean reward of the others.
        anchor: subtracts ``anchor * (1 - cos(v_pool, mean of all vectors))`` from the reward (the
            ``--anchor`` pull toward the untrained pooler).
    Returns:
        ``-mean((R - b) * log pi(a))``, whose gradient is the policy gradient.
    """
    if samples < 2:
        raise InvalidError(f"reinpool needs at least 2 samples per document for its baseline, got {samples}")
    v = head.vectors(hidden)
    logits = head.logits(v, mask)  # [B,T]
    valid = mask.bool()
    p = torch.sigmoid(logits.masked_fill(~valid, 0.0))
    draws = torch.rand((samples, *p.shape), generator=generator) < p.detach()  # [S,B,T]
    actions = (draws & valid).float()
    empty = actions.sum(dim=2, keepdim=True) == 0  # keep the best vector of a sample that kept none
    actions = torch.where(empty, F.one_hot(logits.argmax(dim=1), p.shape[1]).float().expand_as(actions), actions)
    with torch.no_grad():
        w = actions.unsqueeze(-1)
        pooled = F.normalize((v.unsqueeze(0) * w).sum(2) / w.sum(2).clamp(min=1e-9), dim=-1)  # [S,B,D]
        reward = torch.stack([ndcg_at_10(pooled[:, b] @ candidates.T, relevant[b]) for b in range(v.shape[0])], 1)
        if anchor:
            whole = F.normalize(masked_mean(v, mask), dim=-1)
            reward = reward - anchor * (1 - (pooled * whole.unsqueeze(0)).sum(-1))
        baseline = (reward.sum(0, keepdim=True) - reward) / (samples - 1)
        advantage = reward - baseline  # [S,B]
    log_pi = -F.binary_cross_entropy_with_logits(logits.masked_fill(~valid, 0.0).expand_as(actions), actions,
                                                 reduction="none")
    log_pi = (log_pi * valid).sum(dim=2)  # [S,B]
    return -(advantage * log_pi).mean()


@register
class ReinPoolPooler(AttentionPooler):
    """ReinPool-style selection: a learned policy keeps some token vectors of a document and
    averages them into one vector; a query is the mean of its token vectors.

    Args:
        weights: folder (or file) of a trained ``reinpool`` head; empty for the untrained head
            (every vector kept: the mean of the ``tokens`` vectors).
    """

    name = "reinpool"
    options = {"weights": str}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # a trained policy pools documents by selection and queries as means; untrained, both are means
        self.role_aware = bool(self.weights)

    def new_head(self, states: TokenStates) -> ReinPoolHead:
        return ReinPoolHead(states.hidden.shape[-1])
