"""MaxPoolBERT's depth-wise ``[CLS]`` pooling (MaxCLS; Behrendt, Wagner and Harmeling, 2025):
the element-wise maximum of the ``[CLS]`` state over the last ``k`` layers.

The paper's other two variants put a trained multi-head attention layer over the final layer;
untrained there is no such layer, so only the weight-free MaxCLS is here (a trained
cross-attention over every layer is :mod:`poolers.multilayer`).
"""

from __future__ import annotations

from torch import Tensor

from embedpool.poolers.base import LayersOption, Pooler, per_window_option, register
from embedpool.poolers.cls import first_window
from embedpool.poolers.states import TokenStates


@register
@per_window_option
class MaxPoolBertPooler(LayersOption, Pooler):
    """Element-wise max over layers of the first token's (``[CLS]``) state; for a windowed
    text, the first window's (as ``cls``).

    Args:
        layers: the layers the max runs over: ``last<k>`` (default ``last3``, the paper's k),
            ``all``, or indices joined by ``+`` (see :func:`poolers.states.layer_indices`).
        per_window: one vector per window for documents, one over all windows for queries
            (see :class:`poolers.base.PerWindow`).
    """

    name = "maxpoolbert"
    options = {"layers": str}
    layers = "last3"

    def pool(self, states: TokenStates) -> Tensor:
        return first_window(states.select_layers(self.layers)[:, :, 0].amax(dim=0), states)

    def merge(self, parts: list[Tensor], role: str = "document") -> Tensor:
        return parts[0]
