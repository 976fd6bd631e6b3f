"""Landmark (LMK) pooling: the mean of the ``[SEP]`` states inserted after every chunk.

"LMK > CLS: Landmark Pooling for Dense Embeddings" (arXiv 2601.21525): the text is tokenized
without specials, a ``[SEP]`` is appended after every chunk of ``g`` tokens (the last chunk
included) and ``[CLS]`` is prepended; the embedding is the mean of the landmark states, the
``[CLS]`` state left out. Inputs longer than the encoder window are encoded as several windows
(see :class:`poolers.encoder.FrozenEncoder`) and the landmarks of all windows are averaged; a
text with more windows than one forward batch is averaged batch by batch (weighted by each
batch's landmark count), so its cost and memory are linear in its length.
"""

from __future__ import annotations

from torch import Tensor

from embedpool.errors import InvalidError
from embedpool.poolers.base import WeightedMeanPooler, per_window_option, register
from embedpool.poolers.encoder import Plan
from embedpool.poolers.states import TokenStates


@register
@per_window_option
class LandmarkPooler(WeightedMeanPooler):
    """Mean of the landmark states.

    Args:
        g: chunk length in tokens between landmarks (default 32).
        per_window: one vector per window (of the landmark plan) for documents, one over all
            windows for queries (see :class:`poolers.base.PerWindow`).
    """

    name = "landmark"
    options = {"g": int}
    g = 32

    @property
    def plan(self) -> Plan:
        return Plan("landmark", self.g)

    def weights(self, states: TokenStates) -> Tensor:
        if states.landmark_mask is None:
            raise InvalidError("landmark pooling needs token states from the landmark tokenization plan")
        return states.landmark_mask
