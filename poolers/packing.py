"""Several short rows in one forward row: the encoder's packing of short texts.

A forward of a batch of sentences pays per row as much as per token: on the AMX Xeon with
OpenVINO bf16, 30 STS-B sentences (~11 tokens each, padded to ~20-25) take 18-22 ms as 30 rows
and 9-10 ms packed into 6 rows of 64 tokens. ``bench/packing.py`` (same encoder, packed vs not,
one run): rounds of 30 sentences, what the server's batcher forwards at 32 clients, 1.56x the
texts/s on ``openvino-bf16`` and 1.36-1.39x on torch ``fp32``; all 1,379 sentences in one call
(length-sorted batches, little padding) 1.05-1.08x and 1.03-1.05x; documents (rows of ~250
tokens, not packed) level. So rows of a batch whose longest row is short share forward rows:
each row keeps its own positions (from 0) and attends only to its own tokens through a
block-diagonal 4D mask, which gives it the states it has alone (the attention over other rows'
keys is masked to exactly zero), and the states are gathered back into the batch's usual
right-padded ``[B, T, D]`` layout, so nothing after the forward changes.

Rows go into bins of :data:`PACK_TOKENS` tokens by first fit, longest row first, which fills
the bins almost to the token: on rounds of 30 sentences 9.3 ms, where filling each bin from
both ends of the length order gave 7 bins of 62 tokens instead of 6 of 64 and 13.7-14.6 ms
(OpenVINO also ran those 7 bins padded to 64 tokens in 10.7 ms: some widths run faster; not
relied on). Bins of 32 to 96 tokens measured level, 128 slower. A batch is
packed only when that at least halves its rows and its padded area stays within the token
budget of a forward batch (or the batch's own area, if larger), so the budget still bounds it.

The mask of a packed row: a token attends to a key of the same row that the row's own 2D
mask lets it attend to (a ColBERT query's non-attending expansion tokens stay so); the padding
at a bin's end forms a segment of its own, so no query's attention is empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PACK_TOKENS = 64


@dataclass(frozen=True)
class Packing:
    """A batch's rows in bins: the forward's inputs and where each row's states come back from."""

    input_ids: torch.Tensor  # [P, W]
    attention_mask: torch.Tensor  # [P, 1, W, W] bool, True = may attend
    position_ids: torch.Tensor  # [P, W]
    gather: torch.Tensor  # [B, T]: index into the flattened [P * W] states; P * W = a zero row

    def inputs(self) -> dict[str, torch.Tensor]:
        """The forward's keywords (token types, all zeros here as in every forward, are the caller's)."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "position_ids": self.position_ids}

    def unpack(self, states: torch.Tensor) -> torch.Tensor:
        """``[..., P, W, D]`` packed states as the batch's ``[..., B, T, D]`` (zeros at padding)."""
        lead = states.shape[:-3]
        flat = states.reshape(*lead, -1, states.shape[-1])
        flat = torch.cat([flat, flat.new_zeros(*lead, 1, flat.shape[-1])], dim=-2)
        return flat[..., self.gather, :]


def bins(lengths: Sequence[int], capacity: int = PACK_TOKENS, budget: int = 0) -> list[list[int]] | None:
    """Row indices per bin (each bin's rows in order of their offset), or ``None`` when the
    batch is not worth packing: a row longer than ``capacity``, fewer than half the rows saved,
    or a padded area (bins x their width) over both the batch's own and ``budget``. First fit,
    longest row first."""
    n = len(lengths)
    if n < 2 or max(lengths) > capacity:
        return None
    out: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(n), key=lambda i: -lengths[i]):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                out[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            out.append([i])
            room.append(capacity - lengths[i])
    width = capacity - min(room)
    if 2 * len(out) > n or len(out) * width > max(n * max(lengths), budget):
        return None
    return out


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, lengths: Sequence[int], pad_id: int,
         capacity: int = PACK_TOKENS, budget: int = 0) -> Packing | None:
    """The right-padded batch ``input_ids``/``attention_mask`` (``[B, T]``; row ``i`` holds
    ``lengths[i]`` tokens) packed into bins, or ``None`` (see :func:`bins`)."""
    groups = bins(lengths, capacity, budget)
    if groups is None:
        return None
    n_bins, n = len(groups), len(lengths)
    width = max(sum(lengths[i] for i in b) for b in groups)
    length = torch.as_tensor(lengths, dtype=torch.long)
    start = torch.empty(n, dtype=torch.long)  # each row's first token in the flattened [P * W]
    for p, group in enumerate(groups):
        offset = p * width
        for i in group:
            start[i] = offset
            offset += lengths[i]
    row = torch.repeat_interleave(torch.arange(n), length)  # per token of the batch, in row order
    position = torch.arange(len(row)) - torch.repeat_interleave(torch.cumsum(length, 0) - length, length)
    dest = start[row] + position
    ids = torch.full((n_bins * width,), pad_id, dtype=input_ids.dtype)
    ids[dest] = input_ids[row, position]
    keys = torch.zeros(n_bins * width, dtype=torch.bool)
    keys[dest] = attention_mask[row, position].bool()
    segment = torch.zeros(n_bins * width, dtype=torch.long)  # 0: a bin's padding
    segment[dest] = row + 1
    positions = torch.zeros(n_bins * width, dtype=torch.long)
    positions[dest] = position
    gather = torch.full(attention_mask.shape, n_bins * width, dtype=torch.long)
    gather[row, position] = dest
    segment, keys = segment.view(n_bins, width), keys.view(n_bins, width)
    mask = (segment[:, :, None] == segment[:, None, :]) & (keys | (segment == 0))[:, None, :]
    return Packing(ids.view(n_bins, width), mask[:, None], positions.view(n_bins, width), gather)
