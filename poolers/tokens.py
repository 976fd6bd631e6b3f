"""Token vectors: every token's state, L2-normalized, the unpooled multi-vector baseline."""

from __future__ import annotations

import torch
from torch import Tensor

from embedpool.poolers.base import Pooler, register
from embedpool.poolers.encoder import STANDARD, WINDOWED, Plan
from embedpool.poolers.states import TokenStates


def normalized_tokens(states: TokenStates) -> list[Tensor]:
    """Each text's token vectors (``states.vector_mask``: every attended token, specials
    included; a ColBERT model's scored tokens), L2-normalized, ``[n_i, D]``."""
    return [torch.nn.functional.normalize(t, dim=-1) for t in states.per_text_tokens(states.vector_mask)]


class TokenVectorPooler(Pooler):
    """Base of the multi-vector poolers over token states: ``window=true`` encodes an input
    longer than the model's window as several windows (the ``windowed`` plan, its own forward
    pass) and keeps the vectors of all of them, instead of truncating it."""

    multi_vector = True
    window = False

    @property
    def plan(self) -> Plan:
        return WINDOWED if self.window else STANDARD

    def n_vectors(self, rows: list[int], role: str) -> int:
        return sum(rows)  # one per token


@register
class TokensPooler(TokenVectorPooler):
    """All token vectors of a text (``[CLS]`` and ``[SEP]`` included), L2-normalized.

    Args:
        window: keep the tokens of every window of a long input (default: truncate, as
            sentence-transformers and PyLate do).
    """

    name = "tokens"
    options = {"window": bool}

    def pool(self, states: TokenStates) -> list[Tensor]:
        return normalized_tokens(states)
