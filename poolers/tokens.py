"""Token vectors: every token's state, L2-normalized, the unpooled multi-vector baseline."""

from __future__ import annotations

import torch
from torch import Tensor

from poolers.base import Pooler, register
from poolers.states import TokenStates


def normalized_tokens(states: TokenStates) -> list[Tensor]:
    """Each text's attended token states (specials included), L2-normalized, ``[n_i, D]``."""
    return [torch.nn.functional.normalize(t, dim=-1) for t in states.per_text_tokens()]


@register
class TokensPooler(Pooler):
    """All token vectors of a text (``[CLS]`` and ``[SEP]`` included), L2-normalized."""

    name = "tokens"
    multi_vector = True

    def pool(self, states: TokenStates) -> list[Tensor]:
        return normalized_tokens(states)
