"""SoftPool (Stergiou, Poppe and Kalliatakis, "Refining activation downsampling with SoftPool",
ICCV 2021), over a text's token states.

Per channel ``c``, every token is weighted by the softmax over the text's tokens of its own
activation, and the weighted activations are summed (the paper's eqs. 1-2):

    SoftPool(x)_c = sum_t softmax_t(x_.c)_t * x_tc = sum_t e^(x_tc) x_tc / sum_t e^(x_tc)

A smooth operator between ``mean`` (every activation equal) and ``max`` (one activation far above
the others: on ``n`` tokens with one at ``v`` and the rest at 0 it gives
``v e^v / (e^v + n - 1)``). The exponentials are taken after subtracting the channel's maximum
over the text (the same weights, no overflow); padding never counts. No parameters and no options:
the operator is the paper's as it is, with the model's own scale of activations (no temperature).
Cost: a masked max and two masked sums, linear in the text's length.

adaPool (Stergiou and Poppe 2022: a learned blend of an exponential-maximum and a Dice-Sorensen
weighted pooling) is not built.
"""

from __future__ import annotations

import torch
from torch import Tensor

from embedpool.errors import InvalidError
from embedpool.poolers.base import Pooler, register
from embedpool.poolers.generalized import masked_max
from embedpool.poolers.states import TokenStates


def soft_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    """``hidden [B,T,D]``, ``mask [B,T]`` -> ``[B, D]``: SoftPool over the tokens ``mask`` keeps."""
    top = masked_max(hidden, mask).unsqueeze(1)
    weights = torch.exp(hidden - top).masked_fill(~mask.bool().unsqueeze(-1), 0.0)  # [B,T,D], per channel
    return (weights * hidden.masked_fill(~mask.bool().unsqueeze(-1), 0.0)).sum(1) / weights.sum(1)


class TokenOperatorPooler(Pooler):
    """A parameter-free pooler that applies ``operator(hidden [B,T,D], mask [B,T]) -> [B, D]`` to
    each text's token states on the standard plan (``softpool``, ``simpool``)."""

    @staticmethod
    def operator(hidden: Tensor, mask: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def pool(self, states: TokenStates) -> Tensor:
        if not states.one_row_per_text:
            raise InvalidError(f"{self.name} pooling runs on the standard tokenization plan")
        return self.operator(states.hidden, states.pool_mask)


@register
class SoftPooler(TokenOperatorPooler):
    """SoftPool: per channel, tokens weighted by the softmax of their activation."""

    name = "softpool"
    operator = staticmethod(soft_pool)
