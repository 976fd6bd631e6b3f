"""Token states: what one forward pass hands to every pooler."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from embedpool.errors import InvalidError


def layer_indices(layers: str, n: int) -> list[int]:
    """Indices into the ``n`` hidden layers (``0`` the embeddings, ``n - 1`` the last, as
    transformers' ``hidden_states``) named by ``layers``: ``all``; ``last<k>`` (the last ``k``);
    or indices joined by ``+``, negative ones counted from the end (``1+-1``: the first
    transformer layer and the last). ``n`` of ``None`` checks the syntax alone.

    Raises:
        InvalidError: not of that form, or an index the model does not have.
    """
    text = str(layers).strip().lower()
    try:
        if text == "all":
            return list(range(n)) if n else []
        if text.startswith("last"):
            k = int(text[4:])
            if k < 1 or (n and k > n):
                raise ValueError
            return list(range(n - k, n)) if n else []
        idx = [int(part) for part in text.split("+")]
    except ValueError:
        raise InvalidError(f"layers={layers!r}: use all, last<k> (1 <= k <= {n or 'the layer count'}) or indices "
                           "joined by + (negative from the end, e.g. 1+-1)", param="pooler") from None
    if not n:
        return idx
    bad = [i for i in idx if not -n <= i < n]
    if bad:
        raise InvalidError(f"layers={layers!r}: the model has {n} hidden layers (0 = embeddings .. {n - 1}); "
                           f"no layer {bad[0]}", param="pooler")
    return [i % n for i in idx]


@dataclass
class TokenStates:
    """Encoder output for one batch of texts.

    A text usually occupies one row. Under the windowed and landmark plans a text longer
    than the encoder window spans several rows (windows); ``text_index`` maps every row to
    its text so that poolers can pool across all of a text's windows. A text with more
    windows than one forward batch holds spans several batches: each holds only that text,
    and ``continued`` says that more of its windows follow in the next batch.

    Args:
        hidden: last hidden layer, ``[R, T, D]`` float32 (padding rows are zero-masked by
            ``attention_mask``, not zeroed).
        attention_mask: ``[R, T]`` 1 for real tokens, 0 for padding.
        special_tokens_mask: ``[R, T]`` 1 for special tokens (``[CLS]``, ``[SEP]``, …).
        landmark_mask: ``[R, T]`` 1 for landmark (``[SEP]``) positions, landmark plan only.
        pool_mask: ``[R, T]`` the tokens poolers average over: ``attention_mask`` minus the
            prompt tokens when the model's pooling excludes its prompt (a ColBERT model: the
            tokens it scores with, ``vector_mask``).
        vector_mask: ``[R, T]`` the tokens that become vectors of the multi-vector poolers
            (``tokens``, ``cluster``): ``attention_mask``, or for a ColBERT model the tokens it
            scores with (a query's expansion tokens in, a document's skiplist out).
        prompt_tokens: leading positions of each row that the model's pooling leaves out
            (special tokens and prompt, as sentence-transformers counts them), 0 for none.
        text_index: ``[R]`` index of the text each row belongs to, in ``0..n_texts-1``.
        n_texts: number of texts in the batch.
        layers: all hidden layers ``[L+1, R, T, D]`` when asked for, else ``None``.
        continued: the batch's one text continues in the next batch (see
            :meth:`poolers.base.Pooler.merge`).
    """

    hidden: Tensor
    attention_mask: Tensor
    special_tokens_mask: Tensor
    text_index: Tensor
    n_texts: int
    pool_mask: Tensor | None = None
    landmark_mask: Tensor | None = None
    layers: Tensor | None = None
    continued: bool = False
    vector_mask: Tensor | None = None
    prompt_tokens: int = 0

    def __post_init__(self) -> None:
        if self.pool_mask is None:
            self.pool_mask = self.attention_mask
        if self.vector_mask is None:
            self.vector_mask = self.attention_mask

    def select_layers(self, layers: str) -> Tensor:
        """The hidden layers named by ``layers`` (see :func:`layer_indices`), ``[K, R, T, D]``.

        Raises:
            InvalidError: the states hold no layers (the encoder ran without ``all_layers``),
                or ``layers`` names one the model does not have.
        """
        if self.layers is None:
            raise InvalidError("this pooler reads every hidden layer, but the token states hold only the last: "
                               "encode with all_layers=True (the pipeline does when a pooler declares needs_layers)")
        idx = layer_indices(layers, self.layers.shape[0])
        return self.layers[idx] if idx != list(range(self.layers.shape[0])) else self.layers

    @property
    def one_row_per_text(self) -> bool:
        return self.hidden.shape[0] == self.n_texts

    def per_text_tokens(self, mask: Tensor | None = None) -> list[Tensor]:
        """The masked token states of each text as ``[n_i, D]`` tensors, windows concatenated."""
        mask = (self.attention_mask if mask is None else mask).bool()
        return self.rows_by_text([self.hidden[r][mask[r]] for r in range(self.hidden.shape[0])])

    def rows_by_text(self, per_row: list[Tensor]) -> list[Tensor]:
        """Per-row ``[n_r, D]`` results joined per text (its rows in order): ``[n_i, D]``."""
        rows: list[list[Tensor]] = [[] for _ in range(self.n_texts)]
        for r, t in enumerate(self.text_index.tolist()):
            rows[t].append(per_row[r])
        return [torch.cat(parts) if len(parts) > 1 else parts[0] for parts in rows]

    @classmethod
    def concat(cls, batches: list["TokenStates"]) -> "TokenStates":
        """The rows of several batches as one batch (right-padded to the widest row), their
        texts renumbered in order; the batches of a text split by the encoder (``continued``)
        join into one text. For callers that want a text's windows in one place (tests,
        benchmarks); the pipeline merges per-batch results instead (it never holds them all)."""
        width = max(b.hidden.shape[1] for b in batches)

        def pad(t: Tensor | None) -> Tensor | None:
            return None if t is None else torch.nn.functional.pad(t, (0, width - t.shape[1]))

        index, offset = [], 0
        for b in batches:
            index.append(b.text_index + offset)
            offset += b.n_texts - (1 if b.continued else 0)
        return cls(
            hidden=torch.cat([torch.nn.functional.pad(b.hidden, (0, 0, 0, width - b.hidden.shape[1]))
                              for b in batches]),
            attention_mask=torch.cat([pad(b.attention_mask) for b in batches]),
            special_tokens_mask=torch.cat([pad(b.special_tokens_mask) for b in batches]),
            text_index=torch.cat(index),
            n_texts=offset + (1 if batches[-1].continued else 0),
            pool_mask=torch.cat([pad(b.pool_mask) for b in batches]),
            vector_mask=torch.cat([pad(b.vector_mask) for b in batches]),
            prompt_tokens=batches[0].prompt_tokens,
            landmark_mask=None if batches[0].landmark_mask is None
            else torch.cat([pad(b.landmark_mask) for b in batches]),
            layers=None if batches[0].layers is None
            else torch.cat([torch.nn.functional.pad(b.layers, (0, 0, 0, width - b.layers.shape[2]))
                            for b in batches], dim=1),
        )
