"""SPLADE pooling (Formal et al., "SPLADE v2", 2021) for models with a masked-language-model head:
each token state goes through the model's MLM head to vocabulary logits ``w_tj``, and the text's
weight of vocabulary entry ``j`` is

    w_j = max_t log(1 + ReLU(w_tj))

over the text's tokens (special tokens included, as sentence-transformers' ``SpladePooling`` with
``pooling_strategy="max"`` takes them): a sparse vector of the vocabulary's size, scored by dot
product. It equals sentence-transformers' ``SparseEncoder`` (``MLMTransformer`` + ``SpladePooling``)
on the same checkpoint (``tests/poolers/test_splade.py``).

**The MLM head.** The encoder runs the model's base transformer once for every pooler; this
pooler applies the checkpoint's MLM head to those token states (in float32, one row at a time, so
the ``[tokens, vocabulary]`` logits of a forward batch are never held at once). The head is
loaded from the model's folder by transformers' ``AutoModelForMaskedLM`` when the pooler is bound
to the encoder; a checkpoint without the head's weights (the packaged all-MiniLM-L6-v2 has none:
transformers would initialise them at random) is refused with a message. Architectures whose
MLM head is one module over the last hidden states (BERT's ``cls``, RoBERTa's ``lm_head``, and
the like) are supported; others are refused by name.

**Output.** The vector is never normalized nor truncated (``dimensions`` does not apply: its
size is the vocabulary's, and SPLADE scores are dot products). ``top_k=k`` keeps the ``k``
largest weights of each text and ``threshold=x`` drops weights ``<= x`` (defaults: every
non-zero weight); :func:`sparse_entries` gives its non-zeros as ``indices`` + ``values`` (and
the vocabulary's token strings on request), as the server's ``/embed`` and ``embedpool embed``
print it (the server also in TEI's ``/tei/embed_sparse`` shape).
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from embedpool.errors import InvalidError
from embedpool.poolers.base import Pooler, register
from embedpool.poolers.stack import LOADING
from embedpool.poolers.states import TokenStates

_HEADS: dict[str, tuple[nn.Module, int]] = {}  # model path -> (MLM head, vocabulary size)
_LOCK = threading.Lock()


def mlm_head(path: str, model_id: str) -> tuple[nn.Module, int]:
    """The MLM head of the checkpoint at ``path`` (hidden states ``[.., H]`` -> logits ``[.., V]``)
    and its vocabulary size, loaded once per path.

    Raises:
        InvalidError: the checkpoint has no MLM head weights, or its architecture's head is not
            one module over the hidden states.
    """
    with _LOCK:
        if path not in _HEADS:
            _HEADS[path] = _load_head(path, model_id)
        return _HEADS[path]


def _load_head(path: str, model_id: str) -> tuple[nn.Module, int]:
    from transformers import AutoConfig, AutoModelForMaskedLM
    from transformers.utils import logging as hf_logging

    refusal = (f"pooler 'splade' needs a model with a masked-language-model head (a SPLADE or other MLM "
               f"checkpoint); {model_id!r}")
    try:
        AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise InvalidError(f"{refusal} has no readable transformers config ({exc})") from None
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the load report lists the base model's own unused weights
    try:
        with LOADING:  # see poolers.stack.LOADING
            model, info = AutoModelForMaskedLM.from_pretrained(path, local_files_only=True, output_loading_info=True)
    except (OSError, ValueError, KeyError) as exc:
        raise InvalidError(f"{refusal} cannot be loaded as one ({exc})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    base = model.base_model_prefix
    heads = [(name, m) for name, m in model.named_children() if name != base and any(True for _ in m.parameters())]
    missing = [k for k in info.get("missing_keys", []) if not k.startswith(base + ".")]
    if missing:
        raise InvalidError(f"{refusal} has none: its checkpoint lacks the head's weights ({', '.join(missing[:3])}"
                           f"{', ...' if len(missing) > 3 else ''}), which would be random")
    if len(heads) != 1:
        raise InvalidError(f"{refusal}: the MLM head of {type(model).__name__} is not one module over the hidden "
                           f"states ({', '.join(n for n, _ in heads)}); this architecture is not supported")
    head = heads[0][1].eval().float()
    for p in head.parameters():
        p.requires_grad_(False)
    return head, int(model.config.vocab_size)


def sparse_entries(vectors: Sequence[np.ndarray], tokenizer: Any = None) -> list[dict[str, list]]:
    """Each sparse vector's non-zero weights as ``{"indices": [...], "values": [...]}`` (ascending
    vocabulary ids, Python floats); with a ``tokenizer``, also ``"tokens"``: its strings of the ids."""
    out = []
    for v in vectors:
        v = np.asarray(v)
        idx = np.flatnonzero(v)
        entry: dict[str, list] = {"indices": idx.tolist(), "values": v[idx].astype(float).tolist()}
        if tokenizer is not None:
            entry["tokens"] = tokenizer.convert_ids_to_tokens(entry["indices"])
        out.append(entry)
    return out


def splade_weights(logits: Tensor, mask: Tensor) -> Tensor:
    """``max_t log(1 + ReLU(logits[t]))`` over the tokens where ``mask`` is 1: ``[T, V]``, ``[T]`` -> ``[V]``."""
    return torch.log1p(torch.relu(logits[mask.bool()])).amax(dim=0)


@register
class SpladePooler(Pooler):
    """SPLADE: max over tokens of ``log(1 + ReLU(MLM logits))``, a sparse vocabulary-sized vector.

    Args:
        top_k: keep the ``top_k`` largest weights of each text (0: all).
        threshold: drop weights ``<= threshold``.
    """

    name = "splade"
    options = {"top_k": int, "threshold": float}
    top_k = 0
    threshold = 0.0
    binds_model: ClassVar[bool] = True
    sparse: ClassVar[bool] = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.top_k < 0 or self.threshold < 0:
            raise InvalidError(f"splade: top_k and threshold must be >= 0, got {self.top_k} and {self.threshold}",
                               param="pooler")
        self.head: nn.Module | None = None
        self.vocab: int | None = None

    def bind(self, model_id: str | None) -> None:
        """Load the MLM head of the encoder ``model_id``; refuse a model without one."""
        from embedpool.poolers.encoder import resolve_model

        if model_id is None:
            return
        self.head, self.vocab = mlm_head(resolve_model(model_id)[1], model_id)

    def output_dim(self, model_dim: int) -> int | None:
        return self.vocab

    def pool(self, states: TokenStates) -> Tensor:
        if self.head is None:
            raise InvalidError("pooler 'splade' is not bound to a model with an MLM head")
        if not states.one_row_per_text:
            raise InvalidError("splade pooling runs on the standard tokenization plan")
        out = []
        with torch.inference_mode():
            for row, mask in zip(states.hidden, states.attention_mask):  # one row's [T, V] logits at a time
                out.append(self.sparsify(splade_weights(self.head(row.float()), mask)))
        return torch.stack(out)

    def sparsify(self, w: Tensor) -> Tensor:
        """``w`` with the weights ``top_k`` and ``threshold`` drop set to 0."""
        if self.threshold > 0:
            w = torch.where(w > self.threshold, w, torch.zeros_like(w))
        if self.top_k and self.top_k < w.shape[-1]:
            keep = w.topk(self.top_k).indices
            w = torch.zeros_like(w).index_copy_(0, keep, w[keep])
        return w
