"""Generalized max-average pooling (Lee, Gallagher and Tu, "Generalizing Pooling Functions in
Convolutional Neural Networks: Mixed, Gated, and Tree", AISTATS 2016), over a text's token states.

The paper mixes the two pooling functions of a region per channel,

    mixed:  f(x) = a * max(x) + (1 - a) * mean(x)                   (eq. 2; one learned a in [0, 1])
    gated:  f(x) = s(w^T x) * max(x) + (1 - s(w^T x)) * mean(x)     (eq. 3; s the sigmoid)

Here the region is all of a text's tokens (padding never counts) and ``max``/``mean`` are
:mod:`poolers.max`'s and :mod:`poolers.mean`'s vectors. The paper's gate reads the region's values
through a mask ``w`` of one weight per position of a fixed-size region; a text has no fixed size,
so the gate reads a summary of fixed size instead, the text's two pooled vectors themselves:
``a = c * s(w_1^T mean + w_2^T max + b)``, one weight per text shared by the channels (the paper's
"one gate per layer" form).

**Untrained behaviour.** Both start as ``mean`` exactly: ``mixed`` at ``a = 0``; ``gated`` with a
gate scale ``c = 0`` (our addition: a sigmoid never reaches 0, so without ``c`` the untrained gate
would sit at 1/2, halfway to max; with ``c = 1`` the gate is the paper's). ``a`` and ``c`` are
kept in ``[0, 1]`` by a clamp whose gradient passes straight through (:class:`UnitClamp`), so
that training can leave and come back to the boundary where it starts (a plain clamp's gradient
is zero outside the interval; a smooth map onto ``[0, 1]`` has zero slope where it reaches 0).
``mixed:a=X`` is the untrained operator at a fixed ``a`` (``a=1``: ``max`` exactly).

**Learning rate.** Adam moves every parameter by about the learning rate a step whatever its
gradient, and ``train-pooler``'s rates (1e-3, 3e-4) suit token scores, which matter at ~0.01 where
``a`` and ``c`` must travel ~0.1-1. So ``a`` and ``c`` are stored divided by :data:`GAIN` (16, a
power of two: the product is exact) and move 16 times faster than the gate's weights.

Cost: one masked mean and one masked max, linear in the text's length. The heads save, load,
bind to their encoder and split by role as :mod:`poolers.attention`'s (``head.json`` +
``head.safetensors``, ``kind: mixed`` / ``gated``); ``embedpool train-pooler --pooler mixed``
(``gated``) trains them. The paper's third form, the tree of learned pooling filters, is not built.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from embedpool.errors import InvalidError
from embedpool.poolers.attention import AttentionPooler, HeadModule, head_class, role_heads
from embedpool.poolers.base import masked_mean, register
from embedpool.poolers.states import TokenStates


GAIN = 16.0  # a and c are stored as value / GAIN (see the module docstring)


class UnitClamp(torch.autograd.Function):
    """``x`` clamped to ``[lo, hi]`` in the forward pass (exactly), the identity's gradient in the
    backward pass (a straight-through estimator)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, lo: float, hi: float) -> Tensor:  # noqa: D102
        return x.clamp(lo, hi)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # noqa: D102
        return grad, None, None


def clamp_through(x: Tensor, lo: float = 0.0, hi: float = math.inf) -> Tensor:
    """:class:`UnitClamp`: ``x.clamp(lo, hi)`` with the gradient of ``x``."""
    return UnitClamp.apply(x, lo, hi)


def masked_max(hidden: Tensor, mask: Tensor) -> Tensor:
    """Element-wise max over the tokens ``mask`` keeps, ``[B, D]`` (as :mod:`poolers.max`)."""
    return hidden.masked_fill(~mask.bool().unsqueeze(-1), float("-inf")).amax(dim=1)


def single_output(name: str, queries: int, heads: int) -> None:
    """Refuse more than one output vector or attention head (``train-pooler --queries/--heads``)."""
    if queries != 1 or heads != 1:
        raise InvalidError(f"{name} gives one vector per text: queries and heads must be 1, got {queries} and {heads}",
                           param="pooler")


class _MixHead(HeadModule):
    """A mix of the text's max and mean, ``a * max + (1 - a) * mean``, with ``a`` from :meth:`mix`.
    No value projection: ``value_projection`` is accepted (``train-pooler`` passes it) and recorded
    false."""

    def __init__(self, dim: int, queries: int = 1, value_projection: bool = False, heads: int = 1,
                 encoder: str | None = None, meta: dict[str, Any] | None = None) -> None:
        single_output(self.kind, queries, heads)
        super().__init__(dim, queries, False, heads, encoder, meta)

    def mix(self, mean: Tensor, top: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, hidden: Tensor, mask: Tensor, role: str | None = None) -> Tensor:
        """``hidden [B,T,D]``, ``mask [B,T]`` -> ``[B, 1, D]``."""
        mean, top = masked_mean(hidden, mask), masked_max(hidden, mask)
        a = self.mix(mean, top)
        return (a * top + (1 - a) * mean).unsqueeze(1)  # a = 0: mean exactly; a = 1: max exactly


