"""GeM, generalized-mean pooling (Radenovic, Tolias and Chum, "Fine-tuning CNN Image Retrieval with
No Human Annotation", TPAMI 2018), and Group GeM (Ko, Gu and Kim, "Group Generalized Mean Pooling
for Vision Transformer", 2022: one exponent per group of channels), over a text's token states.

The paper's GeM of non-negative activations is, per channel ``c``, ``(mean_t x_tc^p)^(1/p)``:
``p = 1`` is the mean, ``p -> inf`` the max. Token states are signed, so here it applies to each
channel **shifted by the text's own minimum** ``m_c = min_t x_tc`` and shifted back:

    GeM_p(x)_c = m_c + (mean_t (x_tc - m_c)^p)^(1/p)

a power mean of non-negative values, so ``p = 1`` gives the mean and ``p -> inf`` the max whatever
the signs (the sign-preserving ``sign(y)|y|^(1/p)`` of ``mean sign(x)|x|^p`` tends to the entry of
largest magnitude instead, a negative one as often as not). It is translation-equivariant per
channel (adding a constant to every token adds it to the result) and positively homogeneous.
Between the two ends, ``max - GeM_p <= (max - min) * (1 - n^(-1/p))`` for a text of ``n`` tokens.

Computed without overflow at any ``p``: with ``s_c = max_t x_tc - m_c`` and ``r = (x - m) / s`` in
``[0, 1]``, ``GeM_p = mean(x) + s * (G_p(r) - G_1(r))`` where ``G_p(r) = (mean r^p)^(1/p)``. The
powers are written ``r^p = r * max(r, eps)^(p - 1)`` (finite gradients in ``p`` where ``r = 0``),
so at ``p = 1`` both ``G`` are the same numbers and **GeM with p=1 is** :mod:`poolers.mean`'s
vector **exactly**, not up to rounding.

**Untrained behaviour and training.** The exponent starts at ``p = 1`` (the paper initialises 3):
untrained, ``gem`` and ``ggem`` are ``mean`` exactly, and training starts there as the other heads'
does. ``p`` is kept ``>= 1`` (the family between mean and max) by a clamp whose gradient passes
straight through (:func:`poolers.generalized.clamp_through`); it is stored as
``(p - 1) / 16`` so that it moves 16 times faster under Adam than a token score (as ``mixed``'s
``a``, :data:`poolers.generalized.GAIN`). ``gem:p=X`` is the untrained
operator at a fixed ``p``. ``ggem`` learns one ``p`` per group of consecutive channels
(``groups``, 16 by default; ``train-pooler --pooler ggem --heads G`` sets ``G`` groups).

Cost: a masked min, max and two masked means, linear in the text's length. The heads save, load,
bind to their encoder and split by role as :mod:`poolers.attention`'s (``kind: gem`` / ``ggem``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from embedpool.errors import InvalidError
from embedpool.poolers.attention import AttentionPooler, HeadModule, head_class, role_heads
from embedpool.poolers.base import masked_mean, register
from embedpool.poolers.generalized import GAIN, FixedOrTrainedPooler, clamp_through, masked_max, single_output
from embedpool.poolers.states import TokenStates

EPS = 1e-6  # r below it is raised to p - 1 as EPS: r^p stays finite in value and gradient at r = 0
SPAN_FLOOR = 1e-12  # a channel constant over the text: r = 0 everywhere, GeM = mean
DEFAULT_GROUPS = 16


def power(r: Tensor, p: Tensor) -> Tensor:
    """``r^p`` for ``r >= 0``, as ``r * max(r, EPS)^(p - 1)``: ``r`` itself, exactly, at ``p = 1``."""
    return r * r.clamp(min=EPS) ** (p - 1)


def generalized_mean(hidden: Tensor, mask: Tensor, p: Tensor) -> Tensor:
    """``GeM_p`` of the tokens ``mask`` keeps, per channel, shifted by the text's minimum (see the
    module docstring): ``hidden [B,T,D]``, ``mask [B,T]``, ``p [D]`` (>= 1) -> ``[B, D]``."""
    valid = mask.bool().unsqueeze(-1)
    mean = masked_mean(hidden, mask)
    low = hidden.masked_fill(~valid, float("inf")).amin(dim=1, keepdim=True)
    span = (masked_max(hidden, mask).unsqueeze(1) - low).clamp(min=SPAN_FLOOR)
    r = ((hidden - low) / span).masked_fill(~valid, 0.0)  # [0, 1]; padding never read
    root = masked_mean(power(r, p), mask)
    root = power(root, 1 / p)
    return mean + span[:, 0] * (root - masked_mean(r, mask))


@head_class
class GeMHead(HeadModule):
    """GeM with one learned exponent ``p`` (``gem``), or one per group of channels (``ggem``).

    Args:
        dim: token state size ``D``.
        queries: must be 1.
        value_projection: ignored (no projection).
        heads: must be 1 (``ggem``: the number of groups when ``groups`` is not given and heads > 1).
        encoder: the model the head is trained on (recorded in its config).
        meta: provenance kept in the config.
        p: the starting exponent (>= 1).
    """

    kind = "gem"
    config_keys = (*HeadModule.config_keys, "kind")
    groups = 1

    def __init__(self, dim: int, queries: int = 1, value_projection: bool = False, heads: int = 1,
                 encoder: str | None = None, meta: dict[str, Any] | None = None, p: float = 1.0) -> None:
        single_output(self.kind, queries, 1 if self.kind == "ggem" else heads)
        if self.groups < 1 or dim % self.groups:
            raise InvalidError(f"{self.kind}: groups must be >= 1 and divide the state size {dim}, got {self.groups}",
                               param="pooler")
        check_exponent(self.kind, p)
        super().__init__(dim, queries, False, 1, encoder, meta)
        self.p = nn.Parameter(torch.full((self.groups,), (float(p) - 1) / GAIN))  # (p - 1) / GAIN

    def exponents(self) -> Tensor:
        """Every channel's ``p`` (>= 1), ``[D]``."""
        return clamp_through(1 + GAIN * self.p, 1.0).repeat_interleave(self.dim // self.groups)

    def forward(self, hidden: Tensor, mask: Tensor, role: str | None = None) -> Tensor:
        """``hidden [B,T,D]``, ``mask [B,T]`` -> ``[B, 1, D]``."""
        return generalized_mean(hidden, mask, self.exponents()).unsqueeze(1)


@head_class
class GGeMHead(GeMHead):
    """Group GeM: one learned exponent per group of ``dim // groups`` consecutive channels.

    Args:
        groups: channel groups (must divide ``dim``); default ``heads`` when above 1, else
            :data:`DEFAULT_GROUPS`.
        (the others as :class:`GeMHead`'s)
    """

    kind = "ggem"
    config_keys = (*HeadModule.config_keys, "groups", "kind")

    def __init__(self, dim: int, queries: int = 1, value_projection: bool = False, heads: int = 1,
                 encoder: str | None = None, meta: dict[str, Any] | None = None, p: float = 1.0,
                 groups: int | None = None) -> None:
        self.groups = int(groups if groups is not None else heads if heads > 1 else DEFAULT_GROUPS)
        super().__init__(dim, queries, value_projection, heads, encoder, meta, p)


GeMRoleHeads = role_heads(GeMHead)
GGeMRoleHeads = role_heads(GGeMHead)


def check_exponent(name: str, p: float) -> None:
    if not (math.isfinite(p) and p >= 1.0):
        raise InvalidError(f"{name}: p must be a finite number >= 1 (1: mean; larger: toward max), got {p}",
                           param="pooler")


@register
class GeMPooler(FixedOrTrainedPooler):
    """Generalized-mean pooling, shifted by each text's minimum per channel (1: mean, large: max).

    Args:
        weights: folder (or file) of a trained ``gem`` head; empty for the untrained operator.
        p: the exponent without weights (1: ``mean``, the default).
    """

    name = "gem"
    options = {"weights": str, "p": float}
    p = 1.0
    fixed, head_type = "p", GeMHead

    def check(self, value: float) -> None:
        check_exponent(self.name, value)


@register
class GGeMPooler(AttentionPooler):
    """Group GeM: one exponent per group of channels.

    Args:
        weights: folder (or file) of a trained ``ggem`` head; empty for the untrained head (= ``mean``).
    """

    name = "ggem"
    options = {"weights": str}

    def new_head(self, states: TokenStates) -> GGeMHead:
        dim = states.hidden.shape[-1]
        return GGeMHead(dim, groups=DEFAULT_GROUPS if dim % DEFAULT_GROUPS == 0 else 1)
