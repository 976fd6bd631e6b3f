"""Layer-mix pooling: the masked token mean of the average of chosen hidden layers.

The default, ``layers=1+-1``, is the "first-last average" of Su et al. (whitening, 2021) and of
SimCSE's ``avg_first_last`` pooler: the first transformer layer's and the last layer's token
states averaged, then mean-pooled over the text's tokens. No weights: a baseline for the
learned multi-layer pooler (:mod:`poolers.multilayer`).
"""

from __future__ import annotations

from torch import Tensor

from embedpool.poolers.base import LayersOption, WeightedMeanPooler, per_window_option, register
from embedpool.poolers.mean import mean_weights
from embedpool.poolers.states import TokenStates


@register
@per_window_option
class LayerMeanPooler(LayersOption, WeightedMeanPooler):
    """Masked token mean of the average of hidden layers.

    Args:
        layers: the layers averaged: ``all`` (embeddings included), ``last<k>``, or indices
            joined by ``+`` (``0`` the embeddings, negative from the end); default ``1+-1``,
            the first transformer layer and the last.
        include_special: average over ``[CLS]``/``[SEP]`` too (as ``mean`` does by default).
        per_window: one vector per window for documents, one over all windows for queries
            (see :class:`poolers.base.PerWindow`).
    """

    name = "layermean"
    options = {"layers": str, "include_special": bool}
    layers = "1+-1"
    include_special = True

    def weights(self, states: TokenStates) -> Tensor:
        return mean_weights(states, self.include_special)

    def source(self, states: TokenStates) -> Tensor:
        return states.select_layers(self.layers).mean(dim=0)
