"""Multi-layer trainable pooling: cross-attention from learned queries over the token states of
every hidden layer, with learned layer weights (after Multi-Layers Trainable Pooling, which
found attention over all layers' outputs ahead of last-layer pooling for similarity and
retrieval).

Each of the head's ``queries`` scores every token of every layer with one linear scorer (a
learned query against the token states); a masked softmax over each layer's tokens gives one
attention-weighted mean per layer, ``m_l``; the layers are then mixed with learned weights
``a_l`` as ``m_L + sum_{l<L} a_l (m_l - m_L)`` (weight ``1 - sum a`` on the last layer ``L``).
At initialisation the scores and the ``a_l`` are zero, so every token of a layer weighs the
same, ``m_L`` is :class:`poolers.mean.MeanPooler`'s vector to the bit (the very computation of
:class:`poolers.attention.AttentionHead`, whose untrained output is mean's) and the zero mix adds
exactly nothing: untrained, ``multilayer`` is ``mean`` of the last layer. ``queries=k>1`` gives
``k`` vectors per text, each with its own token scores and layer weights.

Heads save, load, bind to their encoder and split by role as :mod:`poolers.attention`'s do (the
same ``head.json`` + ``head.safetensors``, ``kind: multilayer``); ``layers`` in the config is the
number of hidden layers the head mixes (the encoder's layers + the embeddings), checked when it pools.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from embedpool.errors import InvalidError
from embedpool.poolers.attention import AttentionHead, AttentionPooler, HeadModule, RoleHeads, head_class
from embedpool.poolers.base import register
from embedpool.poolers.states import TokenStates


@head_class
class MultiLayerHead(AttentionHead):
    """Attention over every layer's tokens, then a learned mix of the layers.

    Args:
        dim: token state size.
        layers: the hidden layers it attends over (transformers' ``hidden_states``: the
            embeddings and every layer), the last one last.
        queries: output vectors per text.
        value_projection: a ``dim x dim`` map of the mixed state, identity at init.
        heads: attention heads per output vector (see :class:`AttentionHead`).
        encoder: the model the head is trained on (recorded in its config).
        meta: provenance kept in the config.
    """

    kind = "multilayer"
    config_keys = (*HeadModule.config_keys, "layers", "kind")

    def __init__(self, dim: int, layers: int, queries: int = 1, value_projection: bool = False, heads: int = 1,
                 encoder: str | None = None, meta: dict[str, Any] | None = None) -> None:
        if layers < 1:
            raise InvalidError(f"multilayer layers must be >= 1, got {layers}", param="pooler")
        super().__init__(dim, queries, value_projection, heads, encoder, meta)
        self.layers = layers
        self.layer_mix = nn.Parameter(torch.zeros(queries, layers - 1))  # a_l: zero, the last layer alone

    def forward(self, hidden: Tensor, mask: Tensor, role: str | None = None) -> Tensor:
        """``hidden [K, B, T, D]`` (every layer, the last last), ``mask [B, T]`` -> ``[B, queries, D]``."""
        k, b, t, d = hidden.shape
        if k != self.layers:
            raise InvalidError(f"multilayer head mixes {self.layers} hidden layers, but this encoder gives {k}; "
                               "train a head for it", param="pooler")
        last = self.attend(hidden[-1], mask)  # [B,Q,D]: attention's (= mean's, untrained) computation
        if k == 1:
            return self.project(last)
        below = self.attend(hidden[:-1].reshape((k - 1) * b, t, d), mask.repeat(k - 1, 1))
        below = below.view(k - 1, b, self.queries, d)
        mixed = last + torch.einsum("ql,lbqd->bqd", self.layer_mix, below - last)
        return self.project(mixed)


@head_class
class MultiLayerRoleHeads(RoleHeads):
    """Separate query and document :class:`MultiLayerHead` heads.

    Args:
        dim: token state size.
        layers: hidden layers each head mixes.
        queries: output vectors per text (both heads).
        value_projection: give both heads a value projection (identity at init).
        heads: attention heads of each.
        encoder: the model the heads are trained on.
        meta: provenance kept in the config.
    """

    kind = "multilayer"
    config_keys = (*HeadModule.config_keys, "layers", "kind")
    member = MultiLayerHead

    def __init__(self, dim: int, layers: int, queries: int = 1, value_projection: bool = False, heads: int = 1,
                 encoder: str | None = None, meta: dict[str, Any] | None = None) -> None:
        super().__init__(dim, queries, value_projection, heads, encoder, meta, layers=layers)


@register
class MultiLayerPooler(AttentionPooler):
    """Learned cross-attention over the token states of every hidden layer.

    Args:
        weights: folder (or file) of a trained multilayer head; empty for the untrained head
            (= ``mean`` of the last layer).
        queries: output vectors per text when no weights are given (1 = single vector).
    """

    name = "multilayer"
    needs_layers = True

    def new_head(self, states: TokenStates) -> MultiLayerHead:
        return MultiLayerHead(states.hidden.shape[-1], self.head_input(states).shape[0], self.queries)

    def head_input(self, states: TokenStates) -> Tensor:
        return states.select_layers("all")
