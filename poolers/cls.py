"""CLS pooling: the state of the first token."""

from __future__ import annotations

from torch import Tensor

from embedpool.poolers.base import Pooler, register
from embedpool.poolers.states import TokenStates


@register
class ClsPooler(Pooler):
    """The first real token's state (``[CLS]`` for BERT-style models; right padding). For a
    windowed text, the first window's."""

    name = "cls"

    def pool(self, states: TokenStates) -> Tensor:
        first = states.hidden[:, 0]
        if states.one_row_per_text:
            return first
        rows = [states.text_index.tolist().index(t) for t in range(states.n_texts)]
        return first[rows]