@head_class
class MixedHead(_MixHead):
    """Mixed max-average pooling: one learned ``a`` in ``[0, 1]`` (0: mean).

    Args:
        dim: token state size ``D``.
        queries, heads: must be 1.
        value_projection: ignored (no projection).
        a: the starting mixing weight.
        encoder: the model the head is trained on (recorded in its config).
        meta: provenance kept in the config.
    """

    kind = "mixed"
    config_keys = (*HeadModule.config_keys, "kind")

    def __init__(self, dim: int, queries: int = 1, value_projection: bool = False, heads: int = 1,
                 encoder: str | None = None, meta: dict[str, Any] | None = None, a: float = 0.0) -> None:
        super().__init__(dim, queries, value_projection, heads, encoder, meta)
        self.a = nn.Parameter(torch.tensor([float(a) / GAIN]))

    def weight(self) -> Tensor:
        """The weight of max, ``a`` in ``[0, 1]``, ``[1]``."""
        return clamp_through(GAIN * self.a, 0.0, 1.0)

    def mix(self, mean: Tensor, top: Tensor) -> Tensor:
        return self.weight()


@head_class
class GatedHead(_MixHead):
    """Gated max-average pooling: ``a = c * sigmoid(w_1^T mean + w_2^T max + b)`` per text
    (``c = 0``: mean).

    Args:
        dim: token state size ``D``.
        queries, heads: must be 1.
        value_projection: ignored (no projection).
        encoder: the model the head is trained on (recorded in its config).
        meta: provenance kept in the config.
    """

    kind = "gated"
    config_keys = (*HeadModule.config_keys, "kind")

    def __init__(self, dim: int, queries: int = 1, value_projection: bool = False, heads: int = 1,
                 encoder: str | None = None, meta: dict[str, Any] | None = None) -> None:
        super().__init__(dim, queries, value_projection, heads, encoder, meta)
        self.gate = nn.Linear(2 * dim, 1)  # w = [w_1 ; w_2], b
        nn.init.zeros_(self.gate.weight)
        nn.init.zeros_(self.gate.bias)
        self.scale = nn.Parameter(torch.zeros(1))  # c / GAIN: the untrained gate is closed (mean)

    def gate_scale(self) -> Tensor:
        """``c`` in ``[0, 1]``, ``[1]``."""
        return clamp_through(GAIN * self.scale, 0.0, 1.0)

    def mix(self, mean: Tensor, top: Tensor) -> Tensor:
        """The per-text weight of max, ``[B, 1]``."""
        return self.gate_scale() * torch.sigmoid(self.gate(torch.cat([mean, top], dim=-1)))


MixedRoleHeads = role_heads(MixedHead)
GatedRoleHeads = role_heads(GatedHead)


class FixedOrTrainedPooler(AttentionPooler):
    """A head's pooler with one option (``fixed``: ``mixed``'s ``a``, ``gem``'s ``p``) that sets the
    untrained operator; refused beside ``weights`` unless it is the default (a saved config lists it)."""

    fixed: ClassVar[str]
    head_type: ClassVar[type[HeadModule]]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        value = getattr(self, self.fixed)
        if self.weights and value != getattr(type(self), self.fixed):
            raise InvalidError(f"{self.name}: give a trained head (weights=) or a fixed {self.fixed}=, not both",
                               param="pooler")
        self.check(value)

    def check(self, value: float) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def new_head(self, states: TokenStates) -> HeadModule:
        return self.head_type(states.hidden.shape[-1], **{self.fixed: getattr(self, self.fixed)})


@register
class MixedPooler(FixedOrTrainedPooler):
    """Mixed max-average pooling, ``a * max + (1 - a) * mean``.

    Args:
        weights: folder (or file) of a trained ``mixed`` head; empty for the untrained operator.
        a: the mixing weight without weights (0: ``mean``, the default; 1: ``max``).
    """

    name = "mixed"
    options = {"weights": str, "a": float}
    a = 0.0
    fixed, head_type = "a", MixedHead

    def check(self, value: float) -> None:
        if not 0.0 <= value <= 1.0:
            raise InvalidError(f"mixed: a must be in [0, 1], got {value}", param="pooler")


@register
class GatedPooler(AttentionPooler):
    """Gated max-average pooling: the weight of max computed from each text's tokens.

    Args:
        weights: folder (or file) of a trained ``gated`` head; empty for the untrained head (= ``mean``).
    """

    name = "gated"
    options = {"weights": str}

    def new_head(self, states: TokenStates) -> GatedHead:
        return GatedHead(states.hidden.shape[-1])
