"""Mean pooling: the masked average of token states, as sentence-transformers computes it."""

from __future__ import annotations

from torch import Tensor

from embedpool.poolers.base import WeightedMeanPooler, per_window_option, register
from embedpool.poolers.states import TokenStates


@register
@per_window_option
class MeanPooler(WeightedMeanPooler):
    """Masked mean over tokens.

    Args:
        include_special: average over ``[CLS]``/``[SEP]`` too (default, as sentence-transformers
            does); ``false`` averages over the text's own tokens only.
        per_window: one vector per window for documents, one over all windows for queries
            (see :class:`poolers.base.PerWindow`).
    """

    name = "mean"
    options = {"include_special": bool}
    include_special = True

    def weights(self, states: TokenStates) -> Tensor:
        return mean_weights(states, self.include_special)


def mean_weights(states: TokenStates, include_special: bool = True) -> Tensor:
    """The tokens a mean averages: the pooling mask, without the special tokens unless
    ``include_special``."""
    if include_special:
        return states.pool_mask
    return states.pool_mask * (1 - states.special_tokens_mask)
