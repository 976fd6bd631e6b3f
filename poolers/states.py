"""Token states: what one forward pass hands to every pooler."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TokenStates:
    """Encoder output for one batch of texts.

    A text usually occupies one row. Under the landmark plan a text longer than the
    encoder window spans several rows (windows); ``text_index`` maps every row to its
    text so that poolers can pool across all of a text's windows.

    Args:
        hidden: last hidden layer, ``[R, T, D]`` float32 (padding rows are zero-masked by
            ``attention_mask``, not zeroed).
        attention_mask: ``[R, T]`` 1 for real tokens, 0 for padding.
        special_tokens_mask: ``[R, T]`` 1 for special tokens (``[CLS]``, ``[SEP]``, …).
        landmark_mask: ``[R, T]`` 1 for landmark (``[SEP]``) positions, landmark plan only.
        pool_mask: ``[R, T]`` the tokens poolers average over: ``attention_mask`` minus the
            prompt tokens when the model's pooling excludes its prompt.
        text_index: ``[R]`` index of the text each row belongs to, in ``0..n_texts-1``.
        n_texts: number of texts in the batch.
        layers: all hidden layers ``[L+1, R, T, D]`` when asked for, else ``None``.
    """

    hidden: Tensor
    attention_mask: Tensor
    special_tokens_mask: Tensor
    text_index: Tensor
    n_texts: int
    pool_mask: Tensor | None = None
    landmark_mask: Tensor | None = None
    layers: Tensor | None = None

    def __post_init__(self) -> None:
        if self.pool_mask is None:
            self.pool_mask = self.attention_mask

    @property
    def one_row_per_text(self) -> bool:
        return self.hidden.shape[0] == self.n_texts

    def per_text_tokens(self, mask: Tensor | None = None) -> list[Tensor]:
        """The masked token states of each text as ``[n_i, D]`` tensors, windows concatenated."""
        mask = (self.attention_mask if mask is None else mask).bool()
        rows: list[list[Tensor]] = [[] for _ in range(self.n_texts)]
        for r, t in enumerate(self.text_index.tolist()):
            rows[t].append(self.hidden[r][mask[r]])
        return [torch.cat(parts) if len(parts) > 1 else parts[0] for parts in rows]
