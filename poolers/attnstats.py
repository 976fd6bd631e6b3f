"""Attentive statistics pooling (Okabe, Koshinaka and Shinoda, "Attentive Statistics Pooling for
Deep Speaker Embedding", Interspeech 2018), on a frozen encoder's last-layer token states.

Each token state ``h_t`` gets a scalar score ``e_t = v^T tanh(W h_t + b) + k`` (the paper's
eq. 1 with ``f = tanh``), the weights are ``alpha_t = softmax_t(e_t)`` over the text's tokens
(eq. 2), and the pooled statistics are the weighted mean and the weighted standard deviation

    mu = sum_t alpha_t h_t                                       (eq. 3)
    sigma = sqrt(sum_t alpha_t h_t * h_t - mu * mu)              (eq. 4, element-wise)

concatenated, ``[mu ; sigma]`` (``2D``). In the paper that vector feeds the segment-level layers
of the speaker network; here one linear layer (``value_projection``, the default) maps it back to
the model's ``D`` so that a collection keeps the model's dimension, and that layer starts as
``[I | 0]``: it selects ``mu``. With the score vector ``v`` and ``k`` at zero (initialisation,
or no weights) every token weighs the same, ``mu`` is :class:`poolers.mean.MeanPooler`'s vector
(the same :func:`poolers.base.masked_mean`), so **untrained, ``attnstats`` is ``mean``**; training
learns where to look (``alpha``) and how much of the spread (``sigma``) to use. Without the
projection (``--no-value-projection``) the head gives ``[mu ; sigma]`` itself (``2D`` values).

``sigma`` takes the square root of the variance clamped at ``1e-6`` (padding tokens have weight
0; a one-token text has variance 0), so its gradient stays finite.

The head saves, loads, binds to its encoder and splits by role as :mod:`poolers.attention`'s
(``head.json`` + ``head.safetensors``, ``kind: attnstats``); ``embedpool train-pooler --pooler
attnstats`` trains it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from embedpool.errors import InvalidError
from embedpool.poolers.attention import AttentionPooler, HeadModule, head_class, role_heads
from embedpool.poolers.base import masked_mean, register
from embedpool.poolers.states import TokenStates

VARIANCE_FLOOR = 1e-6


@head_class
class AttnStatsHead(HeadModule):
    """Attention weights, then the weighted mean and standard deviation of the token states.

    Args:
        dim: token state size ``D``.
        queries: must be 1 (one attention distribution per text).
        value_projection: map ``[mu ; sigma]`` to ``D`` values (initialised to select ``mu``);
            without it the head gives the ``2D`` statistics.
        heads: must be 1.
        hidden: size of the attention's hidden layer (``W`` is ``hidden x D``).
        encoder: the model the head is trained on (recorded in its config).
        meta: provenance kept in the config.
    """

    kind = "attnstats"
    config_keys = (*HeadModule.config_keys, "hidden", "kind")

    def __init__(self, dim: int, queries: int = 1, value_projection: bool = True, heads: int = 1,
                 encoder: str | None = None, meta: dict[str, Any] | None = None, hidden: int = 128) -> None:
        if queries != 1 or heads != 1:
            raise InvalidError(f"attnstats gives one vector per text with one attention: queries and heads must "
                               f"be 1, got {queries} and {heads}", param="pooler")
        if hidden < 1:
            raise InvalidError(f"attnstats hidden must be >= 1, got {hidden}", param="pooler")
        super().__init__(dim, queries, value_projection, heads, encoder, meta)
        self.hidden = hidden
        self.attention = nn.Linear(dim, hidden)  # W, b
        self.score = nn.Linear(hidden, 1)  # v, k: zero, so every token weighs the same
        nn.init.zeros_(self.score.weight)
        nn.init.zeros_(self.score.bias)
        self.value = None
        if value_projection:
            self.value = nn.Linear(2 * dim, dim)
            with torch.no_grad():
                self.value.weight.copy_(torch.eye(dim, 2 * dim))  # [I | 0]: mu
                self.value.bias.zero_()

    def weights(self, hidden: Tensor, mask: Tensor) -> Tensor:
        """``exp(e_t - max_t e)`` on the text's tokens, 0 on padding, ``[B, T]``: the softmax's
        numerator (:func:`poolers.base.masked_mean` divides by the sum), exactly 1.0 everywhere
        for constant scores."""
        scores = self.score(torch.tanh(self.attention(hidden))).squeeze(-1)
        scores = scores.masked_fill(~mask.bool(), float("-inf"))
        return torch.exp(scores - scores.amax(dim=1, keepdim=True)).nan_to_num(0.0)

    def statistics(self, hidden: Tensor, mask: Tensor) -> Tensor:
        """``[mu ; sigma]``, ``[B, 2D]``."""
        w = self.weights(hidden, mask)
        mu = masked_mean(hidden, w)
        second = masked_mean(hidden * hidden, w)
        sigma = torch.sqrt(torch.clamp(second - mu * mu, min=VARIANCE_FLOOR))
        return torch.cat([mu, sigma], dim=-1)

    def forward(self, hidden: Tensor, mask: Tensor, role: str | None = None) -> Tensor:
        """``hidden [B,T,D]``, ``mask [B,T]`` -> ``[B, 1, D]`` (``[B, 1, 2D]`` without the projection)."""
        stats = self.statistics(hidden, mask)
        return (stats if self.value is None else self.value(stats)).unsqueeze(1)


AttnStatsRoleHeads = role_heads(AttnStatsHead)


@register
class AttnStatsPooler(AttentionPooler):
    """Attentive statistics pooling (weighted mean and standard deviation of the token states).

    Args:
        weights: folder (or file) of a trained ``attnstats`` head; empty for the untrained head
            (= ``mean``).
    """

    name = "attnstats"
    options = {"weights": str}

    def new_head(self, states: TokenStates) -> AttnStatsHead:
        return AttnStatsHead(states.hidden.shape[-1])

    def output_dim(self, model_dim: int) -> int | None:
        return None if self.head is None or self.head.value_projection else 2 * model_dim
