"""Cross-encoder rerankers: a sequence-classification model that reads a query and a document
together and gives one relevance score per pair (sentence-transformers' ``CrossEncoder``).

:func:`is_cross_encoder` tells such a model from an embedding model by its files (a
sentence-transformers ``CrossEncoder`` save, or a bare transformers checkpoint whose architecture
is ``...ForSequenceClassification``). :class:`CrossEncoderModel` loads it through
sentence-transformers' ``CrossEncoder`` (its tokenizer, its transformers model, its activation as
``CrossEncoder.predict`` applies it) and scores pairs:

- its transformer runs on the encoder's precision paths (:mod:`poolers.precision`: fp32, bf16,
  OpenVINO, ...; ``auto`` picks as for embeddings, and falls back to fp32 as the encoder does),
  and the model's own classification head (BERT's pooler and classifier, RoBERTa's and
  ModernBERT's heads, ...) runs in torch on its token states, through the transformers module
  itself (:class:`_GivenStates`), so no head is written here;
- pairs are tokenized as ``CrossEncoder`` tokenizes them (``tokenizer(query, document)``,
  ``longest_first`` truncation at the model's window), sorted by length and cut into forward
  batches of at most ``max_batch_tokens`` padded tokens.

The score of a pair, for a single-logit head, is the activation of the logit (``Sigmoid`` unless
the model says otherwise); its raw score the logit. For a two-logit head: the softmax probability
of the second label (``CrossEncoder.predict(apply_softmax=True)[:, 1]``, after the model's
activation) and, raw, ``logit[1] - logit[0]`` (whose sigmoid is that probability). A head with
more labels is a classifier, not a reranker, and is refused.

:meth:`CrossEncoderModel.measure` and :meth:`CrossEncoderModel.embed` take the same arguments as
:class:`poolers.Embedder`'s (the items are ``(query, document)`` pairs, the one "pooler" is
:data:`SCORE`, whose "vector" per pair is ``[score, raw score]``), so the server's batcher
schedules, token-budgets and batches pairs across requests exactly as it does texts.
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
import threading
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from embedpool.errors import InvalidError
from embedpool.poolers.encoder import EncoderStats, resolve_model
from embedpool.poolers.pipeline import EmbedOptions, EmbedResult, Workload
from embedpool.poolers.stack import LOADING, local_snapshot, read_model_file

log = logging.getLogger(__name__)

#: the one output of a cross-encoder: per pair ``[score, raw score]``
SCORE = "score"
#: a tokenizer's ``model_max_length`` above this means "not set" (transformers' 1e30)
_UNSET_LENGTH = 1_000_000
#: position embeddings that start after the padding index (RoBERTa's family): this many fewer usable
_POSITION_OFFSET_TYPES = ("roberta", "xlm-roberta", "camembert")


def is_cross_encoder(path: str | None) -> bool:
    """Whether the model at ``path`` (a folder, or a Hugging Face id in the local cache) is a
    cross-encoder: saved by sentence-transformers' ``CrossEncoder``, or a transformers checkpoint
    of a sequence-classification architecture without a sentence-transformers module stack."""
    if not path:
        return False
    st = read_model_file(path, "config_sentence_transformers.json")
    if st.get("model_type") == "CrossEncoder":
        return True
    config = read_model_file(path, "config.json")
    archs = config.get("architectures") or []
    if not (archs and str(archs[0]).endswith("ForSequenceClassification")):
        return False
    modules = read_model_file(path, "modules.json")
    return not any(str(m.get("type", "")).endswith("Pooling") for m in (modules if isinstance(modules, list) else []))


@dataclass(frozen=True)
class PairTokens:
    """One pair as the model reads it (specials included), and the options that made it."""

    key: tuple
    ids: np.ndarray
    type_ids: np.ndarray


class _GivenStates(torch.nn.Module):
    """Stands in for a classification model's transformer: answers the token states the precision
    path computed (and, for a transformer with a pooler of its own, BERT's, that pooler's output
    of them), so the model's own head runs on them unchanged."""

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.pooler = getattr(base, "pooler", None)
        self.states: torch.Tensor | None = None

    def forward(self, *args, **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        pooled = self.pooler(self.states) if self.pooler is not None else None
        return BaseModelOutputWithPooling(last_hidden_state=self.states, pooler_output=pooled)


class CrossEncoderModel:
    """A loaded cross-encoder (see the module docstring).

    Args:
        model: a folder or a Hugging Face id in the local cache.
        precision: as :class:`poolers.FrozenEncoder`'s (``auto``: this CPU's path).
        max_batch_tokens: padded tokens of one forward batch.
        calibration: texts for static int8 calibration (``openvino-int8`` only).

    Attributes:
        kind: ``reranker``.
        num_labels: 1 or 2.
        activation: the model's activation, as ``CrossEncoder`` applies it.
        max_length: the model's window: a pair's tokens, specials included.
        precision, precision_reason: the forward path used and why.
    """

    kind = "reranker"

    def __init__(self, model: str | None, precision: str = "auto", max_batch_tokens: int = 2048,
                 calibration: Sequence[str] | None = None) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from sentence_transformers import CrossEncoder
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.model_id, path = resolve_model(model)
        with LOADING:  # see poolers.stack.LOADING
            ce = CrossEncoder(local_snapshot(path), device="cpu", local_files_only=True)
        self.model = ce.model
        if self.model is None or not type(self.model).__name__.endswith("ForSequenceClassification"):
            raise InvalidError(f"model {self.model_id!r} is a CrossEncoder of another kind "
                               f"({type(self.model).__name__}); embedpool serves sequence-classification "
                               "cross-encoders", param="model")
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = ce.tokenizer
        self.num_labels = int(self.model.config.num_labels)
        if self.num_labels not in (1, 2):
            raise InvalidError(f"model {self.model_id!r} is a classifier of {self.num_labels} labels, not a reranker "
                               "(a single-logit or two-logit head)", param="model")
        self.activation = ce.activation_fn
        self.max_length = self._window(ce.max_seq_length)
        self.max_batch_tokens = int(max_batch_tokens)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._token_types = ("token_type_ids" in self.tokenizer.model_input_names
                             and "token_type_ids" in inspect.signature(self.model.forward).parameters)
        self.stats = EncoderStats()
        self._tokenizer_lock = threading.Lock()  # truncation_side is state of the tokenizer
        self._forward_lock = threading.Lock()  # the head reads the states given to it (_GivenStates)
        prefix = self.model.base_model_prefix
        self._base = getattr(self.model, prefix)
        self._given = _GivenStates(self._base)
        head = copy.copy(self.model)  # the same modules, its transformer replaced by the given states
        head._modules = dict(self.model._modules)
        head._modules[prefix] = self._given
        self._head = head
        self._load_path(precision, calibration)

    def _window(self, configured: int | None) -> int:
        window = int(configured) if configured and configured < _UNSET_LENGTH else 0
        cfg = self.model.config
        positions = getattr(cfg, "max_position_embeddings", None)
        if positions:
            if cfg.model_type in _POSITION_OFFSET_TYPES:
                positions -= (cfg.pad_token_id or 0) + 1
            window = min(window, positions) if window else positions
        return window or 512

    def _load_path(self, precision: str, calibration: Sequence[str] | None) -> None:
        """The transformer's forward on ``precision``'s path, as :class:`FrozenEncoder` builds it
        (:func:`precision.build_path`: under ``auto`` a path that cannot run the model falls back
        to fp32 with the reason). Rows are never packed: no 4D-mask graph."""
        from embedpool.poolers.precision import build_path

        self._forward, self.precision, self.precision_reason = build_path(
            precision, self._base, self.tokenizer, self.max_length, calibration, packing=False)
        log.info("cross-encoder precision %s (asked: %s): %s", self.precision, precision, self.precision_reason)

    # ------------------------------------------------------------------ what the batcher reads
    @property
    def encoder(self) -> "CrossEncoderModel":
        """The model itself: what the server's batcher and ``/info`` read from an embedder's
        encoder (``max_length``, ``stats``, ``precision``)."""
        return self

    def canonical(self, spec: str | None) -> str:
        return SCORE

    # ------------------------------------------------------------------ tokenization
    def tokenize(self, pairs: Sequence[tuple[str, str]], truncate: bool = True,
                 truncation_direction: str = "right") -> list[PairTokens]:
        """Each pair as the model reads it: ``tokenizer(query, document)``, cut at the window by
        ``longest_first`` (as ``CrossEncoder``) at ``truncation_direction``'s end when
        ``truncate``; otherwise a pair over the window raises :class:`InvalidError` naming it
        (``param`` ``texts[i]``)."""
        key = (bool(truncate), truncation_direction)
        if not pairs:
            return []
        with self._tokenizer_lock:
            side = self.tokenizer.truncation_side
            self.tokenizer.truncation_side = truncation_direction
            try:
                enc = self.tokenizer([p[0] for p in pairs], [p[1] for p in pairs],
                                     truncation="longest_first" if truncate else False,
                                     max_length=self.max_length if truncate else None,
                                     return_token_type_ids=True, return_attention_mask=False, verbose=False)
            finally:
                self.tokenizer.truncation_side = side
        out = []
        for i, ids in enumerate(enc["input_ids"]):
            if len(ids) > self.max_length:
                raise InvalidError(f"the query and this text take {len(ids)} tokens together, over the model's "
                                   f"window of {self.max_length}; shorten them, or send truncate=true to cut them",
                                   param=f"texts[{i}]")
            out.append(PairTokens(key, np.asarray(ids, dtype=np.int64),
                                  np.asarray(enc["token_type_ids"][i], dtype=np.int64)))
        return out

    def measure(self, pairs: Sequence[tuple[str, str]], specs: Sequence[str] | str | None = None,
                options: EmbedOptions | None = None) -> Workload:
        """What :meth:`embed` would run for ``pairs`` (tokens per pair, one score each) and the
        tokenization it reuses, as :meth:`poolers.Embedder.measure`."""
        options = options if options is not None else EmbedOptions()
        rows = self.tokenize(pairs, options.truncate, options.truncation_direction)
        tokens = [len(r.ids) for r in rows]
        return Workload(tokens, len(rows), list(tokens), rows)

    def work_bound(self, n: int, specs=None, options: EmbedOptions | None = None) -> None:
        return None  # pairs are always measured (a pair's length is not bounded by a text's)

    # ------------------------------------------------------------------ scoring
    def embed(self, pairs: Sequence[tuple[str, str]], specs: Sequence[str] | str | None = None,
              options: EmbedOptions | None = None, *, tokenized: Sequence[PairTokens] | None = None,
              **_) -> EmbedResult:
        """Score ``pairs`` (the batcher's call): ``vectors[SCORE][i]`` is ``[score, raw score]``
        of pair ``i`` (float32)."""
        options = options if options is not None else EmbedOptions()
        pairs = list(pairs)
        if tokenized is None:
            t0 = time.perf_counter()
            tokenized = self.tokenize(pairs, options.truncate, options.truncation_direction)
            self.stats.tokenize_seconds += time.perf_counter() - t0
        elif len(tokenized) != len(pairs):
            raise InvalidError(f"tokenized holds {len(tokenized)} pairs for {len(pairs)} pairs", param="tokenized")
        out = np.zeros((len(pairs), 2), dtype=np.float32)
        tokens_before = self.stats.tokens
        for batch in self._batches([len(t.ids) for t in tokenized]):
            out[batch] = self._score([tokenized[i] for i in batch])
        vectors = list(out)
        usage = sum(len(t.ids) for t in tokenized)
        return EmbedResult({SCORE: vectors}, {SCORE: False}, self.stats.tokens - tokens_before, [SCORE], usage)

    def scores(self, query: str, documents: Sequence[str], *, raw: bool = False, truncate: bool = True,
               truncation_direction: str = "right") -> np.ndarray:
        """Each document's score against ``query`` in one call (no server): the scores of
        :meth:`embed`, raw or not."""
        result = self.embed([(query, d) for d in documents],
                            options=EmbedOptions(truncate=truncate, truncation_direction=truncation_direction))
        rows = np.stack(result.vectors[SCORE]) if documents else np.zeros((0, 2), np.float32)
        return rows[:, 1 if raw else 0]

    def _batches(self, lengths: list[int]) -> list[list[int]]:
        """Pair indices, longest first, cut where rows × padded width would pass the budget."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        batches: list[list[int]] = []
        for i in order:
            if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= self.max_batch_tokens:
                batches[-1].append(i)
            else:
                batches.append([i])
        return batches

    def _score(self, rows: list[PairTokens]) -> np.ndarray:
        """``[score, raw]`` per row of one forward batch."""
        t0 = time.perf_counter()
        width = max(len(r.ids) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        types = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r.ids)] = torch.from_numpy(r.ids)
            types[i, :len(r.ids)] = torch.from_numpy(r.type_ids)
            mask[i, :len(r.ids)] = 1
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if self.precision == "bf16" else nullcontext()
        token_types = types if self._token_types else None
        with self._forward_lock, torch.inference_mode(), autocast:
            states = self._forward(input_ids=ids, attention_mask=mask, token_type_ids=token_types,
                                   output_hidden_states=False).last_hidden_state
            self._given.states = states.float()
            extra = {"token_type_ids": token_types} if self._token_types else {}
            logits = self._head(input_ids=ids, attention_mask=mask, **extra).logits.float()
            self._given.states = None
        if self.num_labels == 1:
            scores, raw = self.activation(logits)[:, 0], logits[:, 0]
        else:
            scores = torch.softmax(self.activation(logits), dim=1)[:, 1]
            raw = logits[:, 1] - logits[:, 0]
        self.stats.forward_calls += 1
        self.stats.tokens += int(mask.sum())
        self.stats.forward_seconds += time.perf_counter() - t0
        return torch.stack([scores, raw], dim=1).numpy()
