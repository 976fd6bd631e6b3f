"""Max pooling: the element-wise maximum over token states."""

from __future__ import annotations

import torch
from torch import Tensor

from embedpool.poolers.base import Pooler, per_window_option, register
from embedpool.poolers.states import TokenStates


@register
@per_window_option
class MaxPooler(Pooler):
    """Masked element-wise max over tokens (padding never wins).

    Args:
        per_window: one vector per window for documents, one over all windows for queries
            (see :class:`poolers.base.PerWindow`).
    """

    name = "max"

    def pool(self, states: TokenStates) -> Tensor:
        mask = states.pool_mask.bool().unsqueeze(-1)
        per_row = states.hidden.masked_fill(~mask, float("-inf")).max(dim=1).values
        if states.one_row_per_text:
            return per_row
        out = torch.full((states.n_texts, per_row.shape[-1]), float("-inf"))
        return out.index_reduce_(0, states.text_index, per_row, "amax")

    def merge(self, parts: list[Tensor], role: str = "document") -> Tensor:
        return torch.stack(parts).amax(0)
