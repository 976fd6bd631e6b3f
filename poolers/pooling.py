"""``pooling``: sentence-transformers' own ``Pooling`` module, with any of its modes or their
concatenation, run on embedpool's token states.

``auto`` resolves to it for a model whose Pooling embedpool has no pooler of its own for
(``lasttoken`` and ``weightedmean`` of decoder-only embedders, ``mean_sqrt_len_tokens``,
concatenations such as ``mean+max``, ``cls`` of a model that excludes its prompt). The module
is sentence-transformers' (not written again here), so the vectors are what ``encode()``
pools, mode by mode, in the module's concatenation order.
"""

from __future__ import annotations

from torch import Tensor

from embedpool.errors import InvalidError
from embedpool.poolers.base import Pooler, register
from embedpool.poolers.states import TokenStates

MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")


@register
class PoolingPooler(Pooler):
    """sentence-transformers' ``Pooling`` with these modes.

    Args:
        mode: one mode or several joined by ``+`` (concatenated in that order): ``cls``,
            ``max``, ``mean``, ``mean_sqrt_len_tokens``, ``weightedmean``, ``lasttoken``.
    """

    name = "pooling"
    options = {"mode": str}
    mode = "mean"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        modes = tuple(m.strip() for m in self.mode.split("+") if m.strip())
        bad = [m for m in modes if m not in MODES]
        if not modes or bad:
            raise InvalidError(f"pooler 'pooling': mode={self.mode!r}; use one of {', '.join(MODES)} "
                               "or several joined by +", param="pooler")
        self.modes = modes
        self._module = None

    @property
    def width(self) -> int:
        """How many hidden sizes wide the vectors are (one per mode)."""
        return len(self.modes)

    def pool(self, states: TokenStates) -> Tensor:
        if not states.one_row_per_text:
            raise InvalidError("pooler 'pooling' pools one window per text (the standard plan)")
        if self._module is None:
            from sentence_transformers.sentence_transformer.modules import Pooling

            self._module = Pooling(states.hidden.shape[-1], pooling_mode=self.modes if len(self.modes) > 1
                                   else self.modes[0], include_prompt=False)
        # a model that leaves its prompt out of pooling: the module drops the prompt's leading
        # positions itself (its weightedmean keeps the other tokens' positions); else the tokens
        # the poolers pool (a ColBERT model's scored tokens)
        if states.prompt_tokens:
            features = {"token_embeddings": states.hidden, "attention_mask": states.attention_mask,
                        "prompt_length": states.prompt_tokens}
        else:
            features = {"token_embeddings": states.hidden, "attention_mask": states.pool_mask}
        return self._module(features)["sentence_embedding"]
