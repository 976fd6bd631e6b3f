"""CLS pooling: the state of the first token."""

from __future__ import annotations

from torch import Tensor

from embedpool.poolers.base import Pooler, per_window_option, register
from embedpool.poolers.states import TokenStates


@register
@per_window_option
class ClsPooler(Pooler):
    """The first real token's state (``[CLS]`` for BERT-style models; right padding). For a
    windowed text, the first window's.

    Args:
        per_window: one vector per window for documents, one over all windows for queries
            (see :class:`poolers.base.PerWindow`).
    """

    name = "cls"

    def pool(self, states: TokenStates) -> Tensor:
        return first_window(states.hidden[:, 0], states)

    def merge(self, parts: list[Tensor], role: str = "document") -> Tensor:
        return parts[0]


def first_window(per_row: Tensor, states: TokenStates) -> Tensor:
    """``per_row`` (``[R, D]``, one vector per row) of each text's first row (window): ``[B, D]``."""
    if states.one_row_per_text:
        return per_row
    rows: dict[int, int] = {}
    for r, t in enumerate(states.text_index.tolist()):
        rows.setdefault(t, r)
    return per_row[[rows[t] for t in range(states.n_texts)]]
