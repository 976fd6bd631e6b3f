"""SimPool (Psomas, Kakogeorgiou, Karantzalos and Avrithis, "Keep It SimPool: Who Said Supervised
Transformers Suffer from Attention Deficit?", ICCV 2023), parameter-free, over a text's token states.

SimPool is attention pooling whose query is the global average of the tokens (the paper's section 4;
its reference code, ``sp.py``): with ``X`` a text's token states (``n x D``),

    q = mean_t x_t                         (initialisation: global average pooling)
    k_t = LN(x_t)                          (layer norm, no affine)
    a = softmax_t(q . k_t / sqrt(D))       (one attention distribution over the text's tokens)
    SimPool(X) = sum_t a_t x_t

Choices where the paper leaves room, for a drop-in of ``mean``/``cls`` on a frozen text encoder:

- **no trained parameters**: the query and key projections ``W_q``, ``W_k`` are the identity (the
  paper learns them with the network it pools for; a frozen encoder has no such training);
- **the values are the token states themselves**, not their layer norm as in ``sp.py``: the vector
  then lives in the model's space, as ``mean``'s does, and goes through the model's own head;
- **no power function** on the values (the paper's ``gamma``, which it uses for convolutional
  networks' non-negative features; its transformer default is none).

With identical tokens every score is equal and the weights are exactly 1: the result is
:mod:`poolers.mean`'s (:func:`poolers.base.masked_mean`, the same numbers), i.e. that token.
Padding is never a key nor a value. Cost: one mean, one score per token and one weighted mean,
linear in the text's length (the single query never forms an ``n x n`` matrix).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from embedpool.poolers.base import masked_mean, register
from embedpool.poolers.softpool import TokenOperatorPooler

LN_EPS = 1e-6  # the reference code's LayerNorm epsilon


def sim_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    """``hidden [B,T,D]``, ``mask [B,T]`` -> ``[B, D]``: SimPool over the tokens ``mask`` keeps."""
    query = masked_mean(hidden, mask)
    keys = F.layer_norm(hidden, hidden.shape[-1:], eps=LN_EPS)
    scores = torch.einsum("btd,bd->bt", keys, query) / math.sqrt(hidden.shape[-1])
    scores = scores.masked_fill(~mask.bool(), float("-inf"))
    # exp(s - max) is exactly 1.0 for equal scores: identical tokens give mean's vector to the bit
    weights = torch.exp(scores - scores.amax(dim=1, keepdim=True)).nan_to_num(0.0)
    return masked_mean(hidden, weights)


@register
class SimPooler(TokenOperatorPooler):
    """SimPool: attention over the tokens with their average as the query; no parameters."""

    name = "simpool"
    operator = staticmethod(sim_pool)
